"""Rule-based scorers, chosen by data_source as verl's default_compute_score."""

from __future__ import annotations

from pyrl.rewards import code_exec, countdown, gsm8k, math_answer, math_dapo, search_r1, tool_calc, toy

TOY_SOURCE = "pyrl/toy_addition"
TOOL_CALC_SOURCE = tool_calc.SOURCE  # "pyrl/tool_calc"
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_MATH_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every source named aime*
SEARCH_R1_SOURCES = tuple(f"searchR1_{name}" for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa",
                                                          "musique", "bamboogle"))
# verl 0.9.1's sources pyrl has no scorer for: their scorers need packages pyrl does not install (sympy and
# pylatexenc for prime_math, mathruler for geo3k)
UNSCORED_VERL_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                         "numina_cn_k12", "numina_olympiads", "hiyouga/geometry3k")


def scorer_for(data_source: str):
    """The module whose compute_score scores `data_source` under default_compute_score (verl 0.9.1's dispatch,
    and pyrl's own sources), or None."""
    if data_source in code_exec.DATA_SOURCES:
        return code_exec
    if data_source == "openai/gsm8k":
        return gsm8k
    if data_source in MATH_SOURCES:
        return math_answer
    if data_source in DAPO_MATH_SOURCES or data_source.startswith("aime"):
        return math_dapo
    if data_source in SEARCH_R1_SOURCES:
        return search_r1
    if data_source.startswith("countdown") or data_source == "Jiayi-Pan/Countdown-Tasks-3to4":
        return countdown
    if data_source == TOY_SOURCE:
        return toy
    if data_source == TOOL_CALC_SOURCE:
        return tool_calc
    return None


def no_scorer(data_source: str) -> str:
    """Why default_compute_score cannot score `data_source`, and what to do instead."""
    why = ("verl 0.9.1 scores it with a scorer whose packages pyrl does not install"
           if data_source in UNSCORED_VERL_SOURCES else "no rule-based scorer for it")
    return f"data_source {data_source!r}: {why}; set reward.custom_reward_function.path to score it"


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None,
                          sandbox_fusion_url: str | None = None, concurrent_semaphore=None,
                          memory_limit_mb: int | None = None, max_concurrent: int | None = None,
                          allow_unisolated: bool = False):
    """The score of one response (float, or a dict with a "score" key and extra values). The keywords after
    extra_info are verl's for code execution (reward.sandbox_fusion.*, bound by the reward manager):
    sandbox_fusion_url sends the test runs to that server instead of pyrl.sandbox; max_concurrent (pyrl's, for
    verl's shared concurrent_semaphore) bounds the requests in flight from one scoring process; allow_unisolated
    (pyrl's reward.sandbox.allow_unisolated) lets the local sandbox run programs without a kernel boundary."""
    scorer = scorer_for(data_source)
    if scorer is None:
        raise NotImplementedError(no_scorer(data_source))
    if scorer is code_exec:
        return code_exec.compute_score(solution_str, ground_truth, sandbox_fusion_url=sandbox_fusion_url,
                                       concurrent_semaphore=concurrent_semaphore,
                                       memory_limit_mb=memory_limit_mb or code_exec.MEMORY_LIMIT_MB,
                                       max_concurrent=max_concurrent or code_exec.MAX_CONCURRENT,
                                       allow_unisolated=allow_unisolated)
    return scorer.compute_score(solution_str, ground_truth)
