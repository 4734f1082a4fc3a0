"""verl 0.9.1's tool-call parsers, each on responses written in its model family's format (as its chat template
renders calls and its parser's patterns read them), encoded with a local tokenizer whose markup tokens are single
special tokens and parsed from the ids; verl's own parser tests transcribed where it has them (gpt-oss, qwen3_coder,
kimi). Then the stop tokens: that a parser's are the tokenizer's ids, that the agent loop asks the engine to stop
the tool agent's turns there (and only those), and that the hf and vllm engines stop at them, keeping the stop token."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import json
import subprocess
import sys

import pytest
import torch

from pyrl.models.tiny import TinyModelSpec, make_tokenizer
from pyrl.tools.schemas import OpenAIFunctionToolSchema
from pyrl.workers.rollout.tool_parser import FunctionCall, Qwen3XMLToolParser, ToolParser

VERL_091_PARSERS = ["deepseek_v4", "gemma4", "glm", "gpt-oss", "hermes", "kimi", "minimax", "qwen3_coder", "seed"]


@functools.cache
def _base_tokenizer(tools: bool):
    return make_tokenizer(TinyModelSpec(tools=tools))  # byte-level BPE: any unicode text round-trips


def tokenizer_with(*special_tokens: str, tools: bool = False):
    """pyrl's tiny tokenizer plus a format's markup as special tokens (one id each, kept when decoded with
    skip_special_tokens=False, dropped with True: the case where a parser that skipped them would lose the calls)."""
    tokenizer = copy.deepcopy(_base_tokenizer(tools))
    tokenizer.add_tokens(list(special_tokens), special_tokens=True)
    for token in special_tokens:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
        assert tokenizer.decode(tokenizer.encode(token, add_special_tokens=False), skip_special_tokens=True) == ""
    return tokenizer


def parse(name: str, tokenizer, text: str, tools: list[OpenAIFunctionToolSchema] | None = None):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text  # the parser sees the text as written
    return asyncio.run(ToolParser.get_tool_parser(name, tokenizer).extract_tool_calls(ids, tools))


def tool(name: str, properties: dict[str, str], required: list[str] | None = None) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
        "name": name, "description": f"{name} for the tests",
        "parameters": {"type": "object", "properties": {key: {"type": kind} for key, kind in properties.items()},
                       "required": required or []}}})


def call(name: str, arguments: str, **fields) -> FunctionCall:
    return FunctionCall(name=name, arguments=arguments, **fields)


def test_every_verl_091_parser_is_registered():
    assert ToolParser.registered() == VERL_091_PARSERS


# ---- hermes (Qwen2.5 / Qwen3): more cases in tests/tools/test_tool_parser.py ----
def test_hermes():
    tokenizer = tokenizer_with("<tool_call>", "</tool_call>")
    text = ('Both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"</tool_call><|im_end|>')
    content, calls = parse("hermes", tokenizer, text)
    assert content == "Both.\n\n<|im_end|>"
    assert calls[0] == call("get_weather", '{"city": "Zürich"}')
    assert calls[1].error.startswith("malformed tool call: not JSON (")
    assert calls[1].arguments == '\n{"name": "get_weather", "arguments": {"city": "東京"'
    assert parse("hermes", tokenizer, "No tools needed.<|im_end|>") == ("No tools needed.<|im_end|>", [])
    assert ToolParser.get_tool_parser("hermes", tokenizer).stop_token_ids == []


# ---- gpt-oss (harmony) ----
HARMONY = ["<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|call|>", "<|end|>", "<|return|>"]


def test_gpt_oss_verl_example():
    # verl 0.9.1's test_gpt_oss_tool_parser (there on the real gpt-oss tokenizer, skipped as local-only)
    example_text = ("\n<|start|>assistant<|channel|>commentary to=functions.get_current_weather "
                    '<|constrain|>json<|message|>{"location": "Tokyo"}<|call|>\n'
                    "<|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>"
                    '{ "temperature": 20, "sunny": true }<|end|>')
    content, calls = parse("gpt-oss", tokenizer_with(*HARMONY), example_text)
    assert calls == [call("get_current_weather", '{"location": "Tokyo"}')]
    assert content == ("\n\n<|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>"
                       '{ "temperature": 20, "sunny": true }<|end|>')


def test_gpt_oss_calls_after_reasoning_and_padding():
    tokenizer = tokenizer_with(*HARMONY)
    # the analysis channel mentions a call that is not one: removed before the calls are looked for
    fake = ('<|start|>assistant<|channel|>commentary to=functions.delete_all <|constrain|>json<|message|>{}'
            '<|call|>')
    text = ("<|channel|>analysis<|message|>I could run " + fake + " but no.<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>'
            '{"query": "café ☕", "k": 2}<|call|>'
            '<|start|>assistant<|channel|>commentary to=functions.open_page <|constrain|>json<|message|>'
            '{"url": "https://x.org/ü"<|call|><|endoftext|><|endoftext|>')
    content, calls = parse("gpt-oss", tokenizer, text)
    # arguments as written, JSON or not (the agent loop answers arguments that are not a JSON object)
    assert calls == [call("search", '{"query": "café ☕", "k": 2}'), call("open_page", '{"url": "https://x.org/ü"')]
    assert content == ""  # reasoning, calls and padding gone
    final = "<|channel|>final<|message|>It is 4.<|return|>"
    assert parse("gpt-oss", tokenizer, final) == (final, [])
    assert ToolParser.get_tool_parser("gpt-oss", tokenizer).stop_token_ids == []


def test_gpt_oss_without_a_pad_token():
    tokenizer = tokenizer_with(*HARMONY)
    tokenizer.pad_token = None
    text = '<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>'
    assert parse("gpt-oss", tokenizer, text) == ("", [call("f", "{}")])


# ---- qwen3_coder (Qwen3-Coder, Qwen3.5) ----
def _list_tool(param_type: str) -> OpenAIFunctionToolSchema:
    return tool("list_tool", {"items": param_type})


def test_qwen3_coder_verl_parameter_conversion_cases(tmp_path):
    # verl 0.9.1's test_qwen3_tool_parser_on_cpu, on _parse_xml_function_call (no tokenizer)
    parser = Qwen3XMLToolParser(tokenizer=None)
    result = parser._parse_xml_function_call("list_tool><parameter=items>[1, 2, 3]</parameter>", [_list_tool("array")])
    assert result.arguments == '{"items": [1, 2, 3]}'
    marker = tmp_path / "pwned.txt"
    payload = f'__import__("os").system("echo pwned > {marker}")'
    result = parser._parse_xml_function_call(f"list_tool><parameter=items>{payload}</parameter>",
                                             [_list_tool("array")])
    assert not marker.exists()  # never eval'd
    assert json.loads(result.arguments)["items"] == payload
    result = parser._parse_xml_function_call("list_tool><parameter=items>valid</parameter><parameter=truncated",
                                             [_list_tool("string")])
    assert json.loads(result.arguments) == {"items": "valid"}
    assert parser._parse_xml_function_call("list_tool", []) is None
    result = parser._parse_xml_function_call("list_tool><parameter=items>value</parameter>", None)
    assert json.loads(result.arguments) == {"items": "value"}


QWEN3_CODER_TOOLS = [tool("get_weather", {"city": "string", "days": "integer"}),
                     tool("set_alarm", {"enabled": "boolean", "ratio": "number", "tags": "array", "extra": "object",
                                        "count": "integer"})]
QWEN3_CODER_TWO_CALLS = (
    "I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=set_alarm>\n"
    "<parameter=enabled>\nTrue\n</parameter>\n<parameter=ratio>\n2.0\n</parameter>\n<parameter=tags>\n"
    '["a", "b"]\n</parameter>\n<parameter=extra>\n{"k": [1, null]}\n</parameter>\n<parameter=count>\nmany\n'
    "</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call><|im_end|>")


def test_qwen3_coder_calls_typed_by_the_tools_schema():
    tokenizer = tokenizer_with("<tool_call>", "</tool_call>")
    content, calls = parse("qwen3_coder", tokenizer, QWEN3_CODER_TWO_CALLS, QWEN3_CODER_TOOLS)
    assert content == "I'll check both.\n"
    assert calls == [call("get_weather", '{"city": "Zürich", "days": 3}'),
                     # bool lowercased; 2.0 an int; array by literal_eval; object as JSON; an int that is not one
                     # stays a string; a parameter the schema lacks stays a string, but "null" is None for any
                     call("set_alarm", '{"enabled": true, "ratio": 2, "tags": ["a", "b"], "extra": {"k": [1, null]}, '
                                       '"count": "many", "note": null}')]
    # without the schemas every value is the string written (one newline stripped each side)
    _, calls = parse("qwen3_coder", tokenizer, QWEN3_CODER_TWO_CALLS)
    assert json.loads(calls[1].arguments) == {"enabled": "True", "ratio": "2.0", "tags": '["a", "b"]',
                                              "extra": '{"k": [1, null]}', "count": "many", "note": None}
    assert ToolParser.get_tool_parser("qwen3_coder", tokenizer).stop_token_ids == []


def test_qwen3_coder_unclosed_and_malformed_blocks():
    tokenizer = tokenizer_with("<tool_call>", "</tool_call>")
    # a response cut off inside a call is read as far as it goes (verl 0.9.1 does)
    content, calls = parse("qwen3_coder", tokenizer, "ok <tool_call>\n<function=get_weather>\n<parameter=city>\nRomа\n")
    assert (content, calls) == ("ok ", [call("get_weather", '{"city": "Romа"}')])
    # blocks verl drops become calls with `error`, in their places among the good ones
    text = ("<tool_call>\n<function=get_wea</tool_call>"  # a header without '>'
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
            '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'  # hermes JSON: no <function=
            "<tool_call>\n<function=set_alarm>\n<parameter=tags>\n{1, 2}\n</parameter>\n</function>\n</tool_call>")
    content, calls = parse("qwen3_coder", tokenizer, text, QWEN3_CODER_TOOLS)
    assert content == ""
    assert calls[1] == call("get_weather", '{"city": "Oslo"}')
    assert [c.error for c in calls] == [
        "malformed tool call: a <function=NAME header without '>'", None,
        "malformed tool call: no <function=NAME> in the <tool_call> block",
        "malformed tool call: parameters that cannot be written as JSON (Object of type set is not JSON "
        "serializable)"]
    assert [c.arguments for c in calls[::2]] == ["get_wea", '{"name": "get_weather", "arguments": {}}']
    assert calls[3].arguments == "set_alarm>\n<parameter=tags>\n{1, 2}\n</parameter>\n"
    no_call = "Just text: <function=f> is no call outside a tool_call block.<|im_end|>"
    assert parse("qwen3_coder", tokenizer, no_call) == (no_call, [])


# ---- glm (GLM-4.5+) ----
GLM_TOKENS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<think>",
              "</think>", "<|observation|>", "<|user|>", "<|assistant|>"]


def test_glm_calls_and_stop_token():
    tokenizer = tokenizer_with(*GLM_TOKENS)
    text = ("<think>The user wants weather.</think>\nLet me look.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>北京</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n"
            '<arg_value>{"unit": "c"}</arg_value>\n</tool_call>\n<tool_call>list_files\n</tool_call><|observation|>')
    content, calls = parse("glm", tokenizer, text)
    assert content == "\nLet me look."  # the leading reasoning dropped
    assert calls == [call("get_weather", '{"city": "北京", "days": 3, "opts": {"unit": "c"}}'),
                     call("list_files", "{}")]
    content, calls = parse("glm", tokenizer, "\n</think>Sure.<tool_call>f<arg_key>x</arg_key><arg_value> not json "
                                             "</arg_value></tool_call>")
    assert (content, calls) == ("Sure.", [call("f", '{"x": "not json"}')])
    for no_call in ["The answer is 42.<|user|>", "cut off <tool_call>get_weather\n<arg_key>city"]:
        assert parse("glm", tokenizer, no_call) == (no_call, [])
    assert ToolParser.get_tool_parser("glm", tokenizer).stop_token_ids == [tokenizer.convert_tokens_to_ids(
        "<|observation|>")]
    assert ToolParser.get_tool_parser("glm", tokenizer_with("<tool_call>")).stop_token_ids == []


# ---- seed (ByteDance Seed-OSS) ----
SEED_TOKENS = ["<seed:tool_call>", "</seed:tool_call>", "<seed:think>", "</seed:think>", "<seed:eos>"]


def test_seed_calls():
    tokenizer = tokenizer_with(*SEED_TOKENS)
    text = ("<seed:think>Two lookups.</seed:think>I'll search.<seed:tool_call>\n<function=search>\n"
            "<parameter=query>café au lait</parameter>\n<parameter=top_k>5</parameter>\n"
            '<parameter=filters>{"lang": ["fr"]}</parameter>\n</function>\n</seed:tool_call>\n'
            "<seed:tool_call>\n<function=open>\n<parameter=url>https://ja.wikipedia.org/wiki/東京</parameter>\n"
            "</function>\n<function=ignored>\n</function>\n</seed:tool_call><seed:eos>")
    content, calls = parse("seed", tokenizer, text)
    assert content == "<seed:think>Two lookups.</seed:think>I'll search."
    assert calls == [call("search", '{"query": "café au lait", "top_k": 5, "filters": {"lang": ["fr"]}}'),
                     call("open", '{"url": "https://ja.wikipedia.org/wiki/東京"}')]  # a block's first function only
    content, calls = parse("seed", tokenizer, "<seed:tool_call>\n<function=search\n</seed:tool_call>"
                                              "<seed:tool_call><function=f></function></seed:tool_call>")
    assert content == "" and calls[1] == call("f", "{}")
    assert calls[0] == call("", "\n<function=search\n", error="malformed tool call: no <function=NAME>...</function> "
                                                              "in the <seed:tool_call> block")
    for no_call in ["Plain answer.<seed:eos>", "<seed:tool_call>\n<function=search>"]:
        assert parse("seed", tokenizer, no_call) == (no_call, [])
    assert ToolParser.get_tool_parser("seed", tokenizer).stop_token_ids == []


# ---- minimax (MiniMax-M2) ----
def test_minimax_calls():
    tokenizer = tokenizer_with("<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>")
    text = ('Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">São Paulo</parameter>'
            '\n<parameter name="units">["c", "f"]</parameter>\n</invoke>\n<invoke name="get_time">\n'
            '<parameter name="tz"> UTC </parameter>\n</invoke>\n</minimax:tool_call>\n<minimax:tool_call>'
            "get_time()</minimax:tool_call>")
    content, calls = parse("minimax", tokenizer, text)
    assert content == "Checking.\n"
    assert calls == [call("get_weather", '{"city": "São Paulo", "units": ["c", "f"]}'),  # two invokes, one block
                     call("get_time", '{"tz": "UTC"}'),
                     call("", "get_time()", error='malformed tool call: no <invoke name="NAME">...</invoke> in the '
                                                  "<minimax:tool_call> block")]
    for no_call in ["<think>hm</think>No call.", 'open <minimax:tool_call><invoke name="f">']:
        assert parse("minimax", tokenizer, no_call) == (no_call, [])
    assert ToolParser.get_tool_parser("minimax", tokenizer).stop_token_ids == []


# ---- kimi (Kimi K2) ----
KIMI_TOKENS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>"]  # <|im_end|> is the tiny tokenizer's own


def test_kimi_verl_example():
    # verl 0.9.1's test_kimi_tool_parser_preserves_model_emitted_tool_call_id (there with a fake tokenizer)
    tokenizer = tokenizer_with(*KIMI_TOKENS)
    text = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>call-get_weather-0<|tool_call_argument_begin|>"
            '{"city":"Seattle","unit":"celsius"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    content, calls = parse("kimi", tokenizer, text, [tool("get_weather", {"city": "string", "unit": "string"})])
    assert content == "Let me check."
    assert calls == [call("get_weather", '{"city": "Seattle", "unit": "celsius"}', tool_call_id="call-get_weather-0")]


def test_kimi_names_ids_and_stop_token():
    tokenizer = tokenizer_with(*KIMI_TOKENS)
    tools = [tool("get_weather", {"city": "string"}, ["city"]), tool("search", {"query": "string"}, ["query"])]
    text = ("<|tool_calls_section_begin|>"
            '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Kraków"}<|tool_call_end|>'
            '<|tool_call_begin|>functions.lookup:1<|tool_call_argument_begin|>{"query": "naïve"}<|tool_call_end|>'
            '<|tool_call_begin|>functions.search:2<|tool_call_argument_begin|>{"query": <|tool_call_end|>'
            "<|tool_calls_section_end|><|im_end|>")
    content, calls = parse("kimi", tokenizer, text, tools)
    assert content == ""
    assert calls == [call("get_weather", '{"city": "Kraków"}', tool_call_id="functions.get_weather:0"),  # in the id
                     call("search", '{"query": "naïve"}', tool_call_id="functions.lookup:1"),  # by required keys
                     # verl calls search with {}; pyrl answers the unreadable arguments
                     call("search", '{"query": ', tool_call_id="functions.search:2",
                          error="malformed tool call: the arguments are not a JSON object")]
    _, calls = parse("kimi", tokenizer, text)  # no tools: the name is the id as written
    assert [c.name for c in calls] == ["functions.get_weather:0", "functions.lookup:1", "functions.search:2"]
    assert parse("kimi", tokenizer, "Hello!<|im_end|>") == ("Hello!<|im_end|>", [])
    assert ToolParser.get_tool_parser("kimi", tokenizer).stop_token_ids == [tokenizer.convert_tokens_to_ids(
        "<|im_end|>")]


class _TokenizerWithUnk:
    """A tokenizer lacking a format's stop token, that answers unknown tokens with <unk> (id 0)."""

    pad_token = None

    def convert_tokens_to_ids(self, token: str) -> int:
        return 0

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return "<unk>"


