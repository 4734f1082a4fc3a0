"""The tool task's warm-start: its exact two-stage evaluator, the shared SFT loop, and a smoke run (a few steps)."""

import json
import os

import pytest
import torch

from pyrl.data.tool_calc import calculator_schema, tool_calc_pairs
from pyrl.models.tiny import TinyModelSpec, make_tokenizer
from pyrl.models.warm_start import (
    ToolCallEvaluator,
    supervised_warm_start,
    tool_transfer_warm_start_path,
    tool_warm_start_path,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(TinyModelSpec(tools=True))


class ScriptedModel:
    """Stands in for a causal LM in ToolCallEvaluator: generate() continues each (left-padded) context with the
    tokens `script` gives for it, then pads."""

    def __init__(self, tok, script):
        self.tok, self.script, self.training = tok, script, True

    def eval(self):
        self.training = False

    def train(self, mode=True):
        self.training = mode

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, **kwargs):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            out = self.script([t for t, m in zip(ids, mask) if m])[:max_new_tokens]
            rows.append(ids + out + [pad_token_id] * (max_new_tokens - len(out)))
        return torch.tensor(rows)


def test_evaluator_is_exact_on_scripted_answers(tok):
    pairs = tool_calc_pairs(0, 0, 8)[1]
    evaluate = ToolCallEvaluator(tok, pairs, [calculator_schema()])
    golden = {}
    for prompt, call, prefix, (a, b) in zip(evaluate.prompts, evaluate.calls, evaluate.prefixes, pairs):
        golden[tuple(prompt)] = call
        golden[tuple(prefix)] = tok(f"<answer>{a * b}</answer><|im_end|>", add_special_tokens=False)["input_ids"]
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731

    def script(wrong_call=(), wrong_answer=(), answer_text=None):
        def run(context):
            gold = golden[tuple(context)]
            i = next(i for i, prompt in enumerate(evaluate.prompts + evaluate.prefixes) if prompt == context) % 8
            if context in evaluate.prompts:
                return gold[:-3] + ids("0") + gold[-2:] if i in wrong_call else gold
            if answer_text is not None:
                return ids(answer_text)
            return ids("<answer>1</answer><|im_end|>") if i in wrong_answer else gold
        return ScriptedModel(tok, run)

    assert evaluate(script()) == {"success": 1.0, "tool-call rate": 1.0, "answer rate": 1.0}
    assert evaluate(script(wrong_call={0, 1}, wrong_answer={1, 2, 3})) == {
        "success": 4 / 8, "tool-call rate": 6 / 8, "answer rate": 5 / 8}
    truth = str(pairs[0][0] * pairs[0][1])
    # the answer turn must end (eos) and make no further call; its answer is scored like the reward's
    for text in (f"<answer>{truth}</answer>", f"<answer>{truth}</answer><tool_call>x</tool_call><|im_end|>"):
        assert evaluate(script(answer_text=text))["answer rate"] == 0.0
    model = script()
    evaluate(model)
    assert model.training  # left as it was


def test_sft_loop_stops_at_its_goal_or_keeps_the_best(tok):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=16)
    model = Qwen2ForCausalLM(config)
    examples = [([5, 6, 7, 8], [-100, -100, 7, 8]), ([9, 10, 11], [-100, 10, 11])]
    calls = []

    def evaluate(m):
        calls.append({k: v.clone() for k, v in m.state_dict().items()})
        return {"score": [0.1, 0.5, 0.2][len(calls) - 1]}

    steps, metrics, reached = supervised_warm_start(model, examples, evaluate, lambda m: m["score"] >= 0.5, seed=0,
                                                    max_steps=100, pad_token_id=0, name="t", goal="g",
                                                    eval_every=3, progress=False, batch_size=4)
    assert (steps, metrics, reached, len(calls)) == (6, {"score": 0.5}, True, 2)
    calls.clear()
    with pytest.warns(UserWarning, match="t: g not reached after 8 steps"):
        steps, metrics, reached = supervised_warm_start(model, examples, evaluate, lambda m: False, seed=0,
                                                        max_steps=8, pad_token_id=0, name="t", goal="g",
                                                        eval_every=3, progress=False, batch_size=4)
    assert (steps, metrics, reached, len(calls)) == (8, {"score": 0.5}, False, 3)  # evaluated at 3, 6 and 8
    assert all(torch.equal(v, calls[1][k]) for k, v in model.state_dict().items())  # the best one's weights


def test_tool_warm_start_smoke(tmp_path):
    """A few steps on a few examples: both stages stop at max_steps (with warnings), the model is saved with its
    tokenizer and a record, and found in the cache the second time."""
    kwargs = dict(max_steps=2, cache_dir=str(tmp_path), progress=False, train_size=64, val_size=8)
    with pytest.warns(UserWarning, match="not reached after 2 steps"):
        path = tool_warm_start_path(**kwargs)
    assert tool_warm_start_path(**kwargs) == path and "-tool-sft-" in path
    info = json.load(open(os.path.join(path, "pyrl_warm_start.json")))
    assert info["steps"] == 4 and info["skill_steps"] == info["habit_steps"] == 2
    assert {"success", "call_rate", "answer_rate", "sampled_success", "sampled_call_rate", "seconds"} <= info.keys()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == len(tokenizer) and "<tools>" in tokenizer.chat_template
    assert tokenizer.convert_ids_to_tokens(tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]) == [
        "<tool_call>"]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]


def test_transfer_warm_start_smoke_and_what_it_shows(tmp_path):
    """The transfer variant's warm-start: a few steps, saved with a record of its success on sums and differences
    and on products (greedy and sampled); its training conversations never call the calculator on a product, and
    with products="guessed" the products it shows are answered without it, never rightly."""
    from pyrl.data.tool_calc import tool_transfer_conversations, tool_transfer_problems
    from pyrl.rewards.tool_calc import compute_score

    problems = tool_transfer_problems(0, 64, 8)[0]
    for products in ("absent", "guessed"):
        conversations = tool_transfer_conversations(problems, products)
        calls = [c for c in conversations if any("tool_calls" in m for m in c)]
        assert len(calls) == 64 and len(conversations) == (64 if products == "absent" else 96)
        assert not [c for c in calls if "*" in c[1]["tool_calls"][0]["function"]["arguments"]["expression"]]
        for c in conversations:
            if "*" in c[0]["content"]:
                a, b = map(int, c[0]["content"][:-1].split("*"))
                assert len(c) == 2 and compute_score(c[1]["content"], a * b) == 0.0
    with pytest.raises(ValueError, match="products='some'"):
        tool_transfer_conversations(problems, "some")
    kwargs = dict(max_steps=2, cache_dir=str(tmp_path), progress=False, train_size=64, val_size=8, products="guessed")
    with pytest.warns(UserWarning, match="not reached after 2 steps"):
        path = tool_transfer_warm_start_path(**kwargs)
    assert tool_transfer_warm_start_path(**kwargs) == path and path.endswith("-tool-transfer-sft-v1-guess-train64-val8")
    with pytest.raises(ValueError, match="products='guesed'"):  # checked before the cache lookup
        tool_transfer_warm_start_path(**{**kwargs, "products": "guesed"})
    info = json.load(open(os.path.join(path, "pyrl_warm_start.json")))
    assert info["steps"] == 2 and info["products"] == "guessed"
    for key in ("sums_and_differences", "products_greedy", "products_sampled"):
        assert set(info[key]) == {"success", "tool-call rate", "answer rate"}, key
