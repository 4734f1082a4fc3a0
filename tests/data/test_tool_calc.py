"""The tool-use task: the tiny tool model's chat template and tokens (turn by turn = whole conversation), the
demonstrations' loss mask, the scorer, and the verl-schema data files."""

import json
import os

import pytest

from pyrl.data.tool_calc import (
    HIGH,
    LOW,
    TOOL_USE_FROM,
    calculator_schema,
    tool_calc_demonstration,
    tool_calc_mixed,
    tool_calc_pairs,
    tool_calc_task_files,
    tool_transfer_problems,
)
from pyrl.models.tiny import CHAT_TEMPLATE, TOOL_TOKENS, TinyModelSpec, make_tokenizer, tiny_model_path
from pyrl.models.warm_start import assistant_mask, conversation_tokens
from pyrl.rewards.scorers import default_compute_score
from pyrl.rewards.tool_calc import compute_score

DEMO_TEXT = (
    "<|im_start|>system\n<tools>calculator</tools><|im_end|>\n"
    "<|im_start|>user\n347*812=<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "347*812"}}</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>281764</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<answer>281764</answer><|im_end|>\n"
)
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "347*812"}}</tool_call><|im_end|>'


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(TinyModelSpec(tools=True))


def render(tok, messages, tools=None, add_generation_prompt=False):
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_template_renders_a_demonstration_exactly(tok):
    tools = [calculator_schema()]
    assert render(tok, tool_calc_demonstration(347, 812), tools) == DEMO_TEXT
    assert render(tok, [{"role": "user", "content": "347*812="}], tools, True) == (
        "<|im_start|>system\n<tools>calculator</tools><|im_end|>\n<|im_start|>user\n347*812=<|im_end|>\n"
        "<|im_start|>assistant\n")
    # no tools: no system turn; several tools by name; consecutive tool messages share one user turn; an assistant
    # message with content None renders no "None"
    other = {"type": "function", "function": {"name": "search", "description": "", "parameters": {}}}
    call = tool_calc_demonstration(1, 2)[1]["tool_calls"][0]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [call, call]},
                {"role": "tool", "content": "2"}, {"role": "tool", "content": "2"},
                {"role": "assistant", "content": "<answer>2</answer>"}]
    assert render(tok, messages, [calculator_schema(), other]) == (
        "<|im_start|>system\n<tools>calculator search</tools><|im_end|>\n<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
        + '<tool_call>{"name": "calculator", "arguments": {"expression": "1*2"}}</tool_call>' * 2 + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>2</tool_response><tool_response>2</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<answer>2</answer><|im_end|>\n")
    assert render(tok, messages[1:2]) == "<|im_start|>user\nq<|im_end|>\n"


def test_tool_tokens_and_scaffolding(tok):
    for t in TOOL_TOKENS + ["<answer>", "</answer>"]:
        assert tok.convert_ids_to_tokens(ids(tok, t)) == [t]
    pieces = tok.convert_ids_to_tokens(ids(tok, CALL))
    assert pieces == ["<tool_call>", '{"', "name", '":', 'Ġ"', "calculator", '",', 'Ġ"', "arguments", '":', 'Ġ{"',
                      "expression", '":', 'Ġ"', "3", "4", "7", "*", "8", "1", "2", '"}}', "</tool_call>", "<|im_end|>"]
    assert tok.eos_token == "<|im_end|>"


def test_turn_by_turn_tokens_equal_the_whole_conversation(tok):
    """What an agent loop builds (the prompt with the generation prompt, the generated call through <|im_end|>,
    "\\n" and the tool turn rendered as a delta with the next generation prompt, the answer) is the whole
    conversation tokenized at once."""
    tools = [calculator_schema()]
    messages = tool_calc_demonstration(347, 812)
    prompt = ids(tok, render(tok, messages[:1], tools, True))
    call = ids(tok, CALL)
    before = render(tok, messages[:2], tools)
    delta_text = render(tok, messages[:3], tools, True)[len(before) - 1:]  # from the "\n" after <|im_end|>
    assert render(tok, messages[:3], tools, True).startswith(before)
    assert delta_text == ("\n<|im_start|>user\n<tool_response>281764</tool_response><|im_end|>\n"
                          "<|im_start|>assistant\n")
    delta = ids(tok, delta_text)
    answer = ids(tok, "<answer>281764</answer><|im_end|>")
    whole = ids(tok, DEMO_TEXT)
    assert prompt + call + delta + answer + ids(tok, "\n") == whole
    assert len(prompt) == 28 and len(call) + len(delta) + len(answer) == 50  # the lengths the tool preset budgets for

    # the same through the agent loop's own builder: "\n" after a turn's <|im_end|>, the tool turn as a delta
    from pyrl.workers.rollout.agent_loop import ChatTokens

    chat = ChatTokens(tok)
    assert chat.turn_separator == ids(tok, "\n")
    assert chat.turn_separator + chat.tool_responses([{"role": "tool", "content": "281764"}], tools) == delta


def test_assistant_mask_covers_the_assistant_turns_exactly(tok):
    [(token_ids, mask)] = conversation_tokens(tok, [tool_calc_demonstration(347, 812)], [calculator_schema()])
    assert token_ids == ids(tok, DEMO_TEXT) and mask == assistant_mask(tok, token_ids)
    runs, run = [], []
    for t, m in zip(token_ids, mask):
        if m:
            run.append(t)
        elif run:
            runs.append(run)
            run = []
    assert [tok.decode(r) for r in runs] == [CALL, "<answer>281764</answer><|im_end|>"]
    # the tool's turn, the headers and the "\n" after each <|im_end|> are not trained
    assert sum(mask) == len(ids(tok, CALL)) + len(ids(tok, "<answer>281764</answer><|im_end|>"))


@pytest.mark.parametrize("response, score", [
    (CALL + "\n<|im_start|>user\n<tool_response>281764</tool_response><|im_end|>\n<|im_start|>assistant\n"
     "<answer>281764</answer><|im_end|>", 1.0),  # right
    ("<answer>281764</answer>", 1.0),  # right without the tool
    ("<answer> 281764 </answer>", 1.0),
    (CALL + "<tool_response>281764</tool_response><answer>281765</answer>", 0.0),  # wrong
    (CALL + "<tool_response>281764</tool_response>", 0.0),  # the product only in the tool's response
    ("<tool_response><answer>281764</answer></tool_response>", 0.0),  # an answer tag the tool wrote
    ("<tool_response><answer>281764</answer>", 0.0),  # ... in a cut-off tool response
    ("<answer>281764</answer> no, <answer>281765</answer>", 0.0),  # two answers: the last counts
    ("<answer>281765</answer> no, <answer>281764</answer>", 1.0),
    ("281764", 0.0),  # no answer tag
    ("", 0.0),
])
def test_scorer(response, score):
    assert compute_score(response, "281764") == score
    assert default_compute_score("pyrl/tool_calc", response, "281764") == score


def test_pairs_split_disjoint_and_deterministic():
    train, val, test = tool_calc_pairs(0, 500, 64, 32)
    assert (train, val, test) == tool_calc_pairs(0, 500, 64, 32)
    assert (len(set(train)), len(set(val)), len(set(test))) == (500, 64, 32)
    assert not set(train) & set(val) and not set(test) & (set(train) | set(val))
    assert all(LOW <= a <= HIGH and LOW <= b <= HIGH and 100000 <= a * b <= 999999 for a, b in train + val + test)
    assert tool_calc_pairs(1, 500, 64, 32) != (train, val, test)
    # the test split is drawn after train and val: those stay the ones the cached warm-starts were made from
    assert tool_calc_pairs(0, 500, 64, 0) == (train, val, [])
    conversations, used = tool_calc_mixed(train, 0)
    assert (conversations, used) == tool_calc_mixed(train, 0)
    high = [u for (a, _), u in zip(train, used) if a >= TOOL_USE_FROM]
    low = [u for (a, _), u in zip(train, used) if a < TOOL_USE_FROM]
    assert 0.5 < sum(high) / len(high) and sum(low) / len(low) < 0.35  # 0.8 and 0.2 by construction
    for (a, b), conversation, tool in zip(train, conversations, used):
        assert (conversation == tool_calc_demonstration(a, b)) == tool
        if not tool:  # a guess, never right
            assert len(conversation) == 2 and compute_score(conversation[1]["content"], a * b) == 0.0


def test_transfer_problems_are_sums_and_differences_only():
    """The transfer warm-start's problems: never a product, results never negative, deterministic, train and val
    disjoint; a demonstration's call and tool result are the problem's own operation."""
    train, val = tool_transfer_problems(0, 400, 40)
    assert (train, val) == tool_transfer_problems(0, 400, 40) and not set(train) & set(val)
    assert {op for _, _, op in train + val} == {"+", "-"} and len(set(train)) == 400
    assert all(LOW <= a <= HIGH and LOW <= b <= HIGH and (op == "+" or a >= b) for a, b, op in train + val)
    assert 0.4 < sum(op == "+" for _, _, op in train) / 400 < 0.6
    user, call, tool, answer = tool_calc_demonstration(900, 347, "-")
    assert user["content"] == "900-347=" and call["tool_calls"][0]["function"]["arguments"] == {"expression": "900-347"}
    assert tool["content"] == "553" and answer["content"] == "<answer>553</answer>"


def test_task_files(tmp_path):
    from pyrl.config import DataConfig
    from pyrl.data import RLHFDataset

    config = DataConfig()
    files = tool_calc_task_files(seed=0, train_size=100, val_size=16, test_size=8, cache_dir=str(tmp_path))
    assert tool_calc_task_files(seed=0, train_size=100, val_size=16, test_size=8, cache_dir=str(tmp_path)) == files
    assert not [f for f in os.listdir(tmp_path / "data") if f.startswith(".")]  # written through a temp dir
    train_file, val_file, test_file = files
    train, val, test = tool_calc_pairs(0, 100, 16, 8)
    dataset = RLHFDataset([train_file], None, config)
    assert len(dataset) == 100 and len(RLHFDataset([val_file], None, config)) == 16
    held = RLHFDataset([test_file], None, config)
    assert [held[i]["raw_prompt"][0]["content"] for i in range(8)] == [f"{a}*{b}=" for a, b in test]
    assert held[0]["extra_info"]["split"] == "heldout"
    item = dataset[3]
    a, b = train[3]
    assert item["data_source"] == "pyrl/tool_calc"
    assert item["raw_prompt"] == [{"role": "user", "content": f"{a}*{b}="}]
    assert item["reward_model"] == {"style": "rule", "ground_truth": str(a * b)}
    assert item["extra_info"]["index"] == 3 and item["extra_info"]["split"] == "train"
    assert item["tools_kwargs"] == {}
    assert RLHFDataset([val_file], None, config)[0]["extra_info"]["split"] == "test"


def test_default_spec_unchanged(tmp_path):
    """The default tiny model keeps its fingerprint (cache directory), spec file and tokenizer: the default run's
    cached model and warm-start stay valid; the tool variant is a model of its own."""
    spec = TinyModelSpec()
    assert spec.fingerprint() == "221d4ffc49f3"
    assert "tools" not in spec.as_dict() and TinyModelSpec(tools=True).as_dict()["tools"] is True
    assert TinyModelSpec(tools=True).fingerprint() != spec.fingerprint()
    tok = make_tokenizer(spec)
    assert tok.chat_template == CHAT_TEMPLATE and len(tok) == 322
    assert not set(TOOL_TOKENS) & set(tok.get_vocab())
    path = tiny_model_path(TinyModelSpec(tools=True), cache_dir=str(tmp_path))
    assert json.load(open(os.path.join(path, "pyrl_spec.json")))["tools"] is True