def test_a_missing_stop_token_is_not_the_unk_token():
    assert ToolParser.get_tool_parser("kimi", _TokenizerWithUnk()).stop_token_ids == []
    assert ToolParser.get_tool_parser("glm", _TokenizerWithUnk()).stop_token_ids == []
    with pytest.raises(ValueError, match=r"multi_turn.format=gemma4: the tokenizer has no single token "
                                         r"'<tool_call\|>'"):
        ToolParser.get_tool_parser("gemma4", _TokenizerWithUnk())


# ---- deepseek_v4 (DSML) ----
DSML_TOKENS = ["<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", "<｜DSML｜invoke", "</｜DSML｜invoke>",
               "<｜DSML｜parameter", "</｜DSML｜parameter>", "<｜end▁of▁sentence｜>", "<think>", "</think>"]


def test_deepseek_v4_calls():
    tokenizer = tokenizer_with(*DSML_TOKENS)
    text = ("The user asks two things.</think>I'll check.\n\n<｜DSML｜tool_calls>\n"
            '<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">5</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="raw" string="true">5</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
            '<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="q" string="false">not json</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="opts" string="false">{"k": [1]}</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
            "</｜DSML｜tool_calls>\n<｜DSML｜tool_calls>\nsearch(q)\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
            "<|endoftext|>")
    content, calls = parse("deepseek_v4", tokenizer, text)
    assert content == "I'll check."  # reasoning, the blank line before the calls, EOS and padding gone
    assert calls == [call("get_weather", '{"city": "Zürich", "days": 5, "raw": "5"}'),
                     call("search", '{"q": "not json", "opts": {"k": [1]}}'),  # non-string, not JSON: kept raw
                     call("", "\nsearch(q)\n", error='malformed tool call: no <｜DSML｜invoke name="NAME">...'
                                                      "</｜DSML｜invoke> in the tool_calls block")]
    assert parse("deepseek_v4", tokenizer, "thinking</think>It is 4.<｜end▁of▁sentence｜>") == ("It is 4.", [])
    assert parse("deepseek_v4", tokenizer, "Chat mode, no reasoning.") == ("Chat mode, no reasoning.", [])
    assert ToolParser.get_tool_parser("deepseek_v4", tokenizer).stop_token_ids == []


