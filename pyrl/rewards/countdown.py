"""Countdown: the last <answer>equation</answer> must use each given number exactly once and evaluate
to the target (TinyZero's rule). 1.0 if right, format_score if there is an equation that is not."""

from __future__ import annotations

import ast
import operator
import re

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED = re.compile(r"^[\d+\-*/().\s]+$")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def extract_equation(solution_str: str) -> str | None:
    found = _ANSWER.findall(solution_str)
    return found[-1].strip() if found else None


def safe_eval(expression: str) -> float:
    """+ - * / and parentheses over numbers, nothing else (no names, calls or attributes)."""
    if not _ALLOWED.match(expression):
        raise ValueError(f"countdown: characters other than digits, + - * / ( ) in {expression!r}")

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -walk(node.operand) if isinstance(node.op, ast.USub) else walk(node.operand)
        raise ValueError(f"countdown: unsupported expression {ast.dump(node)}")

    return walk(ast.parse(expression, mode="eval"))


def compute_score(solution_str: str, ground_truth, format_score: float = 0.1, score: float = 1.0) -> float:
    """ground_truth: {"target": int, "numbers": [int, ...]}."""
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    used = sorted(int(n) for n in re.findall(r"\d+", equation))
    if used != sorted(int(n) for n in ground_truth["numbers"]):
        return format_score
    try:
        value = safe_eval(equation)
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError):
        return format_score
    return score if abs(value - float(ground_truth["target"])) < 1e-5 else format_score
