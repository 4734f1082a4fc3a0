"""The warm-starts: the tool task's exact two-stage evaluator, the SFT trainer run they share (stopped at a goal), and
smoke runs (a few steps)."""

import json
import os

import pytest
import torch

from pyrl.data.tool_calc import calculator_schema, tool_calc_pairs
from pyrl.models.tiny import TinyModelSpec, make_tokenizer
from pyrl.models.warm_start import ToolCallEvaluator, tool_transfer_warm_start_path, tool_warm_start_path

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


def test_sft_trainer_run_stops_at_its_goal_or_keeps_the_best(tmp_path):
    """sft_until: a run of the SFT trainer evaluated every eval_every steps and at the last: it stops at the first
    evaluation whose metrics meet the goal and keeps the earliest checkpoint since the previous evaluation that meets
    it; otherwise it runs max_steps and keeps the best one evaluated, with a warning. The kept directory is that
    step's hf_model, weight for weight."""
    import ray
    from safetensors.torch import load_file

    from pyrl.data.toy import toy_answer, toy_prompt
    from pyrl.models.tiny import tiny_model_path
    from pyrl.models.warm_start import WarmStartWarning, conversations_file, sft_until

    started_ray = not ray.is_initialized()
    base = tiny_model_path(TinyModelSpec(), cache_dir=str(tmp_path / "cache"))
    train = conversations_file(str(tmp_path / "train.parquet"), [
        [{"role": "user", "content": toy_prompt(a, b)}, {"role": "assistant", "content": toy_answer(a, b)}]
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14), (15, 16)]])
    seen, scores = [], [0.1, 0.5, 0.2]

    def evaluate(model):
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return {"score": scores[len(seen) - 1]}

    common = dict(base=base, train_file=train, evaluate=evaluate, seed=0, eval_every=3, batch_size=4, progress=False)
    try:
        kept, steps, metrics, reached = sft_until("t", "g", done=lambda m: m["score"] >= 0.5, max_steps=100,
                                                  work_dir=str(tmp_path / "a"), **common)
        assert (steps, metrics, reached, len(seen)) == (6, {"score": 0.5}, True, 2)
        assert any(not torch.equal(seen[0][k], seen[1][k]) for k in seen[0])  # it trained between
        weights = load_file(os.path.join(kept, "model.safetensors"))
        assert all(torch.equal(weights[k], seen[1][k]) for k in weights)
        seen.clear()
        with pytest.warns(WarmStartWarning, match="t: g not reached after 8 steps"):
            kept, steps, metrics, reached = sft_until("t", "g", done=lambda m: False, max_steps=8,
                                                      work_dir=str(tmp_path / "b"), **common)
        assert (steps, metrics, reached, len(seen)) == (8, {"score": 0.5}, False, 3)  # evaluated at 3, 6 and 8
        weights = load_file(os.path.join(kept, "model.safetensors"))
        assert all(torch.equal(weights[k], seen[1][k]) for k in weights)  # the best one's weights
        assert {"config.json", "tokenizer.json", "generation_config.json"} <= set(os.listdir(kept))
        # checkpoints every 2 steps, evaluations every 4: the goal met at step 8 is looked for at step 6 (after
        # step 4's evaluation), which meets it too and is kept; the run stops at step 8
        seen.clear()
        scores[:] = [0.1, 0.9, 0.6]
        kept, steps, metrics, reached = sft_until("t", "g", done=lambda m: m["score"] >= 0.5, max_steps=100,
                                                  work_dir=str(tmp_path / "c"), **{**common, "eval_every": 4},
                                                  save_every=2)
        assert (steps, metrics, reached, len(seen)) == (6, {"score": 0.6}, True, 3)
        weights = load_file(os.path.join(kept, "model.safetensors"))
        assert all(torch.equal(weights[k], seen[2][k]) for k in weights)
        assert any(not torch.equal(seen[1][k], seen[2][k]) for k in seen[1])
    finally:
        if started_ray:
            ray.shutdown()


def test_tool_warm_start_smoke(tmp_path):
    """A few steps on a few examples: both stages stop at max_steps (with warnings), the model is saved with its
    tokenizer and a record, and found in the cache the second time."""
    kwargs = dict(max_steps=2, cache_dir=str(tmp_path), progress=False, train_size=64, val_size=8, batch_size=16)
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
    kwargs = dict(max_steps=2, cache_dir=str(tmp_path), progress=False, train_size=64, val_size=8, batch_size=16,
                  products="guessed")
    with pytest.warns(UserWarning, match="not reached after 2 steps"):
        path = tool_transfer_warm_start_path(**kwargs)
    assert tool_transfer_warm_start_path(**kwargs) == path
    assert path.endswith("-tool-transfer-sft-v2-guess-train64-val8-batch16")
    with pytest.raises(ValueError, match="products='guesed'"):  # checked before the cache lookup
        tool_transfer_warm_start_path(**{**kwargs, "products": "guesed"})
    info = json.load(open(os.path.join(path, "pyrl_warm_start.json")))
    assert info["steps"] == 2 and info["products"] == "guessed"
    for key in ("sums_and_differences", "products_greedy", "products_sampled"):
        assert set(info[key]) == {"success", "tool-call rate", "answer rate"}, key
