"""The hermes tool-call parser on hand-written responses, encoded with pyrl's tiny tokenizer and parsed from
the ids, as verl 0.9.1's HermesToolParser does it: with <tool_call> as plain text, as an ordinary added
token, and as a special token (kept: the text is decoded without skipping special tokens)."""

import asyncio
import json

import pytest

from pyrl.models.tiny import make_tokenizer
from pyrl.workers.rollout.tool_parser import FunctionCall, HermesToolParser, ToolParser

TAGS = ["<tool_call>", "</tool_call>"]


@pytest.fixture(scope="module", params=["plain", "added", "special"])
def tokenizer(request):
    tokenizer = make_tokenizer()
    if request.param != "plain":
        tokenizer.add_tokens(TAGS, special_tokens=request.param == "special")
        assert len(tokenizer.encode("<tool_call>")) == 1
    else:
        assert len(tokenizer.encode("<tool_call>")) > 1
    if request.param == "special":  # the case where skipping special tokens would lose the calls
        assert "<tool_call>" not in tokenizer.decode(tokenizer.encode("<tool_call>"), skip_special_tokens=True)
    return tokenizer


def parse(tokenizer, text: str):
    ids = tokenizer.encode(text, add_special_tokens=False)
    return asyncio.run(ToolParser.get_tool_parser("hermes", tokenizer).extract_tool_calls(ids))


def call(name, arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_one_call(tokenizer):
    content, calls = parse(tokenizer, call("calculator", {"expression": "12 * 7"}) + "<|im_end|>")
    assert calls == [FunctionCall(name="calculator", arguments='{"expression": "12 * 7"}')]
    assert calls[0].tool_call_id is None
    assert content == "<|im_end|>"  # special tokens are kept in the text, as verl decodes it


def test_two_calls_and_text_around_them(tokenizer):
    text = ("Let me compute both.\n" + call("calculator", {"expression": "1+2"}) + "\n"
            + call("search", {"query": "päivää", "top_k": 3, "filters": {"lang": ["fi", "en"]}}) + "\nDone.")
    content, calls = parse(tokenizer, text)
    assert [c.name for c in calls] == ["calculator", "search"]
    assert json.loads(calls[0].arguments) == {"expression": "1+2"}
    # the arguments are re-serialized, unicode kept (ensure_ascii=False)
    assert calls[1].arguments == '{"query": "päivää", "top_k": 3, "filters": {"lang": ["fi", "en"]}}'
    assert content == "Let me compute both.\n\n\nDone."


def test_malformed_calls_are_reported_and_cut_from_the_text(tokenizer):
    """A block that is not JSON with "name" and "arguments" becomes a call with `error` (verl 0.9.1 drops it
    silently), in its place among the good ones; it leaves the text like them."""
    text = ("a<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1+\"</tool_call>b"
            + call("calculator", {"expression": "2"})
            + "c<tool_call>{\"name\": \"calculator\"}</tool_call>"  # no arguments
            + "d<tool_call>{\"name\": 7, \"arguments\": {}}</tool_call>"  # a name that is not a string
            + "e<tool_call>[1, 2]</tool_call>f")
    content, calls = parse(tokenizer, text)
    assert calls[1] == FunctionCall(name="calculator", arguments='{"expression": "2"}')
    assert [c.error is None for c in calls] == [False, True, False, False, False]
    assert calls[0].error.startswith("malformed tool call: not JSON (")
    assert calls[0].arguments == '{"name": "calculator", "arguments": {"expression": "1+"'
    assert all(c.error == 'malformed tool call: expected a JSON object with "name" (a string) and "arguments"'
               for c in calls[2:])
    assert content == "abcdef"


def test_arguments_that_are_not_an_object_are_passed_on_as_json(tokenizer):
    """The parser does not judge the arguments: a string or list is re-serialized and left to the loop."""
    _, calls = parse(tokenizer, call("calculator", "1+2") + call("calculator", [1]))
    assert [c.arguments for c in calls] == ['"1+2"', "[1]"]


def test_no_call(tokenizer):
    for text in ["The answer is <answer>42</answer>.<|im_end|>", "", "an unclosed <tool_call>{\"name\": \"x\"",
                 "only a closing </tool_call> tag"]:
        assert parse(tokenizer, text) == (text, [])


def test_unknown_tool_names_are_kept(tokenizer):
    """Whether a tool exists is the agent loop's to answer (it replies "Unknown function ..."), even when the
    parser is given the tool schemas."""
    ids = tokenizer.encode(call("no_such_tool", {"x": 1}), add_special_tokens=False)
    parser = HermesToolParser(tokenizer)
    _, calls = asyncio.run(parser.extract_tool_calls(ids, tools=[]))
    assert calls == [FunctionCall(name="no_such_tool", arguments='{"x": 1}')]
    assert parser.stop_token_ids == []


def test_parser_registry():
    assert "hermes" in ToolParser.registered()
    with pytest.raises(ValueError, match=r"unknown tool parser 'qwen9'.*registered: \[.*'hermes'"):
        ToolParser.get_tool_parser("qwen9", None)


def test_register_a_parser(monkeypatch):
    monkeypatch.setattr(ToolParser, "_registry", dict(ToolParser._registry))

    @ToolParser.register("upper")
    class UpperParser(ToolParser):
        async def extract_tool_calls(self, responses_ids, tools=None):
            return "".join(map(str, responses_ids)).upper(), []

    assert "upper" in ToolParser.registered()
    parser = ToolParser.get_tool_parser("upper", tokenizer="tok")
    assert isinstance(parser, UpperParser) and parser.tokenizer == "tok"
    assert asyncio.run(parser.extract_tool_calls([1, 2])) == ("12", [])
