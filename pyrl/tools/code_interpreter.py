"""`code_interpreter`: a built-in tool that runs the model's Python program in pyrl.sandbox and answers with
what it printed, so that a model can compute, check or search by writing code.

The tool's `config` (from the tool YAML) holds pyrl.sandbox.SandboxLimits fields (wall_s, cpu_s, memory_mb,
max_processes, max_output_bytes, max_file_bytes) for every call; the ones left out keep the sandbox's
defaults; `allow_unisolated: true` lets it run programs on a machine that cannot put them behind a kernel
boundary (pyrl.sandbox refuses to otherwise, naming what is missing). A run that succeeds answers with its stdout; one
that fails, times out or hits a limit answers with its stdout and stderr and the sandbox's one-line account of what
happened, so the model sees why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pyrl.sandbox import SandboxLimits, check_isolation, run_code_async
from pyrl.tools.base_tool import BaseTool
from pyrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

_LIMIT_KEYS = tuple(field.name for field in dataclasses.fields(SandboxLimits))


class CodeInterpreterTool(BaseTool):
    """Runs `{"code": str}` as a Python program under the configured limits."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | dict | None = None):
        super().__init__(config, tool_schema)
        unknown = sorted(set(config) - set(_LIMIT_KEYS) - {"type", "allow_unisolated"})
        if unknown:
            raise ValueError(f"{self.name} tool config: unknown key(s) {unknown}; expected SandboxLimits fields "
                             f"{list(_LIMIT_KEYS)}, allow_unisolated (and verl's `type`)")
        self.limits = SandboxLimits(**{key: config[key] for key in _LIMIT_KEYS if key in config})
        self.allow_unisolated = config.get("allow_unisolated", False)
        if not isinstance(self.allow_unisolated, bool):
            raise ValueError(f"{self.name} tool config: allow_unisolated: expected true or false, got "
                             f"{self.allow_unisolated!r}")
        check_isolation(self.allow_unisolated)  # at start: a machine that cannot isolate the code stops the run

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {
                "name": "code_interpreter",
                "description": "Run a Python program and return what it prints.",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string",
                                            "description": "The Python source; print the values you need."}},
                    "required": ["code"],
                },
            },
        })

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code")
        if not isinstance(code, str):
            return ToolResponse(text="Error: expected a string argument 'code'"), 0.0, {}
        result = await run_code_async(code, limits=self.limits, allow_unisolated=self.allow_unisolated)
        metrics = {"status": result.status, "wall_s": result.wall_s}
        if result.ok:
            return ToolResponse(text=result.stdout), 0.0, metrics
        text = "".join(part if part.endswith("\n") else part + "\n" for part in (result.stdout, result.stderr) if part)
        return ToolResponse(text=text + result.message), 0.0, metrics
