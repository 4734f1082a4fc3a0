"""DAPO math (data sources math_dapo, math, math_dapo_reasoning, aime*): of the response's last 300 characters, the
last "Answer: ..." line, normalized as Minerva does (units, \\text{}, dollars, spaces, \\frac / \\sqrt shorthand,
thousands commas), must equal the normalized ground truth; with no such line the last \\boxed{...} in the last 100
characters must equal the ground truth as written. strict_box_verify uses only the \\boxed{} check. The score is a
dict: score 1.0 or -1.0, acc (bool) and pred (the answer compared, None when there was none).

Ported from verl 0.9.1 verl/utils/reward_score/math_dapo.py, Apache-2.0 (Copyright 2024 Bytedance Ltd. and/or its
affiliates; Copyright 2022 EleutherAI and the HuggingFace Inc. team), itself adapted from lm-evaluation-harness's
hendrycks_math utils."""

from __future__ import annotations

import re

from pyrl.rewards.math_answer import braced_from

ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"

SUBSTITUTIONS = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
]

REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
]


def last_boxed_only_string(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    return braced_from(text, start)


def remove_boxed(boxed: str) -> str:
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(f"not a boxed answer: {boxed!r}")
    return boxed[len("\\boxed{"):-1]


def normalize_final_answer(final_answer: str) -> str:
    final_answer = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        final_answer = final_answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        final_answer = final_answer.replace(expr, "")
    # keep the first $...$ math; unwrap \text{}, \textbf{}, \overline{} and \boxed{}
    final_answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", final_answer)
    final_answer = re.sub(r"(\\text\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\textbf\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\overline\{)(.*?)(\})", "\\2", final_answer)
    final_answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", final_answer)
    # shorthand TeX: \fracab -> \frac{a}{b}, \fracabc -> \frac{a}{b}c, \sqrta -> \sqrt{a}
    final_answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", final_answer)
    final_answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", final_answer)
    final_answer = final_answer.replace("$", "")
    if final_answer.replace(",", "").isdigit():  # 1,000 -> 1000
        final_answer = final_answer.replace(",", "")
    return final_answer.strip()


def is_correct_minerva(solution_str: str, gt: str, answer_pattern: str = ANSWER_PATTERN) -> tuple[bool, str]:
    """(whether the last "Answer:" line matches, its normalized text, "[INVALID]" when there is none)."""
    match = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(match[-1] if match else "[INVALID]")
    return pred == normalize_final_answer(gt), pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    """(1 or -1, the last \\boxed{} content in the 100 characters before the last pause token, or in the last 100
    characters, compared with gt as written; None when there is no box)."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index: expected 4 indices, got {pause_tokens_index!r}")
        pred = pred[pause_tokens_index[-1] - 100:]
    else:
        pred = pred[-100:]
    boxed = last_boxed_only_string(pred)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def verify(solution_str: str, answer: str, strict_box_verify: bool = False,
           pause_tokens_index: list[int] | None = None) -> tuple[bool, str | None]:
    if strict_box_verify:
        correct, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return correct == 1, pred
    correct, pred = is_correct_minerva(solution_str, answer)
    if pred != "[INVALID]":
        return correct, pred
    box_correct, box_pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
    if box_pred is not None:
        return box_correct == 1, box_pred
    return correct, pred


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict:
    """{"score": 1.0 or -1.0, "acc": bool, "pred": str or None}."""
    solution_str = solution_str[-300:]  # the longest answer in MATH-500 has 159 characters
    correct, pred = verify(solution_str, ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
