"""Tool-call parsers: find the tool calls in a generated response (verl 0.9.1's
`verl.experimental.agent_loop.tool_parser`). The agent loop decodes each assistant turn through the parser
named by the rollout's `multi_turn.format`; the parser only extracts calls, it does not judge them (an
unknown tool name or bad arguments are the loop's to answer).

All of verl 0.9.1's formats are here, under its names: `hermes` (Qwen2.5/Qwen3, and pyrl's tiny tool model),
`gpt-oss`, `qwen3_coder` (Qwen3-Coder, Qwen3.5), `glm`, `seed`, `minimax`, `kimi`, `deepseek_v4` and `gemma4`.
Each returns the text and calls verl 0.9.1's does, with one difference everywhere a block is found but cannot be
read: verl drops it (or, for kimi, calls the tool with no arguments), pyrl returns a call with `error` set in its
place, which the agent loop answers with that error. Each class says where it deviates.

`stop_token_ids`: the tokens a format needs generation to stop at, because its model does not end a tool-calling
turn with EOS (glm: <|observation|>, kimi: <|im_end|>, gemma4: <tool_call|>). The agent loop adds them to its tool
agent's requests, as verl 0.9.1's ToolAgentLoop does; the engines keep the stop token in the response, as vLLM
keeps a stop token id.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from abc import ABC, abstractmethod
from typing import Any

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


def malformed(block: str, reason: str, name: str = "", tool_call_id: str | None = None) -> FunctionCall:
    """The call that stands for a block the parser found but could not read: its raw text as the arguments."""
    return FunctionCall(name=name, arguments=block, tool_call_id=tool_call_id, error=f"malformed tool call: {reason}")


def single_token_id(tokenizer, token: str) -> int | None:
    """`token`'s id when the tokenizer has it as one token, else None. Checked by the round trip, not by
    convert_tokens_to_ids alone, which answers an unknown token with the unk id (a stop at <unk> would be wrong)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if isinstance(token_id, int) and token_id >= 0 and tokenizer.convert_ids_to_tokens(token_id) == token:
        return token_id
    return None


def decode(tokenizer, responses_ids: list[int]) -> str:
    """The response's text with special tokens kept: every format's markup may be special tokens (verl 0.9.1 decodes
    the same way, some parsers by the tokenizer's default, which keeps them too)."""
    # decoded in the caller's thread, not in the event loop's default executor as verl does: hung sync tools may
    # hold every thread of it
    return tokenizer.decode(responses_ids, skip_special_tokens=False)


def json_or_raw(raw_value: str) -> Any:
    """A parameter's value: JSON when it parses (after stripping), else the stripped text (glm, seed, minimax)."""
    value = raw_value.strip()
    try:
        return json.loads(value)
    except Exception:
        return value


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
        text = decode(self.tokenizer, responses_ids)
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
                function_calls.append(malformed(match, reason))
        return self.tool_call_regex.sub("", text), function_calls


@ToolParser.register("gpt-oss")
class GptOssToolParser(ToolParser):
    """gpt-oss's harmony format (sglang's gpt_oss_detector, as verl adapts it):
    `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`.

    As in verl 0.9.1: decoded with special tokens kept, the pad token removed; the analysis channel (the chain
    of thought, which may mention calls that are not calls) is removed first; every call block is cut from the
    returned text; ARGS are passed on as written, not checked as JSON (the agent loop answers arguments that
    are not a JSON object); a block the pattern does not match stays text, as in verl. The model ends a call with
    <|call|>, an EOS token of gpt-oss's generation config, so no stop tokens. Unlike verl 0.9.1, a tokenizer
    without a pad token is accepted (verl's text.replace(None, "") raises).
    """

    # check https://cookbook.openai.com/articles/openai-harmony for the format
    cot_pattern = re.compile(r"<\|start\|>assistant<\|channel\|>analysis<\|message\|>.*?<\|end\|>", re.DOTALL)
    # <|start|>assistant may be in the prompt already: the analysis channel without it
    partial_cot_pattern = re.compile(r"<\|channel\|>analysis<\|message\|>(.*?)<\|end\|>", re.DOTALL)
    tool_call_pattern = re.compile(r"<\|start\|>assistant<\|channel\|>[^<]* to=functions\.([^<]+) "
                                   r"<\|constrain\|>json<\|message\|>(.*?)<\|call\|>", re.DOTALL)

    async def extract_tool_calls(self, responses_ids: list[int],
                                 tools: list[OpenAIFunctionToolSchema] | None = None) -> tuple[str, list[FunctionCall]]:
        text = decode(self.tokenizer, responses_ids)
        if self.tokenizer.pad_token:
            text = text.replace(self.tokenizer.pad_token, "")
        text = self.cot_pattern.sub("", text)
        text = self.partial_cot_pattern.sub("", text)
        matches = self.tool_call_pattern.findall(text)
        if not matches:
            return text, []
        function_calls = [FunctionCall(name=name, arguments=arguments) for name, arguments in matches]
        return self.tool_call_pattern.sub("", text), function_calls