# ---- gemma4 ----
GEMMA4_TOKENS = ["<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>", "<tool_response|>"]


def test_gemma4_calls_and_stop_token():
    tokenizer = tokenizer_with(*GEMMA4_TOKENS)
    text = ('Let me check.<|tool_call>call:get_weather{city:<|"|>Zürich, 東京<|"|>,days:3,metric:true,ratio:0.5,'
            "note:null,code:A1,flag:False}<tool_call|>")
    content, calls = parse("gemma4", tokenizer, text)
    assert content == "Let me check."
    # a quoted value may hold commas; bare ones are bools, null, ints, floats, else text
    assert calls == [call("get_weather", '{"city": "Zürich, 東京", "days": 3, "metric": true, "ratio": 0.5, '
                                         '"note": null, "code": "A1", "flag": false}')]
    text = ("<|tool_call>call:a{x:1}<tool_call|><|tool_call>get_weather{city:x}<tool_call|>"
            '<|tool_call>call:b{s:<|"|>y<|"|>}<tool_call|><|endoftext|>')
    assert parse("gemma4", tokenizer, text) == ("", [
        call("a", '{"x": 1}'), call("", "get_weather{city:x}", error="malformed tool call: expected call:NAME{...} "
                                                                    "in the block"), call("b", '{"s": "y"}')])
    for no_call in ["Sunny today.", "cut off <|tool_call>call:get_weather{city:"]:
        assert parse("gemma4", tokenizer, no_call) == (no_call, [])
    assert ToolParser.get_tool_parser("gemma4", tokenizer).stop_token_ids == [tokenizer.convert_tokens_to_ids(
        "<tool_call|>")]


