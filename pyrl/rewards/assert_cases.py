"""Asserts judged in the parent, on values the program cannot forge: a program scores a case only by computing
the right values. Exiting before the tests, returning objects whose __eq__ lies, patching the harness, builtins
or stdout, printing a forged result line or reading the tests gains it nothing, and the expected values never
enter its process. (What cannot be made unforgeable is listed at the end.)

The two sides of that, which pyrl.rewards.code_exec runs for its assert, call-based and clean-run cases: the
harness put before the program in the sandbox (HARNESS, harnessed), which carries the leaves' values out on one
marked line; the strict decoding of that line in the parent (read_leaves, decode); and the parent's planning
(plan_snippet, with ast) and evaluation (holds) of an assert_case snippet on plain values, within bounds (LIMIT,
INT_BITS, MAX_UNROLL).

Rewards a policy cannot forge
-----------------------------
verl appends a test snippet to the program and calls a case passed when "the whole runs cleanly". Everything in
that process is the program's: it can exit before the tests run (sys.exit(0), os._exit, a signal to itself),
return objects whose __eq__ says True, patch builtins, json, print or sys.stdout, print what a passing run
prints, or read the tests from its own source (its code object holds it). So here the parent process (pyrl, never
the program's interpreter) decides pass / fail, from evidence the program cannot produce without computing the
right values, and the expected values never enter the program's process:

- assert cases: the parent parses each snippet (`ast`) and interprets the logic of every `assert` itself:
  comparisons, and / or / not, arithmetic, conditional expressions, literals and displays, subscripts, f-strings,
  comprehensions, and calls of a fixed set of pure builtins (abs, len, sorted, set, sum, min, max, all, any,
  round, str, int, float, isinstance, zip, ...; math.isclose, math.sqrt, ...; str / list / dict / set methods
  such as split, count, get, issubset) on plain values, always with their builtin meaning (a program defining
  its own `sorted` does not change what the test checks). What remains, the "leaves" (a call of the program's
  function, a name, an attribute: anything the parent cannot evaluate), is all that is sent: the sandbox runs
  the program, then the snippet's other statements as written (setup), and evaluates each leaf, in the order
  Python would, at the point where its assert stands. A harness defined before the program (its functions
  bound then, so later patching of builtins, json or sys does not reach them) serializes each leaf's value
  STRICTLY and writes them all on one marked line of stdout, then ends the process at once (os._exit(0): no
  atexit handler of the program runs after it). The parent reads that line, rebuilds plain values and
  evaluates the asserts. Literal operands (the expected values) never leave the parent; names assigned a
  literal at the snippet's top level and read only by asserts (`expected = [...]`) stay in the parent too.
  str / repr / len of a leaf, a subscript of it and the known methods (count, get, split, ...) are evaluated
  in the parent on the leaf's plain value (a list of objects whose __eq__ lies cannot inflate count(), a dict
  subclass cannot answer get() or [k]); only when the value is an object of the program's own class (an LRU
  cache's get) does the sandbox apply them, as it calls the program's functions, and never for a predicate
  whose argument would be the expected value (startswith, endswith, issubset, issuperset, isdisjoint).
- strict serialization: only None, bool, int, float, str, bytes, list, tuple, dict, set and frozenset are
  serialized, nested at most MAX_DEPTH deep and MARKER_MAX_CHARS long in all; anything else (a class of the
  program's, a generator, a Fraction) is "unserializable" and the assert it is part of fails. A subclass of
  one of these types (a namedtuple, a Counter, an IntEnum, a str subclass whose __eq__ always says True) is
  read through the builtin type's own C methods (int.__index__, str.__str__, list.__iter__, dict.items, ...),
  which a subclass cannot override: what reaches the parent is the data the object holds, never what its
  methods claim, so objects that misbehave when compared compare as the plain data they hold. This is looser
  than rejecting subclasses (which would fail honest programs returning a namedtuple or a defaultdict) and as
  safe: the parent compares only values it built itself, never calling into an object the program made.
- cases with no expected output and no assert ("clean run"): they pass when the marked line appears, which the
  harness writes only after the program and the snippet ran to their end; a program that exits early (any way,
  with any status) never has it written. See the limits below.
- a program that exits early, is killed, or prints a marked line of its own without the right values scores 0
  on the case: the parent reads the values from the line (the last one carrying the case's nonce, a random token
  made per case) and judges them itself.
- hostile output: the marked line is parsed with bounded depth (json's own recursion limit, then MAX_DEPTH),
  must be ASCII (the harness escapes everything; invalid UTF-8 decodes to U+FFFD and is refused), must carry
  exactly one entry per leaf in the harness's tagged form, no bare NaN / Infinity, no int beyond Python's
  4300-digit limit; the parent's evaluation of the asserts on those values is bounded (a repetition, a power,
  a shift or a range past LIMIT items / INT_BITS bits is refused). An unreadable marked line (Hostile) or a
  limit hit while evaluating (EvalLimit) is what pyrl.rewards.code_exec counts as a hostile output: the case
  scores 0, and nothing raises.

What the parent cannot make unforgeable, honestly:
- a clean-run case's evidence is a line the harness writes, and everything in the program's process, the
  harness's source and its nonce included, is readable by the program: a program that finds the nonce (in its
  code object's constants) or calls the harness's functions (they are in its globals) can write the line and
  exit. It gains nothing by it: a clean-run case checks only that nothing raised, which any program passes
  honestly by doing nothing (`def add(*a): pass`).
- what the snippet itself runs in the sandbox is the program's to see and to subvert: setup statements, helper
  functions the snippet defines and the leaves that call them (`assert is_sorted(f(x))`, `assert f(x) ==
  reference(x)`): their literals are visible and their verdict is computed in the program's process. Only what
  the parent evaluates is protected; write the checks as asserts on the program's values.
- a leaf's arguments (the inputs) are sent, as they must be; so is a literal inside a sub-expression the parent
  does not evaluate (`assert f(x) == helper(3)`, a method it does not know).
- Python semantics the parent cannot reproduce: every leaf of an assert is evaluated (so `f() or g()` calls g
  even when f's value is true), before the parent evaluates the assert; `is` compares the parent's rebuilt
  values; builtin names keep their builtin meaning; a name the snippet assigns a literal and only its asserts
  read is never assigned in the sandbox (a program function reading a global of that name sees the program's
  own; sending it whenever the program mentions the name would let a program named `expected` fetch it); an
  int past 4300 digits, a Fraction, a Decimal, a complex or an object of a program's own class is no value the
  parent compares (of the last, only its str / repr / len, subscripts and known methods are). An assert the
  parent cannot check soundly (an assert inside a function, loop or `if` it cannot unroll; a leaf that itself
  compares, e.g. `assert [f(i) == i for i in g()]`) is a ValueError for the whole sample (counted by the
  manager as a scorer error), never a silent pass.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
import math
import operator
from dataclasses import dataclass

MARKER = "\x1epyrl-leaves "  # starts the harness's line (after a newline), followed by the case's nonce
MAX_DEPTH = 100  # nesting of a leaf's value
MARKER_MAX_CHARS = 1 << 20  # the serialized leaves of one case
LIMIT = 2_000_000  # items / characters of a value the parent builds while evaluating an assert
INT_BITS = 1 << 20  # bits of an int the parent builds while evaluating an assert
MAX_UNROLL = 1000  # iterations the parent unrolls (comprehensions and for loops over literals)


# ---- the sandbox's side: the harness, and the line it writes ----
# The sandbox side, put before the program: every function and type the harness uses is bound here, before the
# program can patch anything. The parent does not trust it (the program shares its process): it only carries the
# leaves' values out. Entries: [0, value] (value in the tagged form below), [1] (the leaf raised), [2] (not
# serializable), [3, value] (not serializable, but what the parent asked for of it, its str / repr / len, a
# subscript, a method's result, is).
# Tags: a list is a JSON array; {"t": [...]} tuple, {"s": [...]} set, {"f": [...]} frozenset, {"d": [[key, value],
# ...]} dict, {"b": "hex"} bytes, {"x": "nan" | "inf" | "-inf"} a float JSON cannot hold.
HARNESS = '''\
def _pyrl_harness(prefix, max_chars, max_depth):
    import json, json.encoder, math, os, sys
    esc, loads = json.encoder.encode_basestring_ascii, json.loads
    type_, issub, len_, getattr_, int_ = type, issubclass, len, getattr, int
    error, none = Exception, None
    bool_, str_, bytes_, list_, tuple_, dict_, set_, frozenset_ = bool, str, bytes, list, tuple, dict, set, frozenset
    float_ = float
    int_repr, int_copy, float_repr, float_copy, str_copy = int.__repr__, int.__index__, float.__repr__, \\
        float.__float__, str.__str__
    list_iter, tuple_iter, set_iter, frozenset_iter = list.__iter__, tuple.__iter__, set.__iter__, \\
        frozenset.__iter__
    dict_items, bytes_hex, isfinite, join, encode, split = dict.items, bytes.hex, math.isfinite, str.join, \\
        str.encode, str.split
    write, exit_, modules = os.write, os._exit, sys.modules
    builtin_types = (int_, float_, str_, bytes_, list_, tuple_, dict_, set_, frozenset_)
    entries, used = [], [0]

    class Unserializable(Exception):
        pass

    def put(out, piece):
        used[0] += len_(piece)
        if used[0] > max_chars:
            raise Unserializable
        out.append(piece)

    def sequence(items, opening, closing, depth, out):
        put(out, opening)
        first = True
        for item in items:
            if not first:
                put(out, ",")
            first = False
            encode_value(item, depth + 1, out)
        put(out, closing)

    def encode_value(x, depth, out):
        if depth > max_depth:
            raise Unserializable
        t = type_(x)
        if x is none:
            put(out, "null")
        elif t is bool_:
            put(out, "true" if x else "false")
        elif issub(t, int_):
            put(out, int_repr(int_copy(x)))
        elif issub(t, float_):
            v = float_copy(x)
            put(out, float_repr(v) if isfinite(v) else
                '{"x":"' + ("nan" if v != v else "inf" if v > 0 else "-inf") + '"}')
        elif issub(t, str_):
            s = str_copy(x)
            if len_(s) > max_chars:
                raise Unserializable
            put(out, esc(s))
        elif issub(t, bytes_):
            put(out, '{"b":"' + bytes_hex(x) + '"}')
        elif issub(t, list_):
            sequence(list_iter(x), "[", "]", depth, out)
        elif issub(t, tuple_):
            sequence(tuple_iter(x), '{"t":[', "]}", depth, out)
        elif issub(t, frozenset_):
            sequence(frozenset_iter(x), '{"f":[', "]}", depth, out)
        elif issub(t, set_):
            sequence(set_iter(x), '{"s":[', "]}", depth, out)
        elif issub(t, dict_):
            put(out, '{"d":[')
            first = True
            for key, value in dict_items(x):
                put(out, "[" if first else ",[")
                first = False
                encode_value(key, depth + 1, out)
                put(out, ",")
                encode_value(value, depth + 1, out)
                put(out, "]")
            put(out, "]}")
        else:
            raise Unserializable

    def serialized(value, tag):
        mark, out = used[0], []
        try:  # the entry's brackets, tag and the comma joining it to the next count too: the line stays in bounds
            put(out, "[" + tag + ",")
            encode_value(value, 0, out)
            put(out, "],")
        except error:  # not serializable, too deep or too long, an int past the digit limit, out of memory
            used[0] = mark
            return None
        out[-1] = "]"
        return join("", out)

    def small(entry):  # "[1]" / "[2]": counted, never refused (the parent allows 4 characters a leaf beyond)
        used[0] += 4
        entries.append(entry)

    def leaf(thunk, fallback=None, any_value=False):
        try:
            value = thunk()
        except error:
            small("[1]")
            return
        entry = serialized(value, "0")
        # a value the parent cannot have: what the parent does with it (str(x), x.get(k), x[i]) done here instead,
        # for an object of the program's own class (any value for str / repr / len, which compare nothing)
        if entry is None and fallback is not None and (any_value or not issub(type_(value), builtin_types)):
            try:
                entry = serialized(fallback(value), "3")
            except error:
                entry = None
        if entry is None:
            small("[2]")
        else:
            entries.append(entry)

    def done():
        try:
            modules["sys"].stdout.flush()  # the program's own output first
        except BaseException:
            pass
        data = encode("\\n" + prefix + "[" + join(",", entries) + "]\\n", "ascii")
        while data:
            data = data[write(1, data):]
        exit_(0)

    def call(inputs, name, method, scope):  # prime_code's call of a call-based case's function
        args = [loads(line) for line in split(inputs, "\\n")]
        if args and type_(args[0]) is dict_:  # a dict argument's keys become ints (and only it is passed)
            try:
                args = [{int_(k): v for k, v in dict_items(args[0])}]
            except ValueError:
                pass
        target = getattr_(scope["Solution"](), name) if method else scope[name]
        return target(*args)

    return leaf, done, call


_pyrl_leaf, _pyrl_done, _pyrl_call = _pyrl_harness(PYRL_PREFIX, PYRL_MAX_CHARS, PYRL_MAX_DEPTH)
del _pyrl_harness
'''


def harnessed(program: str, tail: str, nonce: str) -> str:
    """The text the sandbox runs: the harness (bound before the program), the program, the tail that evaluates
    the leaves (a Plan's), and the harness's line, marked with the case's nonce."""
    harness = HARNESS.replace("PYRL_PREFIX", repr(MARKER + nonce + " ")).replace(
        "PYRL_MAX_CHARS", str(MARKER_MAX_CHARS)).replace("PYRL_MAX_DEPTH", str(MAX_DEPTH))
    return harness + program + "\n\n" + tail + "\n_pyrl_done()\n"


# ---- the parent reads the line strictly ----
class Hostile(Exception):
    """Output the parent refuses to interpret: the case scores 0 and is counted."""


def read_leaves(stdout: str, nonce: str, count: int) -> tuple[list | None, str]:
    """The leaves' values from the harness's line (the last one with this case's nonce) and the output before
    it; (None, stdout) when there is no such line. Raises Hostile for a line the harness cannot have written."""
    prefix = "\n" + MARKER + nonce + " "
    at = stdout.rfind(prefix)
    if at < 0:
        return None, stdout
    line = stdout[at + len(prefix):].split("\n", 1)[0]
    if not line.isascii():
        raise Hostile("a marked line that is not ASCII")
    if len(line) > MARKER_MAX_CHARS + 4 * count + 64:  # the harness's bound, its error entries and brackets
        raise Hostile(f"a marked line of {len(line)} characters")
    try:
        entries = json.loads(line, parse_constant=_bare_constant)
    except (ValueError, RecursionError) as e:  # not JSON, NaN / Infinity, an int past the digit limit, too deep
        raise Hostile(f"a marked line that does not parse: {type(e).__name__}: {e}"[:300]) from None
    if type(entries) is not list or len(entries) != count:
        raise Hostile(f"a marked line with {len(entries) if type(entries) is list else 'no'} entries, not {count}")
    values = []
    for entry in entries:
        if type(entry) is list and len(entry) == 2 and entry[0] in (0, 3) and type(entry[0]) is int:
            values.append(("ok" if entry[0] == 0 else "converted", decode(entry[1], 0)))
        elif type(entry) is list and len(entry) == 1 and entry[0] in (1, 2) and type(entry[0]) is int:
            values.append(("raised" if entry[0] == 1 else "not serializable", None))
        else:
            raise Hostile("a marked line whose entries are not the harness's")
    return values, stdout[:at]


def _bare_constant(name):
    raise ValueError(f"bare {name}")


def decode(value, depth: int):
    """A leaf's tagged JSON (see HARNESS) -> the plain value it stands for, built here of exact builtin types."""
    if depth > MAX_DEPTH:
        raise Hostile(f"a value nested more than {MAX_DEPTH} deep")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [decode(v, depth + 1) for v in value]
    if kind is dict and len(value) == 1:
        (tag, body), = value.items()
        try:
            if tag in ("t", "s", "f") and type(body) is list:
                items = [decode(v, depth + 1) for v in body]
                return tuple(items) if tag == "t" else set(items) if tag == "s" else frozenset(items)
            if tag == "d" and type(body) is list:
                pairs = {}
                for pair in body:
                    if type(pair) is not list or len(pair) != 2:
                        raise Hostile("a dict entry that is not a [key, value] pair")
                    pairs[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
                return pairs
            if tag == "b" and type(body) is str:
                return bytes.fromhex(body)
            if tag == "x" and body in ("nan", "inf", "-inf"):
                return float(body)
        except TypeError as e:  # an unhashable set element or dict key
            raise Hostile(f"a value the harness cannot have written: {e}") from None
        except ValueError as e:
            raise Hostile(f"bytes that are not hex: {e}") from None
    raise Hostile(f"a value the harness cannot have written ({kind.__name__})")


# ---- the parent's side of an assert: planning (ast) and evaluation on plain values ----
@dataclass(frozen=True)
class Plan:
    """How one case is run and judged. tail: the statements after the program (None: a stdin/stdout case, the
    program alone); checks: the asserts, as the parent evaluates them; leaves: how many values the harness's
    line must carry; call: the one leaf is a call-based case's returned value."""

    tail: str | None
    checks: tuple = ()
    leaves: int = 0
    call: bool = False


class Unverifiable(ValueError):
    """A snippet the parent cannot check soundly: raised for the sample (a scorer error), never a silent pass."""


class EvalLimit(Exception):
    """A value the parent will not build (past LIMIT items or INT_BITS bits): a hostile output."""


class LeafFailed(Exception):
    """The assert needs a leaf whose evaluation raised or whose value was not serializable: it fails."""


class Leaves:
    """The leaves' values: (status, value), status "ok", "converted" (the value of str / repr / len applied to
    it in the sandbox, for an object the harness cannot serialize), "raised" or "not serializable"."""

    def __init__(self, values: list):
        self.values = values

    def get(self, index: int):
        status, value = self.values[index]
        if status != "ok":
            raise LeafFailed(status)
        return value

    def converted(self, index: int):
        status, value = self.values[index]
        if status != "converted":
            raise LeafFailed(status)
        return value


def holds(check, leaves: Leaves) -> bool:
    """Whether one assert holds on the leaves' values: False when Python's assert would raise (AssertionError or
    any other exception); EvalLimit, RecursionError and MemoryError propagate (hostile)."""
    try:
        return bool(check.ev(leaves, {}))
    except (EvalLimit, RecursionError, MemoryError):
        raise
    except Exception:  # noqa: BLE001 - a failing assert: a wrong value, a TypeError, a leaf that raised
        return False


# -- guarded builtins the parent evaluates --
def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset, range)) else 0


