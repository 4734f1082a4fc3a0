"""GSM8K: the answer after the last "#### " (strict) or the last number (flexible), in the last 300
characters, compared as a string with the ground truth as given (verl 0.9.1's gsm8k.py: a ground truth that is not
a str never matches)."""

from __future__ import annotations

import re

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    if method not in ("strict", "flexible"):
        raise ValueError(f"method: expected 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-300:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _NUMBER.findall(tail)
    for candidate in reversed(found):
        if candidate not in ("", "."):
            return candidate
    return found[0] if found else None  # every number is ".": verl's loop ends on (and returns) the first


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score