# ---- the agent loop asks for the stop tokens ----
class _ScriptedEngine:
    """Answers each prompt with the next of its scripted turns (told apart by their first token: a tool agent's
    prompt grows turn by turn); records each call's prompt count, stop tokens and per-request seeds."""

    def __init__(self, turns_by_first_token: dict[int, list[list[int]]]):
        self.turns = turns_by_first_token
        self.calls: list[tuple[int, tuple[int, ...], list[int] | None]] = []

    def generate(self, prompt_ids, spec, max_tokens=None, seeds=None):
        self.calls.append((len(prompt_ids), spec.stop_token_ids, None if seeds is None else list(seeds)))
        return [self.turns[ids[0]].pop(0) for ids in prompt_ids], None


def _calculator_tool():
    from pyrl.tools.function_tool import FunctionTool, _build_schema_from_fn

    async def calculator(expression: str) -> str:
        """Evaluates an expression.

        Args:
            expression: the arithmetic expression
        """
        return {"6*7": "42"}[expression]

    return FunctionTool(name="calculator", fn=calculator, tool_schema=_build_schema_from_fn(calculator, "calculator"),
                        is_async=True)


def _runner(engine, tokenizer, response_length: int, tools: list, tool_format: str | None = None):
    from pyrl.config import ActorRolloutRefConfig, RolloutConfig
    from pyrl.experimental.agent_loop.agent_loop import AgentLoopRunner

    config = ActorRolloutRefConfig()
    config.rollout = RolloutConfig(response_length=response_length, prompt_length=8)
    if tool_format is not None:
        config.rollout.multi_turn.format = tool_format
    return AgentLoopRunner(engine, tokenizer, config, tools)


