import logging
import time

import numpy as np
import pytest
import torch

from pyrl.protocol import DataProto
from pyrl.rewards.managers import BatchRewardManager, RewardManager, load_custom_function


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pyrl.models import tiny_model_path

    return AutoTokenizer.from_pretrained(tiny_model_path())


def rollout(tokenizer, answers, truths, width=8):
    """A rollout batch whose responses are `answers` (+ eos), right-padded to `width`."""
    prompt = tokenizer("1+1=", add_special_tokens=False)["input_ids"]
    rows = [tokenizer(a + tokenizer.eos_token, add_special_tokens=False)["input_ids"][:width] for a in answers]
    responses = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        responses[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    prompts = torch.tensor([prompt] * len(rows))
    return DataProto.from_dict(
        {"prompts": prompts, "responses": responses, "response_mask": mask,
         "attention_mask": torch.cat([torch.ones_like(prompts), mask], -1)},
        {"data_source": np.array(["pyrl/toy_addition"] * len(rows), dtype=object),
         "reward_model": np.array([{"ground_truth": t} for t in truths], dtype=object)})


def test_naive_puts_the_score_on_the_last_valid_token(tokenizer):
    data = rollout(tokenizer, ["<answer>2</answer>", "<answer>3</answer>", ""], ["2", "2", "2"])
    scores, extra, metrics = RewardManager(tokenizer)(data)
    lengths = data.batch["response_mask"].sum(-1)
    assert scores[0, lengths[0] - 1] == 1.0 and scores.sum() == 1.0
    assert metrics == {"reward/scorer_errors": 0, "reward/scorer_timeouts": 0}


def test_failing_and_slow_scorers_score_zero_are_counted_and_logged_once(tokenizer, caplog):
    def flaky(source, solution, truth, extra=None):
        if "3" in solution:
            raise ValueError("cannot parse")
        if "4" in solution:
            time.sleep(5)
        return 1.0

    data = rollout(tokenizer, ["<answer>3</answer>", "<answer>3</answer>", "<answer>4</answer>", "<answer>2</answer>"],
                   ["2"] * 4)
    with caplog.at_level(logging.WARNING):
        scores, _, metrics = RewardManager(tokenizer, flaky, timeout_s=0.2)(data)
    assert scores.sum(-1).tolist() == [0.0, 0.0, 0.0, 1.0]
    assert metrics == {"reward/scorer_errors": 2, "reward/scorer_timeouts": 1}
    messages = [r.getMessage() for r in caplog.records]
    assert sum("raised on sample 0" in m for m in messages) == 1 and not any("sample 1" in m for m in messages)
    assert any("timed out on sample 2" in m for m in messages)
    with pytest.raises(RuntimeError, match="raised on sample 0 .reward_model.strict=true.: ValueError: cannot parse"):
        RewardManager(tokenizer, flaky, strict=True)(data)


def test_dict_scores_batch_manager_and_overlong_penalty(tokenizer, tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def compute_reward(sources, solutions, truths, extras, bonus=0.0):\n"
                    "    return [{'score': float(len(s)) + bonus, 'chars': len(s)} for s in solutions]\n")
    fn = load_custom_function(str(path), "compute_reward", {"bonus": 0.5})
    data = rollout(tokenizer, ["ab", "abcdef"], ["", ""])
    scores, extra, _ = BatchRewardManager(tokenizer, fn)(data)
    assert scores.sum(-1).tolist() == [2.5, 6.5] and extra["chars"] == [2, 6]
    with pytest.raises(AttributeError, match="defines no function 'nope'"):
        load_custom_function(str(path), "nope")
    # DAPO: responses longer than max_len - buffer lose up to penalty_factor, linearly
    manager = RewardManager(tokenizer, lambda *a: 1.0, max_response_length=8,
                            overlong_buffer={"enable": True, "len": 4, "penalty_factor": 1.0})
    data = rollout(tokenizer, ["a", "abcdefghijk"], ["", ""])
    lengths = data.batch["response_mask"].sum(-1).tolist()
    scores, _, _ = manager(data)
    assert scores.sum(-1).tolist() == pytest.approx([1.0 + min(0.0, -(n - 4) / 4) for n in lengths])


def test_extra_fields_stay_aligned_when_a_dict_scorer_fails(tokenizer):
    """A sample whose scorer raised scores 0 and gets 0.0 for the numeric extra fields, None for the others;
    a field only some samples return is filled the same way; a dict without 'score' is an error."""
    def scorer(source, solution, truth, extra=None):
        if "3" in solution:
            raise ValueError("cannot parse")
        out = {"score": 1.0, "acc": True, "pred": solution}
        if "4" in solution:
            out["format_ok"] = 0.5
        return out

    data = rollout(tokenizer, ["<answer>3</answer>", "<answer>4</answer>", "<answer>2</answer>"], ["2"] * 3)
    scores, extra, metrics = RewardManager(tokenizer, scorer)(data)
    assert scores.sum(-1).tolist() == [0.0, 1.0, 1.0] and metrics["reward/scorer_errors"] == 1
    assert extra == {"score": [0.0, 1.0, 1.0], "acc": [0.0, True, True],
                     "pred": [None, "<answer>4</answer>", "<answer>2</answer>"], "format_ok": [0.0, 0.5, 0.0]}
    with pytest.raises(ValueError, match="compute_score returned a dict without 'score' for sample 0"):
        RewardManager(tokenizer, lambda *a: {"acc": 1.0})(data)