@ToolParser.register("qwen3_coder")
class Qwen3XMLToolParser(ToolParser):
    """Qwen3-Coder / Qwen3.5's XML calls (Qwen3-Coder's qwen3coder_tool_parser.py, as verl adapts it)::

        <tool_call>
        <function=NAME>
        <parameter=KEY>
        VALUE
        </parameter>
        </function>
        </tool_call>

    As in verl 0.9.1: a VALUE is converted by the type its tool's schema gives the parameter (string as is;
    int/float/bool parsed, degenerating to the string, or to false for a bool; object as JSON; anything else by
    ast.literal_eval, never eval; "null" is None for any type; a parameter the schema lacks stays a string); one
    newline is stripped from each end of a VALUE; an unclosed <tool_call>, <function= or <parameter= at the end of
    the response is read as far as it goes; a parameter without '>' is skipped; the returned text is what precedes
    the first <tool_call>. Unlike verl 0.9.1, which drops them: a <function= header without '>', and a <tool_call>
    block with no <function= in it, become calls with `error`; and a call whose parameters cannot be written as
    JSON (ast.literal_eval made a set or bytes) becomes a call with `error` where verl returns the whole text and
    no calls at all.
    """

    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    tool_call_prefix = "<function="
    tool_call_complete_regex = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL)
    tool_call_function_regex = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
    tool_call_parameter_regex = re.compile(r"<parameter=(.*?)</parameter>|<parameter=(.*?)$", re.DOTALL)

    def _parse_xml_function_call(self, function_call_str: str,
                                 tools: list[OpenAIFunctionToolSchema] | None) -> FunctionCall | None:
        """One `NAME>...parameters...` (the text after <function=); None when NAME has no '>' after it."""
        tools = tools or []

        def get_arguments_config(func_name: str) -> dict:
            for config in tools:
                if config.type == "function" and config.function.name == func_name:
                    return {k: v.model_dump() for k, v in config.function.parameters.properties.items()}
            logger.warning(f"Tool '{func_name}' is not defined in the tools list.")
            return {}

        def convert_param_value(param_value: str, param_name: str, param_config: dict, func_name: str) -> Any:
            if param_value.lower() == "null":  # null for any type
                return None
            if param_name not in param_config:
                if param_config != {}:
                    logger.warning(f"Parsed parameter '{param_name}' is not defined in the tool parameters for tool "
                                   f"'{func_name}', directly returning the string value.")
                return param_value
            if isinstance(param_config[param_name], dict) and "type" in param_config[param_name]:
                param_type = str(param_config[param_name]["type"]).strip().lower()
            else:
                param_type = "string"
            if param_type in ["string", "str", "text", "varchar", "char", "enum"]:
                return param_value
            if param_type.startswith(("int", "uint", "long", "short", "unsigned")):
                try:
                    param_value = int(param_value)
                except Exception:
                    logger.warning(f"Parsed value '{param_value}' of parameter '{param_name}' is not an integer in "
                                   f"tool '{func_name}', degenerating to string.")
                return param_value
            if param_type.startswith(("num", "float")):
                try:
                    float_param_value = float(param_value)
                    param_value = (float_param_value if float_param_value - int(float_param_value) != 0
                                   else int(float_param_value))
                except Exception:
                    logger.warning(f"Parsed value '{param_value}' of parameter '{param_name}' is not a float in tool "
                                   f"'{func_name}', degenerating to string.")
                return param_value
            if param_type in ["boolean", "bool", "binary"]:
                param_value = param_value.lower()
                if param_value not in ["true", "false"]:
                    logger.warning(f"Parsed value '{param_value}' of parameter '{param_name}' is not a boolean "
                                   f"(`true` of `false`) in tool '{func_name}', degenerating to false.")
                return param_value == "true"
            if param_type == "object" or param_type.startswith("dict"):
                try:
                    return json.loads(param_value)
                except Exception:
                    logger.warning(f"Parsed value '{param_value}' of parameter '{param_name}' is not a valid JSON "
                                   f"object in tool '{func_name}', will try other methods to parse it.")
            try:
                # literal_eval, never eval: the value is untrusted model output, and literal_eval only reads literals
                param_value = ast.literal_eval(param_value)
            except Exception:
                logger.warning(f"Parsed value '{param_value}' of parameter '{param_name}' cannot be converted via "
                               f"`ast.literal_eval()` in tool '{func_name}', degenerating to string.")
            return param_value

        end_index = function_call_str.find(">")
        if end_index == -1:  # a truncated function header is not recoverable
            return None
        function_name = function_call_str[:end_index]
        param_config = get_arguments_config(function_name)
        param_dict = {}
        for match in self.tool_call_parameter_regex.findall(function_call_str[end_index + 1:]):
            match_text = match[0] if match[0] else match[1]
            idx = match_text.find(">")
            if idx == -1:
                logger.warning(f"Skipping malformed parameter without '>' separator in tool call for function "
                               f"'{function_name}': {match_text!r}")
                continue
            param_name = match_text[:idx]
            param_value = str(match_text[idx + 1:])
            param_value = param_value.removeprefix("\n").removesuffix("\n")  # one newline each side, not all
            param_dict[param_name] = convert_param_value(param_value, param_name, param_config, function_name)
        return FunctionCall(name=function_name, arguments=json.dumps(param_dict, ensure_ascii=False))

    def _tool_call_blocks(self, model_output: str) -> list[str]:
        """Each <tool_call> block's inside, an unclosed last one to the end."""
        return [match[0] if match[0] else match[1] for match in self.tool_call_regex.findall(model_output)]

    def _function_calls(self, tool_call: str) -> list[str]:
        """The text after each <function= of a block, up to its </function> (an unclosed last one to the end)."""
        return [match[0] if match[0] else match[1] for match in self.tool_call_function_regex.findall(tool_call)]

    async def extract_tool_calls(self, responses_ids: list[int],
                                 tools: list[OpenAIFunctionToolSchema] | None = None) -> tuple[str, list[FunctionCall]]:
        text = decode(self.tokenizer, responses_ids)
        if self.tool_call_start_token not in text:
            return text, []
        function_calls = []
        # block by block (verl reads all the blocks' functions at once: the same calls, in the same order), so that
        # an unreadable block is answered in its place
        for block in self._tool_call_blocks(text):
            functions = self._function_calls(block)
            if not functions:
                function_calls.append(malformed(block, f"no {self.tool_call_prefix}NAME> in the <tool_call> block"))
            for function_call_str in functions:
                try:
                    call = self._parse_xml_function_call(function_call_str, tools)
                except Exception as error:  # json.dumps of what literal_eval made (a set, bytes, ...)
                    call = malformed(function_call_str, f"parameters that cannot be written as JSON ({error})")
                function_calls.append(call if call is not None else
                                      malformed(function_call_str, f"a {self.tool_call_prefix}NAME header without '>'"))
        return text[:text.find(self.tool_call_start_token)], function_calls


