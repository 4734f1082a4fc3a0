"""Tool YAML loading (verl 0.9.1's format, the packaged example config, a verl-style tool file with verl
renamed to pyrl, function_tool_path beside it) and the calculator tool on hand-computed cases."""

import asyncio
import importlib.resources
import re
import time

import pytest

from pyrl.tools import function_tool as ft
from pyrl.tools.base_tool import BaseTool
from pyrl.tools.calculator import CalculatorTool
from pyrl.tools.schemas import ToolResponse
from pyrl.tools.tool_registry import initialize_tools_from_config, load_all_tools


@pytest.fixture(autouse=True)
def empty_registry(monkeypatch):
    monkeypatch.setattr(ft, "FUNCTION_TOOL_REGISTRY", {})
    monkeypatch.setattr(ft, "_LOADED_FUNCTION_TOOL_PATHS", {})


def packaged_config(name: str) -> str:
    """A config shipped as package data (pyrl.configs), found the same way after any install."""
    return str(importlib.resources.files("pyrl.configs") / "tools" / name)


def run_tool(tool: BaseTool, arguments: dict, **create_kwargs):
    """One call as the agent loop makes it: create, execute, release."""
    async def go():
        instance_id, _ = await tool.create(create_kwargs=create_kwargs)
        try:
            return await tool.execute(instance_id, arguments)
        finally:
            await tool.release(instance_id)

    return asyncio.run(go())


def calc(expression) -> str:
    response, reward, metrics = run_tool(CalculatorTool(config={}, tool_schema=None), {"expression": expression})
    assert reward == 0.0 and metrics == {}
    return response.text


def test_packaged_calculator_config_loads_and_runs():
    (tool,) = initialize_tools_from_config(packaged_config("calculator.yaml"))
    assert isinstance(tool, CalculatorTool) and tool.name == "calculator"
    assert tool.config == {"type": "native"}
    assert tool.tool_schema == CalculatorTool(config={}).get_openai_tool_schema()  # the YAML spells out the default
    assert run_tool(tool, {"expression": "(12 + 7) * 3 / 4"})[0] == ToolResponse(text="14.25")


def test_tool_schema_may_be_left_out_or_rename_the_tool(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("""
tools:
  - class_name: pyrl.tools.calculator.CalculatorTool
    config: {type: native}
  - class_name: pyrl.tools.calculator.CalculatorTool
    config: {}
    tool_schema:
      type: function
      function:
        name: calc2
        description: Another calculator.
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
""")
    default, renamed = initialize_tools_from_config(str(path))
    assert default.name == "calculator" and default.tool_schema.function.parameters.required == ["expression"]
    assert renamed.name == "calc2" and renamed.tool_schema.function.description == "Another calculator."


VERL_STYLE_TOOL = '''
import json
from typing import Any, Optional
from uuid import uuid4

from pyrl.tools.base_tool import BaseTool
from pyrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class AnswerCheckTool(BaseTool):
    """Shaped like verl's Gsm8kTool: per-instance state, reward from the state."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        self._instance_dict[instance_id]["response"] = answer
        reward = await self.calc_reward(instance_id)
        tool_reward = self.config.get("bonus", 0.0) if reward > self._instance_dict[instance_id]["reward"] else 0.0
        self._instance_dict[instance_id]["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), tool_reward, {"checked": json.dumps(answer)}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return 1.0 if state["response"] == state["ground_truth"] else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
'''

VERL_STYLE_CONFIG = """
tools:
  - class_name: "verl_style_tools.AnswerCheckTool"
    config:
      type: native
      bonus: 0.5
    tool_schema:
      type: "function"
      function:
        name: "check_answer"
        description: "Check the answer to the question."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer, must be a digits"
          required: ["answer"]
"""


def test_verl_style_tool_file_loads_through_the_yaml(tmp_path, monkeypatch):
    (tmp_path / "verl_style_tools.py").write_text(VERL_STYLE_TOOL)
    (tmp_path / "tools.yaml").write_text(VERL_STYLE_CONFIG)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tool,) = initialize_tools_from_config(str(tmp_path / "tools.yaml"))
    assert tool.name == "check_answer" and tool.config == {"type": "native", "bonus": 0.5}
    assert run_tool(tool, {"answer": "42"}, ground_truth="42") == (
        ToolResponse(text="Current parsed answer='42' reward=1.0"), 0.5, {"checked": '"42"'})
    assert run_tool(tool, {"answer": "41"}, ground_truth="42")[1] == 0.0
    assert tool._instance_dict == {}  # released