def _int_bits(*values) -> None:
    for v in values:
        if isinstance(v, int) and v.bit_length() > INT_BITS:
            raise EvalLimit(f"an int past {INT_BITS} bits")


def _mul(a, b):
    for seq, n in ((a, b), (b, a)):
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > LIMIT:
            raise EvalLimit(f"a repetition past {LIMIT} items")
    if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > INT_BITS:
        raise EvalLimit(f"a product past {INT_BITS} bits")
    return a * b


def _pow(a, b, mod=None):
    if mod is None and isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 \
            and (abs(a).bit_length() - 1) * b > INT_BITS:
        raise EvalLimit(f"a power past {INT_BITS} bits")
    return pow(a, b) if mod is None else pow(a, b, mod)


def _lshift(a, b):
    if isinstance(a, int) and isinstance(b, int) and a and b > 0 and a.bit_length() + b > INT_BITS:
        raise EvalLimit(f"a shift past {INT_BITS} bits")
    return a << b


def _mod(a, b):
    if isinstance(a, (str, bytes)):
        raise TypeError("printf-style formatting is not evaluated by the parent")
    return a % b


def _range(*args):
    r = range(*args)
    if len(r) > LIMIT:
        raise EvalLimit(f"a range past {LIMIT} items")
    return r


def _round(x, ndigits=None):
    if ndigits is None:
        return round(x)
    if isinstance(x, int) and isinstance(ndigits, int) and abs(ndigits) > 10_000:
        raise EvalLimit("round to more than 10000 digits")
    return round(x, ndigits)