@ToolParser.register("glm")
class GLMToolParser(ToolParser):
    """GLM-4.5+'s calls: `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`.

    As in verl 0.9.1: decoded with special tokens kept; only complete blocks count (an unclosed one: the whole text,
    no call); a VALUE is JSON when it parses, else its stripped text; a block without <arg_key> is a call with no
    arguments, named by its stripped text; the returned text is what precedes the first <tool_call>, without a
    leading <think>...</think> block or a leading </think>. GLM does not end a calling turn with EOS: generation
    stops at <|observation|> (none when the tokenizer has no such single token). Unlike verl 0.9.1, which takes the
    unk token's id for a tokenizer that lacks <|observation|>, there is then no stop token. No block is unreadable
    here (any text is a name), so no call has `error`.
    """

    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    observation_token = "<|observation|>"
    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    arg_pair_regex = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    @property
    def stop_token_ids(self) -> list[int]:
        token_id = single_token_id(self.tokenizer, self.observation_token)
        return [] if token_id is None else [token_id]

    def _parse_tool_call(self, tool_call_text: str) -> FunctionCall:
        first_arg_index = tool_call_text.find("<arg_key>")
        if first_arg_index < 0:
            name, arguments = tool_call_text.strip(), {}
        else:
            name = tool_call_text[:first_arg_index].strip()
            arguments = {key.strip(): json_or_raw(value)
                         for key, value in self.arg_pair_regex.findall(tool_call_text[first_arg_index:])}
        return FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))

    @staticmethod
    def _strip_thinking_markers(content: str) -> str:
        content = re.sub(r"^\s*<think>.*?</think>", "", content, flags=re.DOTALL)
        return re.sub(r"^\s*</think>", "", content)

    async def extract_tool_calls(self, responses_ids: list[int],
                                 tools: list[OpenAIFunctionToolSchema] | None = None) -> tuple[str, list[FunctionCall]]:
        text = decode(self.tokenizer, responses_ids)
        if self.tool_call_start_token not in text or self.tool_call_end_token not in text:
            return text, []
        function_calls = [self._parse_tool_call(match) for match in self.tool_call_regex.findall(text)]
        return self._strip_thinking_markers(text[:text.find(self.tool_call_start_token)]), function_calls


