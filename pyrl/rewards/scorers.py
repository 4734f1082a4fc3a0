"""Rule-based scorers, chosen by data_source as verl's default_compute_score."""

from __future__ import annotations

from pyrl.rewards import countdown, gsm8k, math_answer, toy

TOY_SOURCE = "pyrl/toy_addition"


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None):
    """The score of one response (float, or a dict with a "score" key and extra values)."""
    if data_source == "openai/gsm8k":
        return gsm8k.compute_score(solution_str, ground_truth)
    if data_source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        return math_answer.compute_score(solution_str, ground_truth)
    if data_source.startswith("countdown") or data_source == "Jiayi-Pan/Countdown-Tasks-3to4":
        return countdown.compute_score(solution_str, ground_truth)
    if data_source == TOY_SOURCE:
        return toy.compute_score(solution_str, ground_truth)
    raise NotImplementedError(f"no rule-based scorer for data_source {data_source!r}; "
                              "set custom_reward_function.path to score it")