def _sum(iterable, start=0):
    items = list(iterable)
    if not all(isinstance(v, (int, float, complex)) for v in [start, *items]):
        raise TypeError("the parent sums numbers only")
    return sum(items, start)


def _type(x):
    """type() of one argument only: type(name, bases, dict) would build a class."""
    return type(x)


def _width(width):
    if isinstance(width, int) and width > LIMIT:
        raise EvalLimit(f"a string past {LIMIT} characters")


def _str_replace(s, old, new, count=-1):
    if isinstance(s, (str, bytes)) and isinstance(old, type(s)) and isinstance(new, type(s)):
        times = s.count(old) if count < 0 else min(count, s.count(old))
        if len(s) + times * len(new) > LIMIT:
            raise EvalLimit(f"a string past {LIMIT} characters")
    return s.replace(old, new, count)


def _str_join(separator, iterable):
    parts = list(iterable) if isinstance(separator, (str, bytes)) else None
    if parts is not None and all(isinstance(p, (str, bytes)) for p in parts) and \
            sum(map(len, parts)) + len(separator) * max(0, len(parts) - 1) > LIMIT:
        raise EvalLimit(f"a string past {LIMIT} characters")
    return separator.join(parts if parts is not None else iterable)


def _padded(name):
    def pad(s, width, *rest):
        _width(width)
        return getattr(s, name)(width, *rest)
    return pad


