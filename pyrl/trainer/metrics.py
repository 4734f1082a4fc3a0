"""Step metrics with verl's names: data (scores, rewards, advantages, returns, values, lengths), timing,
throughput, and the validation summary."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np
import torch

from pyrl.protocol import DataProto


@contextmanager
def timer(name: str, timing: dict):
    start = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor, out: dict) -> None:
    values = values.float()
    if values.numel() == 0:
        return
    out[f"{prefix}/mean"] = values.mean().item()
    out[f"{prefix}/max"] = values.max().item()
    out[f"{prefix}/min"] = values.min().item()


def compute_data_metrics(batch: DataProto, use_critic: bool) -> dict:
    response_mask = batch.batch["response_mask"].bool()
    response_width = response_mask.shape[-1]
    prompt_mask = batch.batch["attention_mask"][:, :-response_width].bool()
    response_length = response_mask.sum(-1).float()
    prompt_length = prompt_mask.sum(-1).float()
    valid = response_length > 0  # aborted (empty) responses are left out of score statistics, as verl
    out: dict = {}
    _stats("critic/score", batch.batch["token_level_scores"].sum(-1)[valid], out)
    _stats("critic/rewards", batch.batch["token_level_rewards"].sum(-1)[valid], out)
    _stats("critic/advantages", batch.batch["advantages"][response_mask], out)
    _stats("critic/returns", batch.batch["returns"][response_mask], out)
    if use_critic:
        values, returns = batch.batch["values"][response_mask], batch.batch["returns"][response_mask]
        _stats("critic/values", values, out)
        out["critic/vf_explained_var"] = (1 - torch.var(returns - values) / (torch.var(returns) + 1e-5)).item()
    _stats("response_length", response_length, out)
    out["response_length/clip_ratio"] = (response_length == response_width).float().mean().item()
    _stats("prompt_length", prompt_length, out)
    out["prompt_length/clip_ratio"] = (prompt_length == prompt_mask.shape[-1]).float().mean().item()
    out["response/aborted_ratio"] = (~valid).float().mean().item()
    return out


def compute_timing_metrics(batch: DataProto, timing: dict) -> dict:
    response_tokens = batch.batch["response_mask"].sum().item()
    all_tokens = batch.batch["attention_mask"].sum().item()
    out = {f"timing_s/{name}": seconds for name, seconds in timing.items()}
    per_token = {"gen": response_tokens, "ref": all_tokens, "values": all_tokens, "adv": all_tokens,
                 "update_critic": all_tokens, "update_actor": all_tokens, "old_log_prob": all_tokens}
    for name, tokens in per_token.items():
        if name in timing and tokens:
            out[f"timing_per_token_ms/{name}"] = timing[name] * 1000 / tokens
    return out


def compute_throughput_metrics(batch: DataProto, timing: dict, n_workers: int) -> dict:
    tokens = batch.batch["attention_mask"].sum().item()
    step = timing["step"]
    return {"perf/total_num_tokens": tokens, "perf/time_per_step": step,
            "perf/throughput": tokens / (step * max(n_workers, 1)),
            "perf/gen_tokens_per_s": batch.batch["response_mask"].sum().item() / max(timing.get("gen", 0.0), 1e-9)}


def reduce_metrics(metrics: dict) -> dict:
    """Worker metrics gathered as lists (one per rank / mini-batch) -> their means."""
    return {k: float(np.mean(v)) if isinstance(v, (list, tuple, np.ndarray)) else v for k, v in metrics.items()}


def validation_metrics(data_sources, scores, uids, n: int, response_lengths) -> dict:
    """val-core/{data_source}/reward/mean@n, and with n > 1 the mean over prompts of each prompt's best
    (val-aux/{data_source}/reward/best@n) and the sample standard deviation (std@n)."""
    by_source: dict = defaultdict(lambda: defaultdict(list))
    for source, score, uid in zip(data_sources, scores, uids):
        by_source[source][uid].append(score)
    out = {}
    for source, groups in by_source.items():
        all_scores = [s for group in groups.values() for s in group]
        out[f"val-core/{source}/reward/mean@{n}"] = float(np.mean(all_scores))
        if n > 1:
            out[f"val-aux/{source}/reward/best@{n}"] = float(np.mean([max(g) for g in groups.values()]))
            out[f"val-aux/{source}/reward/std@{n}"] = float(np.mean([np.std(g) for g in groups.values()]))
    out["val-aux/response_length/mean"] = float(np.mean(response_lengths))
    return out