def _tool_agent_stop_token_ids(runner) -> list[int]:
    """The stop tokens the runner's tool agent asks for (built as the runner builds it, in a running loop)."""
    from pyrl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from pyrl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    async def build():
        return ToolAgentLoop(trainer_config=DictConfigWrap(runner.trainer_config), server_manager=None,
                             tokenizer=runner.tokenizer, tools=ToolListWrap(runner.tools), runtime=runner.runtime)

    return asyncio.run(build()).stop_token_ids


_ROWS = [{"agent_name": "tool_agent", "raw_prompt": [{"role": "user", "content": "6*7?"}],
          "raw_prompt_ids": [1, 2, 3]},
         {"agent_name": "single_turn_agent", "raw_prompt": [{"role": "user", "content": "6*7?"}],
          "raw_prompt_ids": [4, 5]}]


def test_agent_loop_stops_only_the_tool_agent_turns_at_the_parser_tokens():
    from pyrl.workers.rollout.base import SamplingSpec

    tokenizer = tokenizer_with(*GEMMA4_TOKENS, tools=True)
    stop = tokenizer.convert_tokens_to_ids("<tool_call|>")
    calling_turn = tokenizer.encode('<|tool_call>call:calculator{expression:<|"|>6*7<|"|>}<tool_call|>',
                                    add_special_tokens=False)
    answer = tokenizer.encode("<answer>42</answer><|im_end|>", add_special_tokens=False)
    assert calling_turn[-1] == stop and answer[-1] == tokenizer.eos_token_id
    engine = _ScriptedEngine({1: [calling_turn, answer], 4: [answer]})
    runner = _runner(engine, tokenizer, 64, [_calculator_tool()], tool_format="gemma4")
    assert _tool_agent_stop_token_ids(runner) == [stop]
    # sampled (seeds reach the engine only when sampling), seeded: each request gets its own seed
    out = runner.run(copy.deepcopy(_ROWS), dict(temperature=1.0), SamplingSpec(n=1, max_tokens=64, seed=7))
    tool_trajectory, single_trajectory = out.outputs
    # first, pending together: the tool agent's turn with the stop token and the single-turn row's without, in
    # separate calls (different stop tokens); then the tool agent's second turn alone, with it
    (n0, stop0, seeds0), (n1, stop1, seeds1), (n2, stop2, seeds2) = engine.calls
    assert (n0, stop0, n1, stop1, n2, stop2) == (1, (stop,), 1, (), 1, (stop,))
    assert (out.engine_calls, out.requests) == (3, 3)
    assert all(seeds is not None and len(seeds) == 1 for seeds in (seeds0, seeds1, seeds2))
    assert len({seeds0[0], seeds1[0], seeds2[0]}) == 3  # per trajectory and per call
    assert tool_trajectory.response_ids[:len(calling_turn)] == calling_turn  # the stop token kept, trained on
    assert tool_trajectory.response_mask[:len(calling_turn)] == [1] * len(calling_turn)
    assert tool_trajectory.response_mask[len(calling_turn)] == 0  # then the tool's answer, attended, not trained
    extra = tool_trajectory.extra_fields
    assert (extra["tool_call_counts"], extra["tool_error_counts"]) == (1, 0)
    # the tool's answer, "42", is the one block of context tokens between the two turns
    context = tool_trajectory.response_ids[len(calling_turn):-len(answer)]
    assert tool_trajectory.response_mask[len(calling_turn):-len(answer)] == [0] * len(context)
    text = tokenizer.decode(context, skip_special_tokens=False)
    assert text.count("42") == 1 and "Error" not in text
    assert tool_trajectory.response_ids[-len(answer):] == answer
    assert tool_trajectory.response_mask[-len(answer):] == [1] * len(answer)
    assert tool_trajectory.num_turns == 4  # prompt, call, tool, answer: two assistant turns
    assert single_trajectory.response_ids == answer
    assert "tool_call_counts" not in single_trajectory.extra_fields and single_trajectory.num_turns == 2