def _to_bytes(n, length=1, byteorder="big", **kw):
    _width(length)
    return n.to_bytes(length, byteorder, **kw)


SAFE_FUNCTIONS = {
    "abs": abs, "all": all, "any": any, "bin": bin, "bool": bool, "chr": chr, "dict": dict, "divmod": divmod,
    "enumerate": enumerate, "filter": filter, "float": float, "frozenset": frozenset, "hex": hex, "int": int,
    "isinstance": isinstance, "len": len, "list": list, "map": map, "max": max, "min": min, "oct": oct, "ord": ord,
    "pow": _pow, "range": _range, "repr": repr, "reversed": reversed, "round": _round, "set": set, "sorted": sorted,
    "str": str, "sum": _sum, "tuple": tuple, "type": _type, "zip": zip,
}
SAFE_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "bytes": bytes, "list": list, "tuple": tuple,
              "dict": dict, "set": set, "frozenset": frozenset}  # as values: isinstance(x, list), type(x) == int
MATH_FUNCTIONS = {name: getattr(math, name) for name in (
    "isclose", "sqrt", "isqrt", "floor", "ceil", "fabs", "isnan", "isinf", "isfinite", "log", "log2", "log10",
    "exp", "trunc", "gcd", "hypot", "sin", "cos", "tan", "atan", "atan2", "degrees", "radians", "copysign")}
MATH_CONSTANTS = {name: getattr(math, name) for name in ("pi", "e", "tau", "inf", "nan")}
MATH_NAMES = frozenset(MATH_FUNCTIONS) | frozenset(MATH_CONSTANTS)
# bare names meaning math's (prime_code's header imports them; a snippet's `from math import ...` too)
BARE_MATH = ("isclose", "sqrt", "floor", "ceil", "fabs", "isnan", "isinf", "isfinite", "pi", "inf", "nan")
_STR_METHODS = {"lower", "upper", "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "join", "startswith",
                "endswith", "count", "find", "rfind", "index", "rindex", "isdigit", "isalpha", "isalnum", "isspace",
                "islower", "isupper", "isnumeric", "isdecimal", "istitle", "title", "capitalize", "casefold",
                "swapcase", "partition", "rpartition", "replace", "zfill", "center", "ljust", "rjust"}
METHODS = {
    str: _STR_METHODS | {"encode"},
    bytes: (_STR_METHODS - {"casefold", "isnumeric", "isdecimal"}) | {"decode", "hex"},
    list: {"count", "index"}, tuple: {"count", "index"},
    dict: {"get", "keys", "values", "items"},
    set: {"issubset", "issuperset", "union", "intersection", "difference", "symmetric_difference", "isdisjoint"},
    int: {"bit_length", "to_bytes"}, float: {"is_integer", "hex"},
}
METHODS[frozenset] = METHODS[set]
CONVERSIONS = {str: "str", repr: "repr", len: "len"}  # applied in the sandbox to a value it cannot serialize
# methods whose argument is typically the expected value: never sent with it (only evaluated here)
VERDICT_METHODS = frozenset({"startswith", "endswith", "issubset", "issuperset", "isdisjoint"})
METHOD_NAMES = frozenset().union(*METHODS.values())
GUARDED_METHODS = {"replace": _str_replace, "join": _str_join, "zfill": _padded("zfill"), "center": _padded("center"),
                   "ljust": _padded("ljust"), "rjust": _padded("rjust"), "to_bytes": _to_bytes}

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: _mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: _mod, ast.Pow: _pow, ast.LShift: _lshift,
          ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.BitAnd: operator.and_}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Invert: operator.invert, ast.Not: operator.not_}
COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
# inside a leaf these would compute a verdict on the program's objects, in the program's process
VERDICT_NODES = (ast.Compare, ast.BoolOp, ast.IfExp, ast.Assert, ast.NamedExpr)


def _checked(value):
    """A value the parent built, within its limits."""
    if _size(value) > LIMIT:
        raise EvalLimit(f"a value past {LIMIT} items")
    if isinstance(value, int) and not isinstance(value, bool):
        _int_bits(value)
    return value


