"""The toy task: the first <answer>...</answer> must hold the ground truth exactly."""

from __future__ import annotations

import re

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def compute_score(solution_str: str, ground_truth) -> float:
    found = _ANSWER.search(solution_str)
    return 1.0 if found is not None and found.group(1).strip() == str(ground_truth) else 0.0