def test_agent_loop_without_stop_tokens_makes_one_call_per_round(tool_tokenizer):
    from pyrl.workers.rollout.base import SamplingSpec

    answer = tool_tokenizer.encode("<answer>1</answer><|im_end|>", add_special_tokens=False)
    engine = _ScriptedEngine({1: [answer], 4: [answer]})
    runner = _runner(engine, tool_tokenizer, 32, [])  # hermes
    assert _tool_agent_stop_token_ids(runner) == []
    out = runner.run(copy.deepcopy(_ROWS), dict(temperature=0.0), SamplingSpec(n=1, do_sample=False, max_tokens=32))
    assert engine.calls == [(2, (), None)]  # both first turns pending together: one call
    assert [o.response_ids for o in out.outputs] == [answer, answer]


# ---- the hf engine stops at them ----
def test_hf_engine_stops_at_a_stop_token_and_keeps_it(tiny_path):
    from transformers import AutoTokenizer

    from pyrl.config import RolloutConfig
    from pyrl.workers.rollout.base import SamplingSpec
    from pyrl.workers.rollout.hf_engine import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    engine = HFEngine(tiny_path, RolloutConfig(dtype="float32"), torch.device("cpu"), tokenizer)
    prompt = tokenizer.encode("what is the sum of 12 and 30?")
    # sampled from a fixed seed: the random tiny model's greedy decoding repeats one token; a seeded sample draws the
    # same tokens again, up to wherever it is stopped
    free_spec = SamplingSpec(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=True, seed=3)
    [free], [free_logprobs] = engine.generate([prompt], free_spec)
    assert len(free) == 12
    # the stop token: one the sample draws for the first time, a few steps in (so the cut is visible)
    step = next(i for i in range(4, len(free)) if free[i] not in free[:i])
    for ignore_eos in (True, False):  # a stop token stops a sample even with ignore_eos, as vLLM's stop_token_ids
        spec = dataclasses.replace(free_spec, ignore_eos=ignore_eos, stop_token_ids=(free[step],))
        [stopped], [stopped_logprobs] = engine.generate([prompt], spec)
        if not ignore_eos and tokenizer.eos_token_id in free[:step + 1]:
            continue  # EOS came first: nothing of the stop token to see
        assert stopped == free[:step + 1]  # up to and including the stop token
        assert stopped_logprobs == pytest.approx(free_logprobs[:step + 1])
    # several stop tokens: the first one met ends the sample
    later = next(token for token in free[step + 1:] if token not in free[:step + 1])
    [stopped], _ = engine.generate([prompt], dataclasses.replace(free_spec, stop_token_ids=(later, free[step])))
    assert stopped == free[:step + 1]
    [stopped], _ = engine.generate([prompt], dataclasses.replace(free_spec, stop_token_ids=(later,)))
    assert stopped == free[:free.index(later) + 1]