def _spread(items, leaves, scope) -> list:
    """(starred, node) pairs (a display's items, a call's arguments) evaluated in order, a starred one's items
    spread in."""
    out = []
    for starred, node in items:
        if starred:
            out.extend(node.ev(leaves, scope))
            _checked(out)
        else:
            out.append(node.ev(leaves, scope))
    return out


def _element(kind: str, element, leaves, scope):
    """A comprehension's element: a node, or for a dict a (key, value) pair of nodes."""
    if kind == "dict":
        return element[0].ev(leaves, scope), element[1].ev(leaves, scope)
    return element.ev(leaves, scope)


def _collected(kind: str, out: list):
    """A comprehension's elements as its kind (list, set, dict, generator) holds them."""
    if kind == "dict":
        return _checked(dict(out))
    return _checked(set(out)) if kind == "set" else iter(out) if kind == "generator" else out


# -- plan nodes: each evaluates on the leaves' values (ev) --
@dataclass(frozen=True)
class Const:
    value: object

    def ev(self, leaves, scope):
        return self.value


@dataclass(frozen=True)
class Leaf:
    index: int

    def ev(self, leaves, scope):
        return leaves.get(self.index)


@dataclass(frozen=True)
class Var:
    name: str

    def ev(self, leaves, scope):
        return scope[self.name]


@dataclass(frozen=True)
class Display:
    kind: type  # list, tuple, set
    items: tuple  # (starred, node)

    def ev(self, leaves, scope):
        return _checked(self.kind(_spread(self.items, leaves, scope)))


@dataclass(frozen=True)
class DictDisplay:
    items: tuple  # (key node or None for **, value node)

    def ev(self, leaves, scope):
        out = {}
        for key, value in self.items:
            if key is None:
                out.update(value.ev(leaves, scope))
            else:
                k = key.ev(leaves, scope)
                out[k] = value.ev(leaves, scope)
        return _checked(out)


@dataclass(frozen=True)
class Compare:
    left: object
    ops: tuple  # (function, node)

    def ev(self, leaves, scope):
        left = self.left.ev(leaves, scope)
        for op, node in self.ops:
            right = node.ev(leaves, scope)
            if not op(left, right):
                return False
            left = right
        return True


@dataclass(frozen=True)
class BoolNode:
    is_and: bool
    values: tuple

    def ev(self, leaves, scope):
        value = None
        for node in self.values:
            value = node.ev(leaves, scope)
            if bool(value) != self.is_and:
                return value
        return value


@dataclass(frozen=True)
class Apply:
    """A builtin (guarded) function or operator applied to evaluated arguments."""
    fn: object
    args: tuple  # (starred, node)
    kwargs: tuple = ()  # (name, node)

    def ev(self, leaves, scope):
        args = _spread(self.args, leaves, scope)
        kwargs = {name: node.ev(leaves, scope) for name, node in self.kwargs}
        return _checked(self.fn(*args, **kwargs))


@dataclass(frozen=True)
class Fallback:
    """str / repr / len of a leaf, a subscript or a known method of it: evaluated here on the leaf's value, or,
    when the value was an object the harness could not serialize (one of the program's own classes), the result
    the sandbox computed for it."""
    leaf: Leaf
    inner: object  # the node evaluated here, reading the leaf

    def ev(self, leaves, scope):
        status, _ = leaves.values[self.leaf.index]
        if status == "converted":
            return _checked(leaves.converted(self.leaf.index))
        return self.inner.ev(leaves, scope)


@dataclass(frozen=True)
class Method:
    receiver: object
    name: str
    args: tuple  # (starred, node)
    kwargs: tuple = ()

    def ev(self, leaves, scope):
        receiver = self.receiver.ev(leaves, scope)
        if self.name not in METHODS.get(type(receiver), ()):
            raise TypeError(f"{type(receiver).__name__}.{self.name} is not evaluated by the parent")
        fn = GUARDED_METHODS.get(self.name)
        bound = functools.partial(fn, receiver) if fn else getattr(receiver, self.name)
        return Apply(bound, self.args, self.kwargs).ev(leaves, scope)


@dataclass(frozen=True)
class IfNode:
    test: object
    body: object
    orelse: object

    def ev(self, leaves, scope):
        return self.body.ev(leaves, scope) if self.test.ev(leaves, scope) else self.orelse.ev(leaves, scope)


@dataclass(frozen=True)
class SliceNode:
    lower: object
    upper: object
    step: object

    def ev(self, leaves, scope):
        return slice(*(None if n is None else n.ev(leaves, scope) for n in (self.lower, self.upper, self.step)))


@dataclass(frozen=True)
class FString:
    parts: tuple  # str, or (node, conversion, format spec node or None)

    def ev(self, leaves, scope):
        out = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
                continue
            node, conversion, spec = part
            value = node.ev(leaves, scope)
            value = {115: str, 114: repr, 97: ascii}.get(conversion, lambda v: v)(value)
            spec = "" if spec is None else spec.ev(leaves, scope)
            if any(int(d) > 10_000 for d in "".join(c if c.isdigit() else " " for c in spec).split()):
                raise EvalLimit("a format width past 10000")
            out.append(format(value, spec))
            _width(sum(map(len, out)))
        return "".join(out)


@dataclass(frozen=True)
class Comprehension:
    """Evaluated here, iteration by iteration (the parts have no leaves but the first iterable's)."""
    kind: str  # list, set, dict, generator
    generators: tuple  # (target, iterable node, condition nodes)
    element: object  # a node, or (key node, value node) for dict

    def ev(self, leaves, scope):
        out, steps = [], [0]
        self.loop(0, dict(scope), leaves, out, steps)
        return _collected(self.kind, out)

    def loop(self, k, scope, leaves, out, steps):
        if k == len(self.generators):
            out.append(_element(self.kind, self.element, leaves, scope))
            return
        target, iterable, conditions = self.generators[k]
        for value in iterable.ev(leaves, scope):
            steps[0] += 1
            if steps[0] > LIMIT:
                raise EvalLimit(f"a comprehension past {LIMIT} steps")
            bind(target, value, scope)
            if all(c.ev(leaves, scope) for c in conditions):
                self.loop(k + 1, scope, leaves, out, steps)


