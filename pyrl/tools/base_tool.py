"""BaseTool: the class a stateful tool derives from (verl 0.9.1's `verl.tools.base_tool.BaseTool`).

The agent loop runs one tool call as create -> execute -> release, so a tool may keep per-trajectory state
keyed by the instance id that `create` returns (a sandbox session, a retrieval cache, a game board), and
`calc_reward` can score that state. Stateless tools can be plain functions instead (pyrl.tools.function_tool).
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from pyrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class BaseTool:
    """A tool: `name` and `tool_schema` for the prompt, and the async lifecycle the agent loop drives.

    `config` is the tool's `config:` mapping from the tool YAML (it includes verl's `type: native`). When no
    `tool_schema` is given, the subclass's `get_openai_tool_schema()` supplies its default one.
    """

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | dict | None = None):
        self.config = config
        if isinstance(tool_schema, dict):
            tool_schema = OpenAIFunctionToolSchema.model_validate(tool_schema)
        self.tool_schema = tool_schema if tool_schema is not None else self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__}: tool_schema is required (give it in the tool config's "
                             f"`tool_schema`, or override get_openai_tool_schema to supply a default)")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """Starts a per-trajectory instance; returns its id (a fresh uuid when none is given) and the tool's
        response to the creation (empty by default). kwargs: verl passes `create_kwargs` from the sample's
        tools_kwargs."""
        return (str(uuid4()) if instance_id is None else instance_id), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """Runs one call with the model's decoded arguments; returns (response, step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """Reward from the instance's state."""
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """Frees the instance's state."""