@ToolParser.register("seed")
class SeedToolParser(ToolParser):
    """ByteDance Seed's calls: `<seed:tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
    </seed:tool_call>`.

    As in verl 0.9.1: decoded with special tokens kept; only complete blocks count; the first <function=...>
    </function> of a block is its call (a second one in the same block is ignored); a VALUE is JSON when it
    parses, else its stripped text; the returned text is what precedes the first <seed:tool_call>. Unlike verl
    0.9.1, which drops it, a block without a complete <function=NAME>...</function> becomes a call with `error`.
    """

    tool_call_start_token = "<seed:tool_call>"
    tool_call_end_token = "</seed:tool_call>"
    tool_call_regex = re.compile(r"<seed:tool_call>(.*?)</seed:tool_call>", re.DOTALL)
    function_regex = re.compile(r"<function=([^>\n]+)>\s*(.*?)</function>", re.DOTALL)
    parameter_regex = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def _parse_tool_call(self, tool_call_text: str) -> FunctionCall | None:
        match = self.function_regex.search(tool_call_text)
        if not match:
            return None
        arguments = {key.strip(): json_or_raw(value) for key, value in self.parameter_regex.findall(match.group(2))}
        return FunctionCall(name=match.group(1).strip(), arguments=json.dumps(arguments, ensure_ascii=False))

    async def extract_tool_calls(self, responses_ids: list[int],
                                 tools: list[OpenAIFunctionToolSchema] | None = None) -> tuple[str, list[FunctionCall]]:
        text = decode(self.tokenizer, responses_ids)
        if self.tool_call_start_token not in text or self.tool_call_end_token not in text:
            return text, []
        function_calls = []
        for match in self.tool_call_regex.findall(text):
            call = self._parse_tool_call(match)
            function_calls.append(call if call is not None else
                                  malformed(match, "no <function=NAME>...</function> in the <seed:tool_call> block"))
        return text[:text.find(self.tool_call_start_token)], function_calls