@dataclass(frozen=True)
class Unrolled:
    """A comprehension unrolled when the plan was made (its iterables are literals): per iteration, the
    conditions (those that need leaves) and the element."""
    kind: str
    items: tuple  # (condition nodes, element node or (key, value))

    def ev(self, leaves, scope):
        out = [_element(self.kind, element, leaves, scope) for conditions, element in self.items
               if all(c.ev(leaves, scope) for c in conditions)]
        return _collected(self.kind, out)


def bind(target, value, scope: dict) -> None:
    """Assign value to a comprehension / for target (a name, or a tuple of targets), as Python unpacks."""
    if isinstance(target, str):
        scope[target] = value
        return
    values = list(value) if _size(value) <= LIMIT else None
    if values is None or len(values) != len(target):
        raise ValueError(f"cannot unpack {len(values) if values is not None else 'so many'} values into "
                         f"{len(target)}")
    for t, v in zip(target, values):
        bind(t, v, scope)


def target_names(node) -> object:
    """A for / comprehension target as a name or nested tuple of names; Unverifiable otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(target_names(e) for e in node.elts)
    raise Unverifiable(f"a loop target the parent does not bind: {ast.unparse(node)}")


def flat_names(target) -> list[str]:
    return [target] if isinstance(target, str) else [n for t in target for n in flat_names(t)]


def literal_source(value) -> str:
    """Python source that evaluates to `value` (a loop variable's value substituted into a leaf)."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float({str(value)!r})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(literal_source(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{literal_source(k)}: {literal_source(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (set, frozenset)):
        inner = "{" + ", ".join(literal_source(v) for v in value) + "}" if value else "()"
        return f"{type(value).__name__}({inner})"
    if isinstance(value, range):
        return repr(value)
    raise Unverifiable(f"a loop value the parent cannot write as a literal: {type(value).__name__}")


class NeedsVar(Exception):
    """A leaf would read a variable the parent binds at evaluation (a comprehension's): not sendable."""


class NotPure(Exception):
    """An expression that needs leaves (or fails): it cannot be evaluated when the plan is made."""


class Planner:
    """One pass over a snippet: the sandbox's tail, the checks, and the parent-only names that a leaf or a setup
    statement turned out to read (the snippet is planned again without them)."""

    def __init__(self, tree: ast.Module, bound: frozenset, once: frozenset, excluded: frozenset):
        self.tree, self.bound, self.once, self.excluded = tree, bound, once, excluded
        self.from_math = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                          and node.module == "math" for alias in node.names if alias.name in MATH_NAMES}
        self.env: dict = {}  # parent-only names -> values
        self.leaves: list[tuple] = []  # (leaf source, fallback source or None, for any value), in evaluation order
        self.needed: set[str] = set()  # parent-only names read in the sandbox
        self.lines: list[str] = []
        self.checks: list = []

    def checkpoint(self) -> tuple[int, set]:
        """Where rollback() returns to: how many leaves, and which needed names, so far."""
        return len(self.leaves), set(self.needed)

    def rollback(self, point: tuple[int, set]) -> None:
        """Forget the leaves and needed names an abandoned interpretation added since checkpoint()."""
        mark, needed = point
        del self.leaves[mark:]
        self.needed = needed

    # -- statements --
    def run(self) -> Plan:
        for stmt in self.tree.body:
            self.statement(stmt, {})
        return Plan(tail="\n".join(self.lines), checks=tuple(self.checks), leaves=len(self.leaves))

    def statement(self, stmt, consts: dict) -> None:
        if isinstance(stmt, ast.Assert):
            start = len(self.leaves)
            self.checks.append(self.expr(stmt.test, consts, frozenset()))
            self.lines += [f"_pyrl_leaf(lambda: ({source}))" if fallback is None else
                           f"_pyrl_leaf(lambda: ({source}), lambda _pyrl_v: ({fallback}), {any_value})"
                           for source, fallback, any_value in self.leaves[start:]]
            return
        if isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
            return
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id in self.once and stmt.targets[0].id not in self.excluded and not consts):
            try:
                self.env[stmt.targets[0].id] = self.pure(stmt.value, consts)
                return
            except NotPure:
                pass
        if isinstance(stmt, ast.For) and contains_check(stmt):
            self.unroll_for(stmt, consts)
            return
        if isinstance(stmt, ast.If) and is_main_guard(stmt.test) and not stmt.orelse:
            for inner in stmt.body:
                self.statement(inner, consts)
            return
        if contains_check(stmt):
            raise Unverifiable(f"an assert the parent cannot check (inside {type(stmt).__name__.lower()}, line "
                               f"{stmt.lineno}); write the snippet's asserts at its top level")
        if consts:  # setup inside an unrolled loop: its loop variables written as literals
            stmt = substitute(stmt, consts)
        self.needed |= {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id in self.env}
        self.lines.append(ast.unparse(stmt))

    def unroll_for(self, stmt: ast.For, consts: dict) -> None:
        if stmt.orelse:
            raise Unverifiable(f"an assert inside a for/else (line {stmt.lineno}) the parent cannot unroll")
        target = target_names(stmt.target)
        try:
            values = list(self.pure(stmt.iter, consts))
        except (NotPure, TypeError):
            raise Unverifiable(f"an assert inside a for loop over something that is not a literal (line "
                               f"{stmt.lineno}): the parent cannot unroll it") from None
        if len(values) > MAX_UNROLL:
            raise Unverifiable(f"a for loop of {len(values)} iterations around asserts (at most {MAX_UNROLL})")
        for value in values:
            scope = dict(consts)
            try:
                bind(target, value, scope)
            except ValueError as e:
                raise Unverifiable(f"line {stmt.lineno}: {e}") from None
            for inner in stmt.body:
                self.statement(inner, scope)

    # -- expressions --
    def pure(self, node, consts: dict):
        """node's value, evaluated now (literals and parent-only names only)."""
        point = self.checkpoint()
        try:
            tree = self.expr(node, consts, frozenset())
            if len(self.leaves) > point[0]:
                raise NotPure
            return tree.ev(Leaves([]), {})
        except Exception as e:  # noqa: BLE001 - a leaf, a comprehension variable, a limit, any error: not now
            self.rollback(point)
            raise NotPure from e

    def leaf(self, node, consts: dict, variables: frozenset) -> Leaf:
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if names & variables:
            raise NeedsVar
        for inner in ast.walk(node):
            if isinstance(inner, VERDICT_NODES) or (isinstance(inner, ast.UnaryOp) and isinstance(inner.op, ast.Not)) \
                    or (isinstance(inner, ast.comprehension) and inner.ifs):
                raise Unverifiable(f"a part of an assert the parent cannot evaluate computes a verdict in the "
                                   f"program's process: {ast.unparse(node)[:200]}")
            if isinstance(inner, (ast.Yield, ast.YieldFrom, ast.Await)):
                raise Unverifiable(f"yield / await in an assert: {ast.unparse(node)[:200]}")
        if consts:
            shadowed = {n.arg for n in ast.walk(node) if isinstance(n, ast.arg)} | {
                t.id for c in ast.walk(node) if isinstance(c, ast.comprehension)
                for t in ast.walk(c.target) if isinstance(t, ast.Name)}
            if shadowed & set(consts):
                raise Unverifiable(f"a leaf rebinds a loop variable: {ast.unparse(node)[:200]}")
            node = substitute(node, consts)
        self.needed |= names & set(self.env) - set(consts)
        self.leaves.append((ast.unparse(node), None, False))
        return Leaf(len(self.leaves) - 1)

    def fallback(self, leaf: Leaf, inner, source: str | None, any_value: bool = False) -> Fallback | object:
        """inner (reading leaf) evaluated here, or, for a value of the program's own class, `source` (an
        expression of _pyrl_v, the leaf's value) evaluated in the sandbox; no source: here only."""
        if source is None:
            return inner
        self.leaves[leaf.index] = (self.leaves[leaf.index][0], source, any_value)
        return Fallback(leaf, inner)

    def sendable(self, nodes, mark: int, consts: dict, variables: frozenset) -> str | None:
        """The source of nodes (an expression's parts) for the sandbox, when they needed no leaf and read no
        comprehension variable; else None."""
        names = {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}
        if len(self.leaves) > mark or names & variables:
            return None
        self.needed |= names & set(self.env) - set(consts)
        return ", ".join(ast.unparse(substitute(n, consts) if consts else n) for n in nodes)

    def expr(self, node, consts: dict, variables: frozenset):
        """The plan node for an expression: evaluated by the parent where it can be, else a leaf."""
        point = self.checkpoint()
        try:
            return self.interpret(node, consts, variables)
        except _AsLeaf:
            self.rollback(point)
            return self.leaf(node, consts, variables)

    def interpret(self, node, consts, variables):
        ex = functools.partial(self.expr, consts=consts, variables=variables)
        if isinstance(node, ast.Constant):
            return Const(node.value)
        if isinstance(node, ast.Name):
            return self.name(node.id, consts, variables)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            kind = {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)]
            return Display(kind, tuple(self.item(e, consts, variables) for e in node.elts))
        if isinstance(node, ast.Dict):
            return DictDisplay(tuple((None if k is None else ex(k), ex(v)) for k, v in zip(node.keys, node.values)))
        if isinstance(node, ast.Compare):
            left = ex(node.left)
            return Compare(left, tuple((COMPARE[type(op)], ex(c)) for op, c in zip(node.ops, node.comparators)))
        if isinstance(node, ast.BoolOp):
            return BoolNode(isinstance(node.op, ast.And), tuple(ex(v) for v in node.values))
        if isinstance(node, ast.UnaryOp):
            return Apply(UNARY[type(node.op)], ((False, ex(node.operand)),))
        if isinstance(node, ast.BinOp):
            if type(node.op) not in BINARY:
                raise _AsLeaf
            left = ex(node.left)
            return Apply(BINARY[type(node.op)], ((False, left), (False, ex(node.right))))
        if isinstance(node, ast.IfExp):
            test = ex(node.test)
            body = ex(node.body)
            return IfNode(test, body, ex(node.orelse))
        if isinstance(node, ast.Call):
            return self.call(node, consts, variables)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "math" and "math" not in self.bound \
                    and node.attr in MATH_CONSTANTS:
                return Const(MATH_CONSTANTS[node.attr])
            raise _AsLeaf
        if isinstance(node, ast.Subscript):
            value = ex(node.value)
            mark = len(self.leaves)
            index = ex(node.slice)
            inner = Apply(operator.getitem, ((False, value), (False, index)))
            if not isinstance(value, Leaf):
                return inner
            source = self.sendable([node.slice], mark, consts, variables)
            return self.fallback(value, inner, None if source is None else f"_pyrl_v[{source}]")
        if isinstance(node, ast.Slice):
            return SliceNode(*(None if n is None else ex(n) for n in (node.lower, node.upper, node.step)))
        if isinstance(node, ast.JoinedStr):
            return self.fstring(node, consts, variables)
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            return self.comprehension(node, consts, variables)
        raise _AsLeaf

    def item(self, node, consts, variables):
        if isinstance(node, ast.Starred):
            return True, self.expr(node.value, consts, variables)
        return False, self.expr(node, consts, variables)

    def name(self, name: str, consts: dict, variables: frozenset):
        if name in variables:
            return Var(name)
        if name in consts:
            return Const(consts[name])
        if name in self.env:
            return Const(self.env[name])
        if name not in self.bound:
            if name in SAFE_TYPES:
                return Const(SAFE_TYPES[name])
            if name in SAFE_FUNCTIONS:
                return Const(SAFE_FUNCTIONS[name])
            if name in BARE_MATH or name in self.from_math:
                return Const(MATH_FUNCTIONS.get(name, MATH_CONSTANTS.get(name)))
        raise _AsLeaf

    def call(self, node: ast.Call, consts, variables):
        if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Lambda) for a in node.args) \
                or any(isinstance(k.value, ast.Lambda) for k in node.keywords):
            raise _AsLeaf
        fn = self.builtin(node.func)
        if fn is not None:
            args, kwargs = self.arguments(node, consts, variables)
            call = Apply(fn, args, kwargs)
            if fn in CONVERSIONS and len(args) == 1 and not args[0][0] and not kwargs and isinstance(args[0][1], Leaf):
                return self.fallback(args[0][1], call, f"{CONVERSIONS[fn]}(_pyrl_v)", any_value=True)
            return call
        if isinstance(node.func, ast.Attribute) and node.func.attr in METHOD_NAMES:
            receiver = self.expr(node.func.value, consts, variables)
            if isinstance(receiver, Const) and node.func.attr not in METHODS.get(type(receiver.value), ()):
                raise _AsLeaf  # str.lower(x), a literal's method the parent does not know
            mark = len(self.leaves)
            args, kwargs = self.arguments(node, consts, variables)
            method = Method(receiver, node.func.attr, args, kwargs)
            if not isinstance(receiver, Leaf):
                return method
            # a method of a leaf's value: evaluated here on the plain value (a list of objects whose __eq__ lies
            # cannot inflate count(), a dict subclass cannot answer get()); for an object of the program's own
            # class, its method called in the sandbox, unless its argument is likely the expected value
            source = None if node.func.attr in VERDICT_METHODS else self.sendable(
                [*node.args, *node.keywords], mark, consts, variables)
            return self.fallback(receiver, method,
                                 None if source is None else f"_pyrl_v.{node.func.attr}({source})")
        raise _AsLeaf

    def arguments(self, node: ast.Call, consts, variables) -> tuple[tuple, tuple]:
        """A call's arguments as plan nodes: ((starred, node), ...) and ((name, node), ...)."""
        return (tuple(self.item(a, consts, variables) for a in node.args),
                tuple((k.arg, self.expr(k.value, consts, variables)) for k in node.keywords))

    def builtin(self, func):
        """The guarded builtin a call's function names, or None."""
        if isinstance(func, ast.Name) and func.id not in self.bound:
            if func.id in SAFE_FUNCTIONS:
                return SAFE_FUNCTIONS[func.id]
            if (func.id in BARE_MATH or func.id in self.from_math) and func.id in MATH_FUNCTIONS:
                return MATH_FUNCTIONS[func.id]
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math" \
                and "math" not in self.bound and func.attr in MATH_FUNCTIONS:
            return MATH_FUNCTIONS[func.attr]
        return None

    def fstring(self, node: ast.JoinedStr, consts, variables):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                spec = None if value.format_spec is None else self.fstring(value.format_spec, consts, variables)
                parts.append((self.expr(value.value, consts, variables), value.conversion, spec))
        return FString(tuple(parts))

    def comprehension(self, node, consts, variables):
        kind = {ast.ListComp: "list", ast.SetComp: "set", ast.GeneratorExp: "generator", ast.DictComp: "dict"}[
            type(node)]
        if any(g.is_async for g in node.generators):
            raise _AsLeaf
        try:
            targets = [target_names(g.target) for g in node.generators]
        except Unverifiable:
            raise _AsLeaf from None
        point = self.checkpoint()
        # evaluated here, iteration by iteration, when no leaf reads a comprehension variable
        try:
            inner = set(variables)
            generators = []
            for g, target in zip(node.generators, targets):
                iterable = self.expr(g.iter, consts, frozenset(inner))
                inner |= set(flat_names(target))
                generators.append((target, iterable, tuple(self.expr(c, consts, frozenset(inner)) for c in g.ifs)))
            return Comprehension(kind, tuple(generators), self.element(node, consts, frozenset(inner)))
        except NeedsVar:
            self.rollback(point)
        # else unrolled now, when every iterable is a literal: the loop variables are written into the leaves
        own = {name for target in targets for name in flat_names(target)}
        items: list = []
        try:
            self.unroll(node, 0, dict(consts), variables - own, targets, [], items)
        except NotPure:
            self.rollback(point)
            raise _AsLeaf from None
        return Unrolled(kind, tuple(items))

    def unroll(self, node, k, consts, variables, targets, conditions, items):
        if k == len(node.generators):
            items.append((tuple(conditions), self.element(node, consts, variables)))
            return
        g = node.generators[k]
        iterable = list(self.pure(g.iter, consts))
        if len(items) + len(iterable) > MAX_UNROLL:
            raise NotPure
        for value in iterable:
            scope = dict(consts)
            try:
                bind(targets[k], value, scope)
            except ValueError:
                raise NotPure from None
            kept = list(conditions)
            for c in g.ifs:
                try:
                    if not self.pure(c, scope):
                        break
                except NotPure:
                    kept.append(self.expr(c, scope, variables))
            else:
                self.unroll(node, k + 1, scope, variables, targets, kept, items)
            if len(items) > MAX_UNROLL:
                raise NotPure

    def element(self, node, consts, variables):
        if isinstance(node, ast.DictComp):
            key = self.expr(node.key, consts, variables)
            return key, self.expr(node.value, consts, variables)
        return self.expr(node.elt, consts, variables)


