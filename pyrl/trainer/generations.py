"""Generations a person reads: trainer.rollout_data_dir / trainer.validation_data_dir get every sample of a
step as DIR/STEP.jsonl (verl's _dump_generations: input, output, gts, score, step and the reward's extra
fields), and trainer.log_val_generations picks N validation samples for the loggers."""

from __future__ import annotations

import json
import os

import numpy as np

from pyrl.protocol import DataProto, response_lengths


def generation_records(tokenizer, data: DataProto, scores, step: int, extra_keys=()) -> list[dict]:
    """One dict per sample: the prompt and response text (special tokens dropped), the ground truth,
    the sequence score and any reward extra fields the batch carries."""
    prompts = data.batch["prompts"]
    prompt_mask = data.batch["attention_mask"][:, :prompts.shape[1]].bool()
    lengths = response_lengths(data).tolist()
    inputs = [tokenizer.decode(row[m], skip_special_tokens=True) for row, m in zip(prompts, prompt_mask)]
    outputs = [tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(data.batch["responses"], lengths)]
    reward_model = data.non_tensor_batch.get("reward_model")
    records = []
    for i, (text_in, text_out) in enumerate(zip(inputs, outputs)):
        record = {"input": text_in, "output": text_out,
                  "gts": None if reward_model is None else reward_model[i].get("ground_truth"),
                  "score": float(scores[i]), "step": step}
        if "uid" in data.non_tensor_batch:  # which samples answer the same prompt
            record["uid"] = str(data.non_tensor_batch["uid"][i])
        for key in extra_keys:
            if key in data.non_tensor_batch:
                record[key] = data.non_tensor_batch[key][i]
        records.append(record)
    return records


def dump_generations(records: list[dict], directory: str, step: int) -> str:
    """DIRECTORY/STEP.jsonl, written to a temporary name and renamed (a reader never sees half a file)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{step}.jsonl")
    with open(path + ".tmp", "w") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, default=_plain) + "\n")
    os.replace(path + ".tmp", path)
    return path


def pick_for_logging(records: list[dict], n: int) -> list[dict]:
    """verl's choice: sort by input, shuffle with a fixed seed (the same prompts every validation, so a
    reader follows how their answers change), keep n."""
    if n <= 0:
        return []
    ordered = sorted(records, key=lambda r: r["input"])
    np.random.RandomState(42).shuffle(ordered)
    return ordered[:n]


def _plain(value):
    """numpy scalars and arrays in reward extra fields -> JSON."""
    return value.tolist() if hasattr(value, "tolist") else str(value)
