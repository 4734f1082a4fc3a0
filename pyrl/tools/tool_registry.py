"""Tools from configuration (verl 0.9.1's `verl.tools.tool_registry`): the tool YAML that the rollout's
`multi_turn.tool_config_path` names, plus the function tools of `multi_turn.function_tool_path`.

The YAML is verl's:

    tools:
      - class_name: pyrl.tools.calculator.CalculatorTool   # dotted import path of a BaseTool subclass
        config: {type: native, ...}                        # handed to the tool as `config`
        tool_schema: {type: function, function: {...}}     # optional when the class has a default schema

verl's only tool type is `native` (its MCP tools were removed); pyrl takes a missing `type` as native and
refuses any other.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from pyrl.tools.function_tool import FunctionTool, load_function_tools_from_path
from pyrl.tools.schemas import OpenAIFunctionToolSchema
from pyrl.usercode import load_object

if TYPE_CHECKING:
    from pyrl.tools.base_tool import BaseTool


class ToolType(Enum):
    NATIVE = "native"


def get_tool_class(cls_name: str):
    """The class named by a dotted path `package.module.ClassName` (verl's name for pyrl.usercode.load_object)."""
    return load_object(cls_name, "class_name")


def initialize_tools_from_config(tools_config_file: str) -> list[BaseTool]:
    """Instantiates the tools that the YAML file declares, in its order."""
    tools_config = OmegaConf.load(tools_config_file)
    entries = tools_config.get("tools") if isinstance(tools_config, DictConfig) else None
    if entries is None:
        raise ValueError(f"{tools_config_file}: expected a top-level `tools:` list")
    tool_list = []
    for index, entry in enumerate(entries):
        where = f"{tools_config_file}: tools[{index}]"
        cls_name = entry.get("class_name")
        if not cls_name:
            raise ValueError(f"{where}: expected `class_name` (a dotted path to a BaseTool subclass)")
        config = entry.get("config")
        config = {} if config is None else OmegaConf.to_container(config, resolve=True)
        tool_type = config.get("type", ToolType.NATIVE.value)
        if tool_type != ToolType.NATIVE.value:
            raise ValueError(f"{where}: config.type {tool_type!r} is not supported; expected 'native'")
        schema = entry.get("tool_schema")
        tool_schema = None if schema is None else OpenAIFunctionToolSchema.model_validate(
            OmegaConf.to_container(schema, resolve=True))
        tool_list.append(get_tool_class(cls_name)(config=config, tool_schema=tool_schema))
    return tool_list


def load_all_tools(tool_config_path: str | None, function_tool_path: str | None) -> list[BaseTool | FunctionTool]:
    """The YAML's tools followed by the function tools of `function_tool_path`; a name used by both raises."""
    native_tools = initialize_tools_from_config(tool_config_path) if tool_config_path else []
    function_tools = load_function_tools_from_path(function_tool_path) if function_tool_path else []
    taken = {tool.name for tool in native_tools}
    collisions = sorted(tool.name for tool in function_tools if tool.name in taken)
    if collisions:
        raise ValueError(f"function tool name(s) {collisions} from {function_tool_path} are also declared in "
                         f"{tool_config_path}; tool names must be unique across tool_config_path and "
                         f"function_tool_path")
    return native_tools + function_tools