class _AsLeaf(Exception):
    """The node is not one the parent interprets: it becomes a leaf."""


class _Substitute(ast.NodeTransformer):
    def __init__(self, consts: dict):
        self.consts = consts

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id in self.consts:
            return ast.copy_location(ast.parse(literal_source(self.consts[node.id]), mode="eval").body, node)
        return node


def substitute(node, consts: dict):
    return ast.fix_missing_locations(_Substitute(consts).visit(copy.deepcopy(node)))


def contains_check(node) -> bool:
    """An assert, or a raise of AssertionError, anywhere inside."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Assert):
            return True
        if isinstance(inner, ast.Raise) and inner.exc is not None:
            exc = inner.exc.func if isinstance(inner.exc, ast.Call) else inner.exc
            if isinstance(exc, ast.Name) and exc.id == "AssertionError":
                return True
    return False


def is_main_guard(test) -> bool:
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__")


def bindings(tree) -> dict[str, int]:
    """How many times the snippet binds each name (assignments, defs, imports, loop targets, arguments, ...)."""
    found: dict[str, int] = {}

    def note(name):
        found[name] = found.get(name, 0) + 1

    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            note(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            note(node.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not (alias.name == "math" and alias.asname in (None, "math")):  # math keeps its meaning
                    note((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if not (node.module == "math" and alias.asname in (None, alias.name) and alias.name in MATH_NAMES):
                    note(alias.asname or alias.name)
        elif isinstance(node, ast.arg):
            note(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            note(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for name in node.names:
                note(name)
    return found


@functools.lru_cache(maxsize=4096)
def plan_snippet(snippet: str) -> Plan:
    """An assert_case snippet -> its Plan; ValueError (Unverifiable) for a snippet the parent cannot check."""
    try:
        tree = ast.parse(snippet)
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"ground_truth: an assert_case snippet is not valid Python ({e})") from None
    counted = bindings(tree)
    once = frozenset(name for name, n in counted.items() if n == 1)
    excluded: frozenset = frozenset()
    try:
        for _ in range(len(once) + 1):  # parent-only names read in the sandbox go back to the sandbox
            planner = Planner(tree, frozenset(counted), once, excluded)
            plan = planner.run()
            if not planner.needed:
                return plan
            excluded |= planner.needed
    except RecursionError:
        raise Unverifiable("an assert_case snippet nested too deeply for the parent") from None
    raise Unverifiable("an assert_case snippet whose names did not settle")  # not reached: `once` shrinks each pass