@ToolParser.register("minimax")
class MiniMaxToolParser(ToolParser):
    """MiniMax's calls: `<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>
    ...</minimax:tool_call>` (a block may hold several invokes, each a call).

    As in verl 0.9.1: decoded with special tokens kept; only complete blocks count; a VALUE is JSON when it parses,
    else its stripped text; the returned text is what precedes the first <minimax:tool_call>. Unlike verl 0.9.1,
    which drops it, a block without a complete <invoke name="NAME">...</invoke> becomes a call with `error`.
    """

    tool_call_start_token = "<minimax:tool_call>"
    tool_call_end_token = "</minimax:tool_call>"
    tool_call_regex = re.compile(r"<minimax:tool_call>(.*?)</minimax:tool_call>", re.DOTALL)
    invoke_regex = re.compile(r'<invoke name="([^"]+)">\s*(.*?)</invoke>', re.DOTALL)
    parameter_regex = re.compile(r'<parameter name="([^"]+)">(.*?)</parameter>', re.DOTALL)

    def _parse_tool_calls(self, tool_call_text: str) -> list[FunctionCall]:
        return [FunctionCall(name=name.strip(), arguments=json.dumps(
                    {key.strip(): json_or_raw(value) for key, value in self.parameter_regex.findall(body)},
                    ensure_ascii=False))
                for name, body in self.invoke_regex.findall(tool_call_text)]

    async def extract_tool_calls(self, responses_ids: list[int],
                                 tools: list[OpenAIFunctionToolSchema] | None = None) -> tuple[str, list[FunctionCall]]:
        text = decode(self.tokenizer, responses_ids)
        if self.tool_call_start_token not in text or self.tool_call_end_token not in text:
            return text, []
        function_calls = []
        for match in self.tool_call_regex.findall(text):
            function_calls += (self._parse_tool_calls(match) or
                               [malformed(match, 'no <invoke name="NAME">...</invoke> in the <minimax:tool_call> '
                                                 'block')])
        return text[:text.find(self.tool_call_start_token)], function_calls


@ToolParser.register("kimi")
class KimiToolParser(ToolParser):
    """Kimi K2's special-token calls: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
    <|tool_call_argument_begin|>{JSON}<|tool_call_end|>...<|tool_calls_section_end|>`.

    As in verl 0.9.1: decoded with special tokens kept; the call id the model wrote (functions.NAME:0) is the
    call's `tool_call_id`, and the tool's name is inferred from it with the tools given: the id itself when it is a
    tool's name, else the one tool whose name is in it (lowercased, '-' as '_'), else the one tool whose required
    parameters the arguments all have, else the id; the returned text is what precedes the section. Kimi ends a
    turn with <|im_end|>, not EOS: generation stops there (none when the tokenizer has no such single token).
    Unlike verl 0.9.1, which calls the tool with {} when the arguments are not a JSON object, such a call has
    `error` (its raw arguments kept, its name inferred as verl would from no arguments); and a tokenizer that
    lacks <|im_end|> gets no stop token where verl would take the unk token's id.
    """

    tool_calls_section_start_token = "<|tool_calls_section_begin|>"
    tool_calls_section_end_token = "<|tool_calls_section_end|>"
    tool_call_begin_token = "<|tool_call_begin|>"
    tool_call_argument_begin_token = "<|tool_call_argument_begin|>"
    tool_call_end_token = "<|tool_call_end|>"
    im_end_token = "<|im_end|>"
    tool_call_regex = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
                                 re.DOTALL)

    @property
    def stop_token_ids(self) -> list[int]:
        token_id = single_token_id(self.tokenizer, self.im_end_token)
        return [] if token_id is None else [token_id]

    @staticmethod
    def _parse_arguments(raw_arguments: str) -> dict[str, Any] | None:
        """The arguments when they are a JSON object, else None."""
        try:
            arguments = json.loads(raw_arguments.strip())
        except Exception:
            return None
        return arguments if isinstance(arguments, dict) else None

    @staticmethod
    def _infer_tool_name(raw_name: str, arguments: dict[str, Any],
                         tools: list[OpenAIFunctionToolSchema] | None) -> str:
        if not tools:
            return raw_name
        tool_names = [tool.function.name for tool in tools if tool.type == "function"]
        if raw_name in tool_names:
            return raw_name
        compact_raw_name = raw_name.lower().replace("-", "_")
        substring_matches = [name for name in tool_names if name.lower() in compact_raw_name]
        if len(substring_matches) == 1:
            return substring_matches[0]
        argument_keys = set(arguments)
        schema_matches = []
        for tool in tools:
            if tool.type != "function":
                continue
            required = set(tool.function.parameters.required or [])
            if required and required.issubset(argument_keys):
                schema_matches.append(tool.function.name)
        if len(schema_matches) == 1:
            return schema_matches[0]
        return raw_name

    async def extract_tool_calls(self, responses_ids: list[int],
                                 tools: list[OpenAIFunctionToolSchema] | None = None) -> tuple[str, list[FunctionCall]]:
        text = decode(self.tokenizer, responses_ids)
        if self.tool_calls_section_start_token not in text:
            return text, []
        function_calls = []
        for raw_name, raw_arguments in self.tool_call_regex.findall(text):
            raw_name = raw_name.strip()
            arguments = self._parse_arguments(raw_arguments)
            name = self._infer_tool_name(raw_name, arguments or {}, tools)
            if arguments is None:
                function_calls.append(malformed(raw_arguments, "the arguments are not a JSON object", name=name,
                                                tool_call_id=raw_name))
                continue
            function_calls.append(FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False),
                                               tool_call_id=raw_name))
        return text[:text.find(self.tool_calls_section_start_token)], function_calls