VLLM_STOP_PROBE = """
import dataclasses, json, sys, torch
from pyrl.config import RolloutConfig
from pyrl.workers.rollout.base import SamplingSpec
from pyrl.workers.rollout.vllm_engine import VLLMEngine
config = RolloutConfig(dtype="float32", load_format="auto", prompt_length=32, response_length=12, enforce_eager=True,
                       free_cache_engine=False)
engine = VLLMEngine(sys.argv[1], config, torch.device("cpu"))
prompt = [5, 6, 7, 8, 9, 10]
free_spec = SamplingSpec(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=True, seed=3)
[free], [free_logprobs] = engine.generate([prompt], free_spec)
step = next(i for i in range(4, len(free)) if free[i] not in free[:i])
[stopped], [stopped_logprobs] = engine.generate([prompt], dataclasses.replace(free_spec, stop_token_ids=(free[step],)))
print("RESULT", json.dumps([free, free_logprobs, step, stopped, stopped_logprobs]))
"""


def test_vllm_engine_stops_at_a_stop_token_and_keeps_it(tiny_path):
    """The same on the vllm engine (vLLM's own stop_token_ids, with ignore_eos too), in a process of its own (vLLM
    sets up torch.distributed in the process it runs in)."""
    pytest.importorskip("vllm")
    proc = subprocess.run([sys.executable, "-c", VLLM_STOP_PROBE, tiny_path], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    free, free_logprobs, step, stopped, stopped_logprobs = json.loads(line.removeprefix("RESULT "))
    assert len(free) == 12
    assert stopped == free[:step + 1]
    assert stopped_logprobs == pytest.approx(free_logprobs[:step + 1], abs=1e-5)