def test_function_tool_path_beside_the_yaml(tmp_path):
    functions = tmp_path / "functions.py"
    functions.write_text('''
from pyrl.tools.function_tool import function_tool


@function_tool
def reverse(text: str) -> str:
    """Reverse a text.

    Args:
        text: The text.
    """
    return text[::-1]
''')
    tools = load_all_tools(packaged_config("calculator.yaml"), str(functions))
    assert [tool.name for tool in tools] == ["calculator", "reverse"]
    assert load_all_tools(None, None) == []

    clash = tmp_path / "clash.py"
    clash.write_text('''
from pyrl.tools.function_tool import function_tool


@function_tool
def calculator(expression: str) -> str:
    """Not the real calculator.

    Args:
        expression: The expression.
    """
    return expression
''')
    with pytest.raises(ValueError, match=r"\['calculator'\].*unique"):
        load_all_tools(packaged_config("calculator.yaml"), str(clash))


@pytest.mark.parametrize("text, message", [
    ("tool: []", "top-level `tools:`"),
    ("tools:\n  - config: {type: native}", "tools\\[0\\]: expected `class_name`"),
    ("tools:\n  - class_name: pyrl.tools.calculator.CalculatorTool\n    config: {type: mcp}", "'mcp' is not supported"),
    ("tools:\n  - class_name: CalculatorTool", "dotted path"),
    ("tools:\n  - class_name: pyrl.tools.calculator.NoSuchTool", "has no NoSuchTool"),
])
def test_bad_tool_configs_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises((ValueError, ImportError), match=message):
        initialize_tools_from_config(str(path))


def test_base_tool_needs_a_schema():
    with pytest.raises(ValueError, match="tool_schema is required"):
        BaseTool(config={}, tool_schema=None)


@pytest.mark.parametrize("expression, expected", [
    ("1 + 2", "3"),
    ("2 * (3 + 4) - 5", "9"),
    ("6 / 3", "2"),
    ("7 / 2", "3.5"),
    ("1 / 3", "0.3333333333333333"),
    ("2 / 3", "0.6666666666666667"),
    ("0.1 + 0.2", "0.3"),
    ("1.5 * 4", "6"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("7 % 3", "1"),
    ("-7 % 3", "2"),
    ("5.5 % 2", "1.5"),
    ("2 ** 10", "1024"),
    ("2 ** -2", "0.25"),
    ("-2 ** 2", "-4"),
    ("(-2) ** 3", "-8"),
    ("2 ** 3 ** 2", "512"),
    ("4 ** 0.5", "2"),
    ("2 ** 0.5", "1.414213562373095"),
    ("+-+3", "-3"),
    ("123456789 * 987654321", "121932631112635269"),
    ("2 ** 100", "1267650600228229401496703205376"),
    ("1e3 + 1", "1001"),
    ("10 ** -5", "0.00001"),
    ("1 / 10 ** 20", "1e-20"),
    (" \n 3 * 3 \n", "9"),
])
def test_calculator_hand_computed(expression, expected):
    assert calc(expression) == expected


@pytest.mark.parametrize("expression", ["9**9**9", "2**10**10", "10**(10**6)", "(2**3000)**2", "1.5**100000",
                                        "(-3)**10**9", "1e999", "2**4000", "10**1001"])
def test_calculator_refuses_huge_numbers_fast(expression):
    start = time.perf_counter()
    assert calc(expression).startswith("Error: ") and "too large" in calc(expression)
    assert time.perf_counter() - start < 1.0


def test_calculator_keeps_numbers_up_to_the_cap_exact_and_tiny_ones_approximate():
    assert calc("2**3000") == str(2 ** 3000)
    assert calc("(1/3)**2000 * 3**2000") == "1"  # exact while the denominator fits the cap
    assert calc("1 / 3**1000 / 3**1000 * 3**2000") == "1"
    assert calc("1 / 10**40") == "1e-40"
    assert calc("1 / 3**2000 / 3**2000") == "0"  # below 2**-3321: cut to the cap's binary places
    assert calc("(1/2)**100000") == "0"  # underflows, as floating point would


@pytest.mark.parametrize("expression, message", [
    ("1 / 0", "division by zero"),
    ("1 // 0", "division by zero"),
    ("5 % 0.0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** (1/3)", "negative"),
    ("2 ^ 3", "use \\*\\*"),
    ("1 +", "invalid syntax"),
    ("", "invalid syntax"),
    ("abc", "unsupported expression 'abc'"),
    ("__import__('os').system('true')", "unsupported expression"),
    ("'a' * 3", "unsupported literal 'a'"),
    ("True + 1", "unsupported literal True"),
    ("1 < 2", "unsupported expression"),
    ("[1, 2]", "unsupported expression"),
    ("1j * 1", "unsupported literal"),
    ("(" * 5000 + "1" + ")" * 5000, "too long"),
    ("(" * 400 + "1" + ")" * 400, ""),  # deep but short: evaluated or refused, never an exception
])
def test_calculator_errors_are_messages(expression, message):
    text = calc(expression)
    if message:
        assert text.startswith("Error: ") and re.search(message, text), text


def test_calculator_needs_a_string_expression():
    assert calc(12) == "Error: expected a string argument 'expression'"
    response, _, _ = run_tool(CalculatorTool(config={}), {})
    assert response.text == "Error: expected a string argument 'expression'"
