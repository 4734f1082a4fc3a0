"""The code_interpreter tool: runs the model's program in pyrl.sandbox under the limits of its tool config and
answers with stdout, or with the output and the sandbox's account of what went wrong."""

import asyncio
import importlib.resources

import pytest

from pyrl.sandbox import SandboxLimits
from pyrl.tools.code_interpreter import CodeInterpreterTool
from pyrl.tools.tool_registry import initialize_tools_from_config


def run(tool, arguments):
    async def go():
        instance_id, _ = await tool.create(create_kwargs={})
        try:
            return await tool.execute(instance_id, arguments)
        finally:
            await tool.release(instance_id)

    return asyncio.run(go())


def test_packaged_config_loads_with_its_limits():
    path = str(importlib.resources.files("pyrl.configs") / "tools" / "code_interpreter.yaml")
    (tool,) = initialize_tools_from_config(path)
    assert isinstance(tool, CodeInterpreterTool) and tool.name == "code_interpreter"
    assert tool.limits == SandboxLimits(wall_s=10, cpu_s=5, memory_mb=512, max_processes=16, max_output_bytes=8192)
    assert tool.tool_schema == CodeInterpreterTool(config={}).get_openai_tool_schema()
    response, reward, metrics = run(tool, {"code": "print(sum(i * i for i in range(10)))\nprint('done')"})
    assert response.text == "285\ndone\n" and reward == 0.0 and metrics["status"] == "ok"


def test_timeout_is_reported_as_text_with_the_output_so_far(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("""
tools:
  - class_name: pyrl.tools.code_interpreter.CodeInterpreterTool
    config: {type: native, wall_s: 1, cpu_s: 1}
""")
    (tool,) = initialize_tools_from_config(str(path))
    response, _, metrics = run(tool, {"code": "import time\nprint('started', flush=True)\ntime.sleep(30)"})
    assert metrics["status"] == "timeout" and metrics["wall_s"] < 10
    assert response.text == "started\nwall-clock limit of 1 s exceeded: the process was killed"


def test_errors_show_stderr_and_the_sandbox_message():
    tool = CodeInterpreterTool(config={"wall_s": 5})
    response, _, metrics = run(tool, {"code": "print('before')\n1 / 0"})
    assert metrics["status"] == "error"
    assert response.text.startswith("before\nTraceback (most recent call last):")
    assert response.text.endswith("ZeroDivisionError: division by zero\n"
                                  "exited with code 1: ZeroDivisionError: division by zero")

    response, _, metrics = run(CodeInterpreterTool(config={"max_output_bytes": 100}), {"code": "print('x' * 1000)"})
    assert metrics["status"] == "output_limit"
    assert response.text == "x" * 100 + "\nstdout passed the limit of 100 bytes: the output is cut there and the " \
                                        "process was killed"


def test_arguments_and_config_are_checked():
    assert run(CodeInterpreterTool(config={}), {"source": "print(1)"})[0].text == \
        "Error: expected a string argument 'code'"
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['timeout'\]; expected SandboxLimits fields"):
        CodeInterpreterTool(config={"type": "native", "timeout": 3})
    with pytest.raises(ValueError, match="SandboxLimits.wall_s"):
        CodeInterpreterTool(config={"wall_s": -1})
