"""Tool-call parsers: find the tool calls in a generated response (verl 0.9.1's
`verl.experimental.agent_loop.tool_parser`). The agent loop decodes each assistant turn through the parser
named by the rollout's `multi_turn.format`; the parser only extracts calls, it does not judge them (an
unknown tool name or bad arguments are the loop's to answer).

Only verl's `hermes` format (Qwen2.5/Qwen3, and pyrl's tiny tool model) is here; verl's other formats
(gpt-oss, qwen3_coder, glm, seed, minimax, kimi, deepseek_v4, gemma4) register the same way.
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod

from pydantic import BaseModel

from pyrl.tools.schemas import OpenAIFunctionToolSchema

logger = logging.getLogger(__name__)


class FunctionCall(BaseModel):
    """A call as the model wrote it: `arguments` is a JSON string, not necessarily valid or matching the
    tool's schema; validate before calling."""

    arguments: str
    name: str
    tool_call_id: str | None = None  # the model's own call id, in formats that emit one
    error: str | None = None  # a block the parser could not read: why (the loop answers it with this)


class ToolParser(ABC):
    """A format's parser, registered by name with @ToolParser.register(name)."""

    _registry: dict[str, type[ToolParser]] = {}

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that must stop generation so the parser can run; none when the model ends a tool-calling turn
        with EOS by itself (hermes models do)."""
        return []

    @abstractmethod
    async def extract_tool_calls(self, responses_ids: list[int],
                                 tools: list[OpenAIFunctionToolSchema] | None = None) -> tuple[str, list[FunctionCall]]:
        """(the response's text without the calls, the calls in order) for one response's token ids."""

    @classmethod
    def registered(cls) -> list[str]:
        """The registered parsers' names (what multi_turn.format may be)."""
        return sorted(cls._registry)

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer) -> ToolParser:
        if name not in cls._registry:
            raise ValueError(f"unknown tool parser {name!r} (multi_turn.format); registered: {cls.registered()}")
        return cls._registry[name](tokenizer)

    @classmethod
    def register(cls, name: str):
        def decorator(subclass: type[ToolParser]) -> type[ToolParser]:
            cls._registry[name] = subclass
            return subclass

        return decorator


@ToolParser.register("hermes")
class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (vLLM's hermes parser, as verl adapts it).

    As in verl 0.9.1: the text is decoded with special tokens kept (the tags may be special tokens); every
    complete block is cut out of the returned text; an unclosed <tool_call> is left in the text, no call.
    Unlike verl 0.9.1, which drops a block that is not JSON with "name" and "arguments" (the model then sees
    no answer and its episode ends as if it had called nothing), such a block becomes a call with `error` set,
    which the agent loop answers with that error, so the model learns what was wrong.
    """

    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    async def extract_tool_calls(self, responses_ids: list[int],
                                 tools: list[OpenAIFunctionToolSchema] | None = None) -> tuple[str, list[FunctionCall]]:
        # decoded here, not in the loop's default thread pool: hung sync tools may hold every thread of it
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=False)
        if self.tool_call_start_token not in text or self.tool_call_end_token not in text:
            return text, []
        function_calls = []
        for match in self.tool_call_regex.findall(text):
            try:
                call = json.loads(match)
                function_calls.append(FunctionCall(name=call["name"],
                                                   arguments=json.dumps(call["arguments"], ensure_ascii=False)))
            except Exception as error:  # not JSON, not an object, a key missing, a name that is not a string
                reason = (f"not JSON ({error})" if isinstance(error, json.JSONDecodeError) else
                          'expected a JSON object with "name" (a string) and "arguments"')
                function_calls.append(FunctionCall(name="", arguments=match, error=f"malformed tool call: {reason}"))
        return self.tool_call_regex.sub("", text), function_calls
