"""`calculator`: a built-in tool that evaluates an arithmetic expression, so that a model can learn to hand
arithmetic to a tool (the simplest tool-use task to train and to test the agent loop on).

The expression is parsed with `ast` and walked; nothing is eval'd. Allowed: integer and decimal literals,
+ - * / // % ** and unary +/-, parentheses. Numbers are exact fractions (0.1 + 0.2 is 0.3, 6 / 3 is 2);
only a fractional power (2 ** 0.5) falls back to floating point. Sizes are capped before they are
computed, so that 9**9**9 is refused at once instead of running for hours: no number may have more than
MAX_DIGITS digits, and a power is computed exactly only when its size is known to be near that cap (else
floating point tells at once whether it fits). Bad expressions become a short "Error: ..." text for the
model, never an exception.
"""

from __future__ import annotations

import ast
import decimal
import math
import operator
from fractions import Fraction
from typing import Any

from pyrl.tools.base_tool import BaseTool
from pyrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

MAX_EXPRESSION_CHARS = 1000
MAX_DIGITS = 1000
_MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))
_SIGNIFICANT_DIGITS = 16  # of a non-integer result: what a double holds

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator will not evaluate; the message is shown to the model."""


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; CalculatorError says why when there is none."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression too long (more than {MAX_EXPRESSION_CHARS} characters)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("invalid syntax") from None
    except (RecursionError, MemoryError):  # thousands of nested parentheses
        raise CalculatorError("expression nested too deeply") from None
    try:
        return _eval(tree.body)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def format_number(value: Fraction) -> str:
    """Integers in full; other numbers to 16 significant digits, without trailing zeros."""
    if value.denominator == 1:
        return str(value.numerator)
    with decimal.localcontext() as ctx:
        ctx.prec = _SIGNIFICANT_DIGITS
        number = (decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)).normalize()
    return format(number, "f") if -7 <= number.adjusted() < _SIGNIFICANT_DIGITS else format(number, "e")


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"unsupported literal {node.value!r}; expected a number")
        if isinstance(node.value, float):
            if not math.isfinite(node.value):
                raise CalculatorError(f"number too large (more than {MAX_DIGITS} digits)")
            # the float's shortest repr is the decimal that was written (0.1, not the binary 0.1000000000000000055...)
            return _checked(Fraction(repr(node.value)))
        return _checked(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if type(node.op) in _BINARY:
            if right == 0 and not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
                raise CalculatorError("division by zero")
            return _checked(_BINARY[type(node.op)](left, right))
        if isinstance(node.op, ast.BitXor):
            raise CalculatorError("unsupported operator ^; use ** for powers")
    raise CalculatorError(f"unsupported expression {ast.unparse(node)!r}; "
                          f"expected numbers, + - * / // % ** and parentheses")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    if exponent.denominator == 1:
        # base ** e has about size * |e| bits: compute it exactly only when that is cheap (a few times the cap)
        size = max(abs(base.numerator).bit_length(), base.denominator.bit_length()) - 1
        if size * abs(exponent.numerator) <= 2 * _MAX_BITS:
            return _checked(base ** exponent.numerator)
    elif base < 0:
        raise CalculatorError("fractional power of a negative number")
    # floating point decides at once whether the result fits: 9 ** 387420489 overflows instead of being computed
    try:
        magnitude = float(abs(base)) ** float(exponent)
    except (OverflowError, ZeroDivisionError):  # ZeroDivisionError: a base that underflowed to 0.0, e < 0
        raise CalculatorError(f"result too large (more than {MAX_DIGITS} digits)") from None
    negative = base < 0 and exponent.numerator % 2 == 1
    return _checked(Fraction(-magnitude if negative else magnitude))


def _checked(value: Fraction) -> Fraction:
    """`value`, refused when its magnitude passes the cap; a denominator past it is cut to _MAX_BITS binary
    places (tiny values stay representable; exactness there is not worth unbounded fractions)."""
    if abs(value.numerator).bit_length() - value.denominator.bit_length() > _MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_DIGITS} digits)")
    if value.denominator.bit_length() > _MAX_BITS:
        scale = 1 << (_MAX_BITS - 1)
        return Fraction(value.numerator * scale // value.denominator, scale)
    return value


class CalculatorTool(BaseTool):
    """Evaluates `{"expression": str}` and answers with the number as text (or "Error: ..." text)."""

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
                "parameters": {
                    "type": "object",
                    "properties": {"expression": {"type": "string",
                                                  "description": "The expression, e.g. (12 + 7) * 3 / 4."}},
                    "required": ["expression"],
                },
            },
        })

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            return ToolResponse(text="Error: expected a string argument 'expression'"), 0.0, {}
        try:
            return ToolResponse(text=format_number(evaluate(expression))), 0.0, {}
        except CalculatorError as error:
            return ToolResponse(text=f"Error: {error}"), 0.0, {}
