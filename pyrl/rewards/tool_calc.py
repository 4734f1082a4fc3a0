"""The tool-use task (pyrl.data.tool_calc): the LAST <answer>...</answer> of the response must hold the product.

The response a reward manager scores holds every turn of a multi-turn rollout, the tool responses too; what a
tool returned counts for nothing (a product inside <tool_response>...</tool_response>, with or without answer
tags, is not an answer): only the policy's own answer tags do."""

from __future__ import annotations

import re

SOURCE = "pyrl/tool_calc"

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TOOL_RESPONSE = re.compile(r"<tool_response>.*?(</tool_response>|$)", re.DOTALL)


def compute_score(solution_str: str, ground_truth) -> float:
    answers = _ANSWER.findall(_TOOL_RESPONSE.sub("", solution_str))
    return 1.0 if answers and answers[-1].strip() == str(ground_truth).strip() else 0.0
