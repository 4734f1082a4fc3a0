"""The data a tool exchanges with the agent loop, in OpenAI's function-calling shapes (pydantic models, as
verl 0.9.1's `verl.tools.schemas`): a tool's schema (what the chat template shows the model), a parsed call
(name + arguments) and a tool's response.

ToolResponse keeps verl's `image` / `video` lists so that verl tool files construct it unchanged; pyrl has
no multimodal tools of its own.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter of a function."""

    # a union such as int | float is a list of types: ["integer", "number"]
    type: str | list[str]
    description: str | None = None
    # JSON Schema's enum takes any JSON values: Literal[1, 2, 3] -> enum [1, 2, 3]
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    """A function's parameters: an object schema."""

    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    """A function: name, description and parameters."""

    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[]))
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool as OpenAI's API (and chat templates' `tools=`) take it: {"type": "function", "function": {...}}."""

    type: str
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as the model wrote it: the arguments still a JSON string."""

    name: str
    arguments: str


class OpenAIFunctionCallSchema(BaseModel):
    """A call with its arguments decoded into a dict."""

    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(
            parsed_schema: OpenAIFunctionParsedSchema) -> tuple[OpenAIFunctionCallSchema, bool]:
        """Decodes the arguments; arguments that are not a JSON object become {} and the flag (has_decode_error)
        is True, so the caller can keep the raw text instead."""
        try:
            arguments = json.loads(parsed_schema.arguments)
        except json.JSONDecodeError:
            arguments = None
        has_decode_error = not isinstance(arguments, dict)
        if has_decode_error:
            arguments = {}
        return OpenAIFunctionCallSchema(name=parsed_schema.name, arguments=arguments), has_decode_error


class OpenAIFunctionToolCall(BaseModel):
    """A call as it appears in an assistant message's tool_calls."""

    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool returns to the model: text, and (verl's multimodal tools) lists of images / videos."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _media_are_lists(cls, values):
        # a single image passed bare would otherwise be silently wrapped or rejected by pydantic with a vaguer message
        if isinstance(values, dict):
            for key in ("image", "video"):
                if values.get(key) is not None and not isinstance(values[key], list):
                    raise ValueError(f"ToolResponse.{key}: expected a list (wrap a single one: [{key}]), "
                                     f"got {type(values[key]).__name__}")
        return values

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video
