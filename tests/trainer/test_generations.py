"""Generation records and dumps (trainer.rollout_data_dir / validation_data_dir, log_val_generations)."""

import json

import numpy as np
import pytest
import torch

from pyrl.protocol import DataProto
from pyrl.trainer.generations import dump_generations, generation_records, pick_for_logging


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from transformers import AutoTokenizer

    from pyrl.models import tiny_model_path

    return AutoTokenizer.from_pretrained(tiny_model_path())


def test_records_decode_only_the_valid_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    pad = tok.pad_token_id
    prompt_a, prompt_b = tok.encode("12+34="), tok.encode("7+5=")
    answer_a, answer_b = tok.encode("<answer>46</answer>"), tok.encode("1")
    width, r = max(len(prompt_a), len(prompt_b)), max(len(answer_a), len(answer_b)) + 2
    prompts = torch.full((2, width), pad)
    prompts[0, width - len(prompt_a):] = torch.tensor(prompt_a)  # left padded, as the rollout makes them
    prompts[1, width - len(prompt_b):] = torch.tensor(prompt_b)
    responses = torch.full((2, r), pad)
    responses[0, :len(answer_a)] = torch.tensor(answer_a)
    responses[1, :len(answer_b)] = torch.tensor(answer_b)
    response_mask = (torch.arange(r)[None] < torch.tensor([[len(answer_a)], [len(answer_b)]])).long()
    attention_mask = torch.cat([prompts != pad, response_mask.bool()], dim=1).long()
    data = DataProto.from_dict({"prompts": prompts, "responses": responses, "response_mask": response_mask,
                                "attention_mask": attention_mask},
                               non_tensors={"reward_model": np.array([{"ground_truth": "46"}, {"ground_truth": "12"}]),
                                            "acc": np.array([True, False], dtype=object)})
    records = generation_records(tok, data, torch.tensor([1.0, 0.0]), step=7, extra_keys=["acc", "absent"])
    assert records == [
        {"input": "12+34=", "output": "<answer>46</answer>", "gts": "46", "score": 1.0, "step": 7, "acc": True},
        {"input": "7+5=", "output": "1", "gts": "12", "score": 0.0, "step": 7, "acc": False}]


def test_dump_is_one_json_line_per_sample_and_leaves_no_temporary(tmp_path):
    records = [{"input": "a", "output": "b", "gts": None, "score": 0.5, "step": 3, "extra": np.float32(0.25)},
               {"input": "c|", "output": "d\n", "gts": "x", "score": -1.0, "step": 3, "extra": np.arange(2)}]
    path = dump_generations(records, str(tmp_path / "dumps"), 3)
    assert path == str(tmp_path / "dumps" / "3.jsonl")
    lines = [json.loads(line) for line in open(path)]
    assert lines[0]["extra"] == 0.25 and lines[1]["extra"] == [0, 1] and lines[1]["output"] == "d\n"
    assert [p.name for p in (tmp_path / "dumps").iterdir()] == ["3.jsonl"]


def test_pick_for_logging_is_the_same_prompts_whatever_the_order():
    records = [{"input": f"q{i:02d}", "output": str(i), "score": float(i % 2)} for i in range(20)]
    picked = pick_for_logging(records, 5)
    shuffled = list(reversed(records))
    assert [r["input"] for r in pick_for_logging(shuffled, 5)] == [r["input"] for r in picked]
    assert len({r["input"] for r in picked}) == 5
    verl_choice = sorted(records, key=lambda r: r["input"])  # verl: sort by input, RandomState(42) shuffle, first n
    np.random.RandomState(42).shuffle(verl_choice)
    assert picked == verl_choice[:5]
    assert pick_for_logging(records, 0) == [] and len(pick_for_logging(records, 50)) == 20