@ToolParser.register("deepseek_v4")
class DeepSeekV4ToolParser(ToolParser):
    """DeepSeek-V4's DSML calls::

        <｜DSML｜tool_calls>
        <｜DSML｜invoke name="NAME">
        <｜DSML｜parameter name="KEY" string="true">a raw string</｜DSML｜parameter>
        <｜DSML｜parameter name="COUNT" string="false">5</｜DSML｜parameter>
        </｜DSML｜invoke>
        </｜DSML｜tool_calls>

    As in verl 0.9.1: decoded with special tokens kept, the pad and end-of-sentence tokens removed; a string="true"
    value is taken as written, a string="false" one as JSON (kept as written when it is not JSON); only complete
    blocks count; the returned text is what precedes the first <｜DSML｜tool_calls> (the whole text when there is
    none) after the last </think> (the reasoning of a thinking-mode turn), without the blank line the encoder
    writes before the calls. The model ends a calling turn with EOS: no stop tokens. Unlike verl 0.9.1, which drops
    it, a tool_calls block without a complete invoke becomes a call with `error`.
    """

    dsml_token = "｜DSML｜"
    eos_token = "<｜end▁of▁sentence｜>"
    think_end_token = "</think>"
    tool_calls_start_token = f"<{dsml_token}tool_calls>"
    tool_calls_end_token = f"</{dsml_token}tool_calls>"
    tool_calls_regex = re.compile(rf"<{re.escape(dsml_token)}tool_calls>(.*?)</{re.escape(dsml_token)}tool_calls>",
                                  re.DOTALL)
    invoke_regex = re.compile(rf'<{re.escape(dsml_token)}invoke name="(.*?)">(.*?)</{re.escape(dsml_token)}invoke>',
                              re.DOTALL)
    parameter_regex = re.compile(rf'<{re.escape(dsml_token)}parameter name="(.*?)" string="(true|false)">(.*?)'
                                 rf'</{re.escape(dsml_token)}parameter>', re.DOTALL)

    def _parse_tool_calls(self, tool_calls_text: str) -> list[FunctionCall]:
        function_calls = []
        for name, body in self.invoke_regex.findall(tool_calls_text):
            arguments: dict[str, Any] = {}
            for param_name, is_string, value in self.parameter_regex.findall(body):
                if is_string == "true":
                    arguments[param_name] = value
                    continue
                try:
                    arguments[param_name] = json.loads(value)
                except Exception:
                    logger.warning(f"DeepSeek-V4 parameter '{param_name}' of tool '{name}' is marked as non-string "
                                   f"but is not valid JSON, keeping the raw value.")
                    arguments[param_name] = value
            function_calls.append(FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))
        return function_calls

    async def extract_tool_calls(self, responses_ids: list[int],
                                 tools: list[OpenAIFunctionToolSchema] | None = None) -> tuple[str, list[FunctionCall]]:
        text = decode(self.tokenizer, responses_ids)
        for token in (self.tokenizer.pad_token, self.eos_token):
            if token:
                text = text.replace(token, "")
        if self.tool_calls_start_token not in text:
            return self._strip_reasoning(text), []
        function_calls = []
        for match in self.tool_calls_regex.findall(text):
            function_calls += (self._parse_tool_calls(match) or
                               [malformed(match, f'no <{self.dsml_token}invoke name="NAME">...'
                                                 f'</{self.dsml_token}invoke> in the tool_calls block')])
        content = self._strip_reasoning(text[:text.index(self.tool_calls_start_token)])
        return content.removesuffix("\n\n"), function_calls

    def _strip_reasoning(self, text: str) -> str:
        """What the model wrote for the user: after the last </think> (a thinking-mode prompt ends with <think>, so
        the completion opens with reasoning; a chat-mode completion has no </think> and is kept whole)."""
        return text.rpartition(self.think_end_token)[2]


