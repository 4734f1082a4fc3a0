"""Step metrics with verl's names: data (scores, rewards, advantages, returns, values, lengths), timing,
throughput, and the validation summary."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from pyrl.protocol import DataProto, response_lengths
from pyrl.rewards.managers import is_number
from pyrl.utils.profiler import simple_timer as timer  # noqa: F401 (the trainer's phase timer)


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
    response_length = response_lengths(batch).float()
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
    if valid.any():
        _stats("response_length_non_aborted", response_length[valid], out)
        out["response_length_non_aborted/clip_ratio"] = (response_length[valid] == response_width).float().mean().item()
    _stats("prompt_length", prompt_length, out)
    out["prompt_length/clip_ratio"] = (prompt_length == prompt_mask.shape[-1]).float().mean().item()
    out["response/aborted_ratio"] = (~valid).float().mean().item()
    out.update(agent_loop_metrics(batch.non_tensor_batch))
    return out


def agent_loop_metrics(nt: dict) -> dict:
    """verl's num_turns/* (and training/num_turns/*), tool_call_counts/* and
    timing_s/agent_loop/{generate_sequences,tool_calls,slowest}/*, with pyrl's tool errors, from the agent loop's
    per-sample columns of a batch's non_tensor_batch (absent for single-turn rollouts)."""
    out = {}
    for column, prefix in (("__num_turns__", "num_turns"), ("tool_call_counts", "tool_call_counts"),
                           ("tool_error_counts", "tool_error_counts"),
                           ("tool_seconds", "timing_s/agent_loop/tool_calls"),
                           ("generate_seconds", "timing_s/agent_loop/generate_sequences")):
        if column in nt and len(nt[column]):
            values = np.asarray(nt[column], dtype=np.float64)
            out.update({f"{prefix}/min": values.min(), f"{prefix}/max": values.max(), f"{prefix}/mean": values.mean()})
    if "generate_seconds" in nt and len(nt["generate_seconds"]):  # the batch waits for its slowest trajectory
        generate = np.asarray(nt["generate_seconds"], dtype=np.float64)
        tools = np.asarray(nt["tool_seconds"], dtype=np.float64)
        slowest = int(np.argmax(generate + tools))
        out["timing_s/agent_loop/slowest/generate_sequences"] = generate[slowest]
        out["timing_s/agent_loop/slowest/tool_calls"] = tools[slowest]
    if "num_turns/min" in out:  # verl 0.9.1's default trainer logs the turns under training/ too
        out.update({f"training/{key}": out[key] for key in ("num_turns/min", "num_turns/max", "num_turns/mean")})
    if "tool_call_counts" in nt and len(nt["tool_call_counts"]):
        calls = np.asarray(nt["tool_call_counts"], dtype=np.float64)
        errors = np.asarray(nt["tool_error_counts"], dtype=np.float64)
        out["tool_calls/sample_ratio"] = float((calls > 0).mean())  # samples that called a tool at all
        out["tool_calls/error_ratio"] = float(errors.sum() / calls.sum()) if calls.sum() else 0.0
    return out


def compute_timing_metrics(batch: DataProto, timing: dict) -> dict:
    response_tokens = response_lengths(batch).sum().item()
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
            # one-step-off rollout: gen is the wait for the batch, generate_async its generation
            "perf/gen_tokens_per_s": response_lengths(batch).sum().item()
            / max(timing.get("generate_async", timing.get("gen", 0.0)), 1e-9)}


def reduce_metrics(metrics: dict) -> dict:
    """Worker metrics gathered as lists (one per rank / mini-batch) -> their means."""
    return {k: float(np.mean(v)) if isinstance(v, (list, tuple, np.ndarray)) else v for k, v in metrics.items()}


def bootstrap_picks(n_values: int, subset_size: int, n_bootstrap: int = 1000, seed: int = 42) -> np.ndarray:
    """verl's bootstrap draws: [n_bootstrap, subset_size] indices with replacement, the same as verl's
    np.random.seed(seed) followed by np.random.choice per subset, from a private RandomState so the global
    numpy RNG is left alone."""
    return np.random.RandomState(seed).randint(0, n_values, size=(n_bootstrap, subset_size))


def bootstrap_best_worst(values: np.ndarray, picks: np.ndarray):
    """verl's bootstrap_metric with reduce_fns [max, min] over the subsets `picks` -> ((mean, std) of the
    subsets' max, (mean, std) of their min)."""
    subsets = values[picks]
    best, worst = subsets.max(axis=1), subsets.min(axis=1)
    return (best.mean(), best.std()), (worst.mean(), worst.std())


def bootstrap_majority(values: list, preds: list, picks: np.ndarray):
    """verl's maj@N: in each subset of `picks` the most frequent prediction wins (ties: the one seen first in
    the subset) and the subset scores the value of its first sample with that prediction -> (mean, std)."""
    outcomes = []
    for row in picks.tolist():
        counts: dict = {}
        first_value: dict = {}
        for i in row:
            counts[preds[i]] = counts.get(preds[i], 0) + 1
            first_value.setdefault(preds[i], values[i])
        outcomes.append(first_value[max(counts, key=counts.get)])
    return float(np.mean(outcomes)), float(np.std(outcomes))


def _per_prompt_metrics(values: list, preds: list | None) -> dict:
    """verl's per-prompt statistics of one variable over the prompt's n responses."""
    n = len(values)
    array = np.asarray(values, dtype=np.float64)
    out = {f"mean@{n}": array.mean()}
    if n == 1:
        return out
    out[f"std@{n}"] = array.std()
    sizes, size = [], 2
    while size < n:  # 2, 4, 8, ... below n, then n
        sizes.append(size)
        size *= 2
    for size in sizes + [n]:
        picks = bootstrap_picks(n, size)
        (out[f"best@{size}/mean"], out[f"best@{size}/std"]), (out[f"worst@{size}/mean"], out[f"worst@{size}/std"]) = \
            bootstrap_best_worst(array, picks)
        if preds is not None:
            out[f"maj@{size}/mean"], out[f"maj@{size}/std"] = bootstrap_majority(values, preds, picks)
    return out


def validation_metrics(data_sources, uids, infos: dict, response_lengths) -> dict:
    """verl's validation summary. `infos` maps a variable to one value per sample: "reward" (the sequence
    score) and the reward function's extra fields; numeric ones are summarised per data source. Per prompt
    (uid) over its N responses: mean@N, and for N > 1 std@N and, for each size 2, 4, ... < N and N, bootstrap
    best@size / worst@size (and maj@size when the scorer returns a "pred" field) as /mean and /std; then
    averaged over prompts. val-core/{source}/{var}/... holds mean, maj and best at the largest N of the core
    variable ("acc" when the scorer reports it, else "reward"); everything else is val-aux/. With "acc", verl
    0.9.1's acc_success_only too: acc over the samples whose rollout did not fail (pyrl drops none: acc's values)."""
    grouped: dict = defaultdict(lambda: defaultdict(list))  # source -> uid -> sample indices
    for i, (source, uid) in enumerate(zip(data_sources, uids)):
        grouped[source][uid].append(i)
    preds = infos.get("pred")
    if "acc" in infos:
        infos = {**infos, "acc_success_only": infos["acc"]}
    out = {}
    for source, groups in grouped.items():
        indices = [i for group in groups.values() for i in group]
        variables = [name for name, values in infos.items()
                     if name != "pred" and all(is_number(values[i]) for i in indices)]
        core = "acc" if "acc" in variables else "reward"
        for name in variables:
            per_metric: dict = defaultdict(list)
            for group in groups.values():
                group_preds = None if preds is None else [preds[i] for i in group]
                for metric, value in _per_prompt_metrics([float(infos[name][i]) for i in group], group_preds).items():
                    per_metric[metric].append(value)
            n_max = max(int(metric.split("@")[1].split("/")[0]) for metric in per_metric)
            for metric, values in per_metric.items():
                is_core = name == core and metric.startswith(("mean", "maj", "best")) and f"@{n_max}" in metric
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{name}/{metric}"] = float(np.mean(values))
    out["val-aux/response_length/mean"] = float(np.mean(response_lengths))
    return out
