"""Rule-based scorers, chosen by data_source as verl's default_compute_score."""

from __future__ import annotations

from pyrl.rewards import code_exec, countdown, gsm8k, math_answer, tool_calc, toy

TOY_SOURCE = "pyrl/toy_addition"
TOOL_CALC_SOURCE = tool_calc.SOURCE  # "pyrl/tool_calc"


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None,
                          sandbox_fusion_url: str | None = None, concurrent_semaphore=None,
                          memory_limit_mb: int | None = None, max_concurrent: int | None = None,
                          allow_unisolated: bool = False):
    """The score of one response (float, or a dict with a "score" key and extra values). The keywords after
    extra_info are verl's for code execution (reward.sandbox_fusion.*, bound by the reward manager):
    sandbox_fusion_url sends the test runs to that server instead of pyrl.sandbox; max_concurrent (pyrl's, for
    verl's shared concurrent_semaphore) bounds the requests in flight from one scoring process; allow_unisolated
    (pyrl's reward.sandbox.allow_unisolated) lets the local sandbox run programs without a kernel boundary."""
    if data_source in code_exec.DATA_SOURCES:
        return code_exec.compute_score(solution_str, ground_truth, sandbox_fusion_url=sandbox_fusion_url,
                                       concurrent_semaphore=concurrent_semaphore,
                                       memory_limit_mb=memory_limit_mb or code_exec.MEMORY_LIMIT_MB,
                                       max_concurrent=max_concurrent or code_exec.MAX_CONCURRENT,
                                       allow_unisolated=allow_unisolated)
    if data_source == "openai/gsm8k":
        return gsm8k.compute_score(solution_str, ground_truth)
    if data_source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        return math_answer.compute_score(solution_str, ground_truth)
    if data_source.startswith("countdown") or data_source == "Jiayi-Pan/Countdown-Tasks-3to4":
        return countdown.compute_score(solution_str, ground_truth)
    if data_source == TOY_SOURCE:
        return toy.compute_score(solution_str, ground_truth)
    if data_source == TOOL_CALC_SOURCE:
        return tool_calc.compute_score(solution_str, ground_truth)
    raise NotImplementedError(f"no rule-based scorer for data_source {data_source!r}; "
                              "set custom_reward_function.path to score it")