@ToolParser.register("gemma4")
class Gemma4ToolParser(ToolParser):
    """Gemma 4's calls: `<|tool_call>call:NAME{key:<|"|>a string<|"|>,count:5}<tool_call|>`.

    As in verl 0.9.1: decoded with special tokens kept, the pad token removed; a value between <|"|> quotes is a
    string, a bare one true/false/null, an int, a float, else its stripped text (nested objects are not read: the
    pattern stops at the first '}'); the returned text is what precedes the first <|tool_call>. Gemma 4 does not end
    a calling turn with EOS, it goes on generating: generation stops at <tool_call|> (so a turn holds one call).
    Unlike verl 0.9.1, which drops it, a complete <|tool_call>...<tool_call|> block that is not `call:NAME{...}`
    becomes a call with `error`; and a tokenizer without <tool_call|> as one token is refused here (verl would stop
    at the unk token's id, or at None).
    """

    tool_call_start_token = "<|tool_call>"
    tool_call_end_token = "<tool_call|>"
    tool_call_regex = re.compile(r"<\|tool_call>call:(\w+)\{(.*?)\}<tool_call\|>", re.DOTALL)
    block_regex = re.compile(r"<\|tool_call>(.*?)<tool_call\|>", re.DOTALL)  # any block, read or not
    arg_regex = re.compile(r'(\w+):(?:<\|"\|>(.*?)<\|"\|>|([^,}]*))')

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._stop_token_id = single_token_id(tokenizer, self.tool_call_end_token)
        if self._stop_token_id is None:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format=gemma4: the tokenizer has no single token "
                             f"{self.tool_call_end_token!r}, which generation must stop at (a Gemma 4 tokenizer has)")

    @property
    def stop_token_ids(self) -> list[int]:
        return [self._stop_token_id]

    def _parse_arguments(self, args_str: str) -> dict:
        result = {}
        for match in self.arg_regex.finditer(args_str):
            key, str_val, bare_val = match.group(1), match.group(2), match.group(3)
            if str_val is not None:
                result[key] = str_val
            elif bare_val is not None:
                bare_val = bare_val.strip()
                if bare_val.lower() in ("true", "false", "null"):
                    result[key] = {"true": True, "false": False, "null": None}[bare_val.lower()]
                else:
                    try:
                        result[key] = int(bare_val)
                    except ValueError:
                        try:
                            result[key] = float(bare_val)
                        except ValueError:
                            result[key] = bare_val
        return result

    async def extract_tool_calls(self, responses_ids: list[int],
                                 tools: list[OpenAIFunctionToolSchema] | None = None) -> tuple[str, list[FunctionCall]]:
        text = decode(self.tokenizer, responses_ids)
        if self.tokenizer.pad_token:
            text = text.replace(self.tokenizer.pad_token, "")
        if self.tool_call_start_token not in text:
            return text, []
        # verl's calls, by where they start; then the blocks none of them covers, unreadable, in their places
        found = [(match.start(), FunctionCall(name=match.group(1), arguments=json.dumps(
                     self._parse_arguments(match.group(2)), ensure_ascii=False)), match.end())
                 for match in self.tool_call_regex.finditer(text)]
        for block in self.block_regex.finditer(text):
            if not any(start < block.end() and block.start() < end for start, _, end in found):
                found.append((block.start(), malformed(block.group(1), "expected call:NAME{...} in the block"),
                              block.end()))
        if not found:
            return text, []
        return text[:text.find(self.tool_call_start_token)], [call for _, call, _ in sorted(found, key=lambda f: f[0])]
