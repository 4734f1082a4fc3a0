"""The reward of benchmarks/bench_e2e.py, the same on both sides: pyrl loads `compute_score` from this file
(reward.custom_reward_function.path/name) and TRL's GRPOTrainer calls `trl_reward`.

Cheap and deterministic, so that the benchmark times the trainers, not the scorer; its value is the
share of the response's characters that are among the prompt's ground-truth letters, which varies
between the samples of a group, so that GRPO's advantages are not all zero.
"""

from __future__ import annotations


def letter_share(response: str, letters: str) -> float:
    """The share of `response`'s characters found in `letters` (0 for an empty response)."""
    return sum(ch in letters for ch in response) / len(response) if response else 0.0


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """pyrl's (and verl's) scorer signature."""
    return letter_share(solution_str, ground_truth)


def trl_reward(prompts, completions, ground_truth, **kwargs) -> list[float]:
    """TRL's reward-function signature: conversational completions are lists of messages, and the data
    set's other columns (here `ground_truth`) come as keyword lists."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [letter_share(text, truth) for text, truth in zip(texts, ground_truth)]
