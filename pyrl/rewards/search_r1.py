"""Search-R1 QA (data sources searchR1_*): the last <answer>...</answer> in the response, normalized as SQuAD does
(lower case, no punctuation, no articles, single spaces), must equal one of ground_truth["target"] (a str or a
sequence of them) normalized alike: score, but score / 4 when the response holds more than 10 opening or closing
answer tags; format_score for a wrong answer, 0.0 for none. compute_score_subem takes a target contained in the answer.

Ported from verl 0.9.1 verl/utils/reward_score/search_r1_like_qa_em.py, Apache-2.0 (Copyright 2024 Bytedance Ltd.
and/or its affiliates; Copyright 2023-2024 SGLang Team; Copyright 2025 Search-R1 Contributors), itself adapted from
Search-R1's qa_em.py. verl prints one response in 64, chosen at random; pyrl prints none."""

from __future__ import annotations

import re
import string

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def _as_list(golden_answers) -> list:
    return [golden_answers] if isinstance(golden_answers, str) else golden_answers


def em_check(prediction: str, golden_answers) -> int:
    """1 if the normalized prediction equals one of the normalized golden answers (a str or a sequence), else 0."""
    normalized = normalize_answer(prediction)
    return int(any(normalize_answer(golden) == normalized for golden in _as_list(golden_answers)))


def subem_check(prediction: str, golden_answers) -> int:
    """1 if one of the normalized golden answers is in the normalized prediction, else 0."""
    normalized = normalize_answer(prediction)
    return int(any(normalize_answer(golden) in normalized for golden in _as_list(golden_answers)))


def extract_solution(solution_str: str) -> str | None:
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def count_answer_tags(text: str) -> tuple[int, int]:
    return text.count("<answer>"), text.count("</answer>")


def compute_score(solution_str: str, ground_truth: dict, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """ground_truth: {"target": str or [str, ...]}. method is accepted for verl's signature and, as there, unused."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    if not em_check(answer, ground_truth["target"]):
        return format_score
    open_count, close_count = count_answer_tags(solution_str)
    return score / 4 if open_count > 10 or close_count > 10 else score  # a response spamming answer tags


def compute_score_subem(solution_str: str, ground_truth: dict, method: str = "strict", format_score: float = 0.0,
                        score: float = 1.0) -> float:
    """compute_score with the substring match, and no penalty for many answer tags."""
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return score if subem_check(answer, ground_truth["target"]) else format_score
