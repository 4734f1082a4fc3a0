"""Tools that a model calls during multi-turn rollout, with verl 0.9.1's interfaces (`verl.tools` with
`pyrl` for `verl`, so verl tool files run after that one rename): BaseTool subclasses declared in a tool
YAML, plain functions registered with @function_tool, the OpenAI-style schemas they exchange, and two
built-in tools, `calculator` (pyrl.tools.calculator) and `code_interpreter` (pyrl.tools.code_interpreter,
runs code in pyrl.sandbox). Example configs: pyrl/configs/tools/*.yaml.

Left out of verl's package: multimodal tools (ToolResponse keeps its image/video fields only so that verl
tool files construct it unchanged) and the MCP tool type (removed in verl 0.9.1 too). This package knows
nothing of Ray or the trainer.

The decorator is imported from its module, `from pyrl.tools.function_tool import function_tool` (as in verl):
re-exported here it would hide the submodule of the same name.
"""

from pyrl.tools.base_tool import BaseTool
from pyrl.tools.function_tool import FunctionTool, normalize_function_tool_return
from pyrl.tools.schemas import (
                                OpenAIFunctionCallSchema,
                                OpenAIFunctionParsedSchema,
                                OpenAIFunctionToolSchema,
                                ToolResponse,
)
from pyrl.tools.tool_registry import initialize_tools_from_config, load_all_tools

__all__ = ["BaseTool", "FunctionTool", "OpenAIFunctionCallSchema", "OpenAIFunctionParsedSchema",
           "OpenAIFunctionToolSchema", "ToolResponse", "initialize_tools_from_config", "load_all_tools",
           "normalize_function_tool_return"]
