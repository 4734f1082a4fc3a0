"""MATH: the last \\boxed{...} answer, normalized as the lm-eval-harness Hendrycks MATH task does, compared with the
normalized ground truth: 1.0 if they match, else 0.0. A transcription of verl 0.9.1's math_reward.py, quirks kept so
that the scores are verl's: a "\\boxed 5" answer (up to the next "$") wins over every \\boxed{...}; an \\fbox{...}
answer is found but scores 0; "\\%" is stripped, a bare "%" is not; when normalizing fails (two "\\text{ " units, a
trailing "\\sqrt" or "\\frac") the two answers are compared as written; a ground truth that is not a str never
matches."""

from __future__ import annotations


def braced_from(text: str, start: int) -> str | None:
    """text from `start` through the brace that closes the first one opened there, or None where none closes
    (verl's scan in last_boxed_only_string, both its math and its DAPO variant)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def last_boxed_only_string(text: str) -> str | None:
    if "\\boxed " in text:  # the "\boxed 5$" form wins wherever it is, as in verl
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")  # only when there is no \boxed at all
        if start < 0:
            return None
    return braced_from(text, start)


def remove_boxed(boxed: str) -> str:
    """The content of "\\boxed 5" or "\\boxed{5}"; ValueError for anything else (verl asserts), \\fbox{} included."""
    if "\\boxed " in boxed:
        if not boxed.startswith("\\boxed "):
            raise ValueError(f"not a boxed answer: {boxed!r}")
        return boxed[len("\\boxed "):]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(f"not a boxed answer: {boxed!r}")
    return boxed[len("\\boxed{"):-1]


def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}; the input unchanged when a \\frac has one character
    after it, and ValueError when one has none (verl's IndexError)."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if not part:
            raise ValueError("\\frac with nothing after it")
        if part[0] == "{":
            out += part
        elif len(part) < 2:
            return s
        else:
            a, b, rest = part[0], part[1], part[2:]
            out += "{" + a + "}" + ("{" + b + "}" + rest if b != "{" else b + rest)
    return out


def _fix_a_slash_b(s: str) -> str:
    if s.count("/") != 1:
        return s
    a, b = s.split("/")
    try:
        a_int, b_int = int(a), int(b)
    except ValueError:
        return s
    return f"\\frac{{{a_int}}}{{{b_int}}}" if s == f"{a_int}/{b_int}" else s


def _remove_right_units(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:  # verl asserts a single unit
        raise ValueError(f"more than one \\text{{ unit in {s!r}")
    return parts[0]


def _fix_sqrt(s: str) -> str:
    """\\sqrt3 -> \\sqrt{3}; ValueError for a \\sqrt with nothing after it (verl's IndexError)."""
    parts = s.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        if not part:
            raise ValueError("\\sqrt with nothing after it")
        out += "\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:])
    return out


def strip_string(s: str) -> str:
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    s = _remove_right_units(s)
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    if len(s.split("=")) == 2 and len(s.split("=")[0]) <= 2:  # "k = 5" -> "5"
        s = s.split("=")[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def is_equiv(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        return strip_string(a) == strip_string(b)
    except Exception:  # an answer that does not normalize (or a ground truth that is not a str) compares as given
        return a == b


def compute_score(solution_str: str, ground_truth: str) -> float:
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    try:
        answer = remove_boxed(boxed)
    except ValueError:
        return 0.0
    return 1.0 if is_equiv(answer, ground_truth) else 0.0
