"""Code-execution scoring: run a response's program on the problem's test cases and score the fraction passed.

verl 0.9.1's default_compute_score sends the data sources codecontests, apps, codeforces and taco to
`prime_code.compute_score(..., continuous=True)`, or, when reward.sandbox_fusion.url is set, to
`sandbox_fusion.compute_score(..., continuous=True)`. Both score continuously: the fraction of the first 10 test
cases passed (prime_code first checks every case at once and returns 1.0 if all pass, which is the same number).
pyrl keeps both paths and their rules, and runs only those first 10 cases:

- local (prime_code's rules, run in pyrl.sandbox instead of prime_code's in-process exec): the program is the
  text after the last ```python fence up to the next ``` (the whole response when there is none), with
  prime_code's header of standard-library imports in front; each case is its own sandboxed run with `timeout`
  seconds of wall-clock and CPU time and memory_limit_mb of memory. A stdin case passes when the program exits
  with code 0 and its output matches as prime_code compares (stripped text, or stripped text per line, or the
  non-blank lines, or the lines as numbers within rtol 1e-5 / atol 1e-8). A call-based case passes when the
  returned value, through JSON, equals the expected one or the expected list's first element.
- Sandbox Fusion (verl's sandbox_fusion module; the server is https://github.com/bytedance/SandboxFusion): the
  program is the first fenced block (no block: 0.0); each case is a POST of verl's payload to the url (its
  /run_code endpoint), retried on 504 as verl does, cases running concurrently under max_concurrent; a case
  passes when the server answers Success / Finished and stdout equals the expected output up to trailing newlines.
  Call-based cases use verl's wrapper (the result printed as JSON, or str() for numbers and strings).

ground_truth (a dict or its JSON text), verl's format:
- {"inputs": [...], "outputs": [...]}: stdin/stdout cases; an input or output given as a list of lines is joined
  with newlines;
- with "fn_name": call-based cases, each input the JSON arguments one per line and each output JSON; the function
  is a top-level one, or a method of class Solution;
- {"assert_case": [...]} (Sandbox Fusion's form, supported on both paths): each a snippet of tests run after the
  program (pyrl.rewards.assert_cases says how it is judged);
- an output of None (no assert): the case passes when the program (and the snippet) runs to its end.
verl scores a malformed ground truth 0; pyrl raises ValueError, which the reward manager counts as a scorer
error (score 0), or stops the run with reward.strict.

Locally the cases run one after another, as prime_code's do, each for up to `timeout` seconds: for code data
raise reward.timeout_s (pyrl's per-sample limit, 10 s), or a program that hangs on one case scores 0 as a scorer
timeout instead of the fraction of the others.

Rewards a policy cannot forge
-----------------------------
The parent process (pyrl, never the program's interpreter) decides pass / fail, and the expected values never
enter the program's process. Assert, call-based and clean-run cases run inside pyrl.rewards.assert_cases'
harness and are judged on the values it carries out (its docstring says how, and what cannot be made
unforgeable). Here:

- call-based cases: the call is the one leaf; the parent compares its value through JSON as prime_code does
  (tuples as lists, keys as strings), with the expected value kept in the parent as before.
- stdin/stdout cases: the expected output is compared in the parent, as before, and is never sent.
- the Sandbox Fusion path is the same for asserts and clean runs (the harness is plain Python sent with the
  program); its call-based cases keep verl's wrapper, which prints the result and is compared as text in the
  parent: the program cannot know the expected text, and an early exit prints nothing.
- hostile output: output past the cap (the sandbox cuts it and kills the program), a stdout that is not UTF-8,
  or what assert_cases refuses (an unreadable marked line, a limit hit while evaluating) scores 0 on the case;
  the count goes to pyrl.rewards.counts (the reward manager's metric reward/code_hostile_outputs, one warning
  logged per process), and nothing raises.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import secrets
import threading
import time
import urllib.error
import urllib.request

from pyrl.rewards import counts
from pyrl.rewards.assert_cases import (
    MARKER_MAX_CHARS,
    Hostile,
    Leaves,
    Plan,
    harnessed,
    holds,
    plan_snippet,
    read_leaves,
)
from pyrl.sandbox import SandboxLimits, run_code

log = logging.getLogger(__name__)

DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")  # verl 0.9.1's code-execution sources
MAX_CASES = 10  # verl's continuous score: the first 10 test cases
TIMEOUT_S = 10  # verl's per-case limit (prime_code's continuous pass, sandbox_fusion's default)
MEMORY_LIMIT_MB = 1024  # verl's reward.sandbox_fusion.memory_limit_mb
MAX_CONCURRENT = 64  # verl's reward.sandbox_fusion.max_concurrent
API_RETRIES, API_TIMEOUT_S = 3, 10  # sandbox_fusion.utils: attempts on 504, request time beyond the limits
HOSTILE = "code_hostile_outputs"  # pyrl.rewards.counts name: the manager's metric reward/code_hostile_outputs

# prime_code's (and sandbox_fusion's call-based wrapper's) header: solutions may use these names unimported
HEADER = """from string import *
from re import *
from datetime import *
from collections import *
from heapq import *
from bisect import *
from copy import *
from math import *
from random import *
from statistics import *
from itertools import *
from functools import *
from operator import *
from io import *
from sys import *
from json import *
from builtins import *
from typing import *
import string
import re
import datetime
import collections
import heapq
import bisect
import copy
import random
import statistics
import itertools
import functools
import operator
import io
import sys
import json
"""


# sandbox_fusion.utils' wrapper for call-based cases, sent to the server: arguments as JSON lines on stdin
FUSION_CALL = """
import traceback
# === User's Original Code START ===
{generation}
# === User's Original Code END ===

_SANDBOX_FN_NAME = {fn_name!r}

def _execute_user_function():
    _raw_input_str = sys.stdin.read()
    _args = []
    if _raw_input_str.strip():
        try:
            _args = [json.loads(line) for line in _raw_input_str.split('\\n')]
        except json.JSONDecodeError as _je:
            sys.stderr.write(f"WrapperError: Invalid JSON input for '{{_SANDBOX_FN_NAME}}': {{_je}}\\n")
            return None, True
    try:
        _target_callable = None
        if _SANDBOX_FN_NAME in globals():
            _target_callable = globals()[_SANDBOX_FN_NAME]
        elif 'Solution' in globals():
            _target_callable = getattr(globals()['Solution'](), _SANDBOX_FN_NAME)
        if not _target_callable:
            sys.stderr.write(f"WrapperError: Function or method '{{_SANDBOX_FN_NAME}}' not found.\\n")
            return None, True
        return _target_callable(*_args), False
    except Exception:
        sys.stderr.write(f"Error during setup or execution of '{{_SANDBOX_FN_NAME}}':\\n{{traceback.format_exc()}}\\n")
        return None, True

if __name__ == '__main__':
    _result, _error_occurred = _execute_user_function()
    if not _error_occurred:
        if isinstance(_result, (dict, list, tuple)) or _result is None or isinstance(_result, bool):
            print(json.dumps(_result))
        else:
            print(str(_result))
"""


def compute_score(solution_str: str, ground_truth, *, sandbox_fusion_url: str | None = None,
                  concurrent_semaphore=None, memory_limit_mb: int = MEMORY_LIMIT_MB,
                  max_concurrent: int = MAX_CONCURRENT, timeout: float = TIMEOUT_S,
                  allow_unisolated: bool = False) -> float:
    """The fraction of the first 10 test cases the response's program passes (see the module docstring).
    sandbox_fusion_url: run the cases on that Sandbox Fusion server (its /run_code url) instead of locally;
    concurrent_semaphore (verl's) or else max_concurrent bounds its requests in flight from this process.
    allow_unisolated: let pyrl.sandbox run the programs on a machine without a kernel boundary (it refuses
    otherwise, raising SandboxUnavailable, which is never caught here).

    A float, as verl's prime_code and sandbox_fusion return (and custom reward functions wrapping this one
    expect); the hostile outputs refused on the way are counted through pyrl.rewards.counts (always added, 0
    included), which the reward manager reports as reward/code_hostile_outputs."""
    cases = parse_cases(ground_truth)[:MAX_CASES]
    plans = [plan_case(case) for case in cases]  # a snippet the parent cannot check raises before anything runs
    if sandbox_fusion_url:
        program = fusion_program(solution_str)
        if program is None:
            counts.add(HOSTILE, 0)
            return 0.0
        limit = concurrent_semaphore or _semaphore(max_concurrent)
        with concurrent.futures.ThreadPoolExecutor(len(cases), thread_name_prefix="pyrl-sandbox-fusion") as pool:
            outcomes = list(pool.map(lambda cp: fusion_case(sandbox_fusion_url, limit, program, cp[0], cp[1],
                                                            timeout, memory_limit_mb), zip(cases, plans)))
    else:
        program = solution_str.split("```python")[-1].split("```")[0]
        outcomes = [local_case(program, case, plan, timeout, memory_limit_mb, allow_unisolated)
                    for case, plan in zip(cases, plans)]
    hostile = sum(h for _, h in outcomes)
    counts.add(HOSTILE, hostile)
    return sum(passed for passed, _ in outcomes) / len(cases)


def parse_cases(ground_truth) -> list[dict]:
    """verl's ground truth -> [{"input", "output", "fn_name", "assert_case"}] (output None: passing = a clean run)."""
    if isinstance(ground_truth, (str, bytes)):
        try:
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError as e:
            raise ValueError(f"ground_truth: not JSON ({e}); expected verl's test cases "
                             '{"inputs": [...], "outputs": [...]} (or "assert_case": [...])') from None
    if not isinstance(ground_truth, dict):
        raise ValueError(f"ground_truth: expected a dict of test cases, got {type(ground_truth).__name__}")
    asserts = ground_truth.get("assert_case")
    if isinstance(asserts, list):
        if ground_truth.get("fn_name"):
            raise ValueError("ground_truth: both 'fn_name' (call-based cases) and 'assert_case' given; expected one")
        inputs = ground_truth.get("inputs", [""] * len(asserts))
        outputs = ground_truth.get("outputs", [None] * len(asserts))
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError("ground_truth: with 'assert_case', 'inputs' and 'outputs' must be lists when given, got "
                             f"{type(inputs).__name__} and {type(outputs).__name__}")
        for k, snippet in enumerate(asserts):
            if not isinstance(snippet, str):
                raise ValueError(f"ground_truth: assert_case[{k}] is {type(snippet).__name__}, expected Python text")
    else:
        inputs, outputs, asserts = ground_truth.get("inputs"), ground_truth.get("outputs"), None
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError(f"ground_truth: expected 'inputs' and 'outputs' lists, got keys {sorted(ground_truth)}")
    if not inputs or len(inputs) != len(outputs) or (asserts is not None and len(asserts) != len(inputs)):
        raise ValueError(f"ground_truth: expected as many inputs as outputs (and assert_case), at least one; got "
                         f"{len(inputs)} inputs, {len(outputs)} outputs"
                         + (f", {len(asserts)} assert_case" if asserts is not None else ""))
    fn_name = ground_truth.get("fn_name") or None
    return [{"input": lines(i), "output": o if fn_name else (None if o is None else lines(o)), "fn_name": fn_name,
             "assert_case": asserts[k] if asserts is not None else ""}
            for k, (i, o) in enumerate(zip(inputs, outputs))]


def lines(value) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


# ---- what runs in the sandbox, and how the parent judges it (pyrl.rewards.assert_cases) ----
def plan_case(case: dict) -> Plan:
    if case["fn_name"]:
        return Plan(tail="", leaves=1, call=True)  # the call's source is made per program (prime_code's rules)
    if case["assert_case"].strip():
        return plan_snippet(case["assert_case"])
    if case["output"] is None:
        return Plan(tail="")  # a clean run: the harness's line, with no leaves
    return Plan(tail=None)


def sandbox_source(program: str, plan: Plan, case: dict, nonce: str, header: bool) -> str:
    """The text the sandbox runs: the harness, (prime_code's header,) the program, the tail that evaluates the
    leaves (for a call-based case, the call, by prime_code's rules), and the harness's line. Neither the expected
    output nor an assert's literal operands are in it."""
    tail = plan.tail
    if plan.call:
        tail = (f"_pyrl_leaf(lambda: _pyrl_call({case['input']!r}, {case['fn_name']!r}, "
                f"{'class Solution' in program}, globals()))\n")
    return harnessed((HEADER if header else "") + program, tail, nonce)


def judge(plan: Plan, case: dict, stdout: str, nonce: str | None) -> bool:
    """Whether the case passed, given a run that exited with code 0 and its stdout; raises Hostile."""
    expected = case["output"]
    if expected is not None and not plan.call and "\ufffd" in stdout and "\ufffd" not in expected:
        raise Hostile("output that is not UTF-8")  # the sandbox decodes invalid UTF-8 as U+FFFD
    if plan.tail is None:
        return stdout_matches(stdout, expected)
    values, before = read_leaves(stdout, nonce, plan.leaves)
    if values is None:  # the harness never wrote its line: the program ended (or was ended) before the tests
        return False
    if plan.call:
        return returned_matches(values[0], expected)
    leaves = Leaves(values)
    if not all(holds(check, leaves) for check in plan.checks):
        return False
    return expected is None or stdout_matches(before, expected)


def verdict(plan: Plan, case: dict, stdout: str, nonce: str | None) -> tuple[bool, int]:
    """judge(), never raising: (passed, hostile outputs counted)."""
    try:
        return bool(judge(plan, case, stdout, nonce)), 0
    except Exception as e:  # noqa: BLE001 - Hostile, RecursionError, MemoryError, anything: the case fails, counted
        note_hostile(e)
        return False, 1


_warned_hostile = False


def note_hostile(error: BaseException) -> None:
    global _warned_hostile
    if not _warned_hostile:
        _warned_hostile = True
        log.warning("code_exec: a program's output was refused (%s: %.200s); the case scores 0, and later ones are "
                    "only counted in reward/%s", type(error).__name__, error, HOSTILE)


# ---- local: prime_code's rules in pyrl.sandbox ----
def local_case(program: str, case: dict, plan: Plan, timeout: float, memory_limit_mb: int,
               allow_unisolated: bool = False) -> tuple[bool, int]:
    """(passed, hostile outputs) for one case run in pyrl.sandbox."""
    expected = case["output"]
    size = len(json.dumps(expected)) if expected is not None else 0
    if plan.tail is None:
        source, nonce, cap = HEADER + program, None, max(1 << 16, 2 * size + 4096)
    else:
        nonce = secrets.token_hex(16)
        source, cap = sandbox_source(program, plan, case, nonce, header=True), MARKER_MAX_CHARS + (1 << 16) + 2 * size
    limits = SandboxLimits(wall_s=timeout, cpu_s=timeout, memory_mb=memory_limit_mb, max_output_bytes=cap)
    result = run_code(source, stdin="" if plan.call else case["input"], limits=limits,
                      allow_unisolated=allow_unisolated)
    if result.status == "output_limit":
        note_hostile(Hostile(f"output past the cap of {cap} bytes"))
        return False, 1
    if not result.ok:
        log.debug("code_exec: case failed to run: %s", result.message)
        return False, 0
    return verdict(plan, case, result.stdout, nonce)


def returned_matches(value: tuple, expected) -> bool:
    """A call-based case: the returned value, through JSON as prime_code's harness printed it, equals the expected
    one (JSON text) or, for a list, its first element."""
    status, returned = value
    if status != "ok":
        return False
    try:
        got = json.loads(json.dumps(returned))  # tuples as lists, keys as strings; a set or bytes: not JSON
        want = json.loads(expected) if isinstance(expected, str) else expected
    except (TypeError, ValueError):
        return False
    return got == want or (isinstance(want, list) and bool(want) and got == want[0])


def stdout_matches(output: str, expected: str) -> bool:
    """prime_code's comparison of a program's output with the expected text."""
    got = output.splitlines()
    if expected.strip() in ("\n".join(got).strip(), "\n".join(line.strip() for line in got).strip()):
        return True
    want = [line.strip() for line in expected.split("\n") if line]
    nonblank = [line for line in got if line]
    if want in (got, nonblank):
        return True
    if len(nonblank) != len(want) or all(a.isdigit() and b.isdigit() for a, b in zip(nonblank, want)):
        return False  # prime_code compares as numbers only where some line is not a plain integer
    try:
        pairs = [(float(a), float(b)) for a, b in zip(nonblank, want)]
    except ValueError:
        return False
    return all(a == b or abs(a - b) <= 1e-8 + 1e-5 * abs(b) for a, b in pairs)  # numpy.allclose's test


# ---- Sandbox Fusion: verl's sandbox_fusion module over HTTP ----
def fusion_program(completion: str) -> str | None:
    """sandbox_fusion's extraction: after the last ```python, else the first ``` block without its language
    line; None when there is no fence."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" not in completion:
        return None
    block = completion.split("```")[1]
    if "\n" in block:
        first, rest = block.split("\n", 1)
        if first.strip().isalpha():
            return rest
    return block


@functools.lru_cache(maxsize=None)
def _semaphore(size: int) -> threading.BoundedSemaphore:
    return threading.BoundedSemaphore(size)


def fusion_case(url: str, limit, program: str, case: dict, plan: Plan, timeout: float,
                memory_limit_mb: int) -> tuple[bool, int]:
    """(passed, hostile outputs) for one case run on the Sandbox Fusion server. Call-based cases keep verl's
    wrapper (compared as text here); asserts and clean runs go through the harness as locally (without
    prime_code's header, as verl sends them); stdin cases as verl."""
    nonce = None
    if case["fn_name"]:
        code = HEADER + FUSION_CALL.format(generation=program, fn_name=case["fn_name"])
    elif plan.tail is None:
        code = program
    else:
        nonce = secrets.token_hex(16)
        code = sandbox_source(program, plan, case, nonce, header=False)
    payload = {"compile_timeout": timeout, "run_timeout": timeout, "code": code, "stdin": case["input"],
               "memory_limit_MB": memory_limit_mb, "language": "python", "files": {}, "fetch_files": []}
    with limit:
        response = call_sandbox_fusion(url, payload, timeout * 2 + API_TIMEOUT_S)
    if not isinstance(response, dict):
        return False, 0
    run = response.get("run_result") or {}
    if response.get("status") != "Success" or not isinstance(run, dict) or run.get("status") != "Finished":
        return False, 0
    stdout = run.get("stdout")
    stdout = stdout if isinstance(stdout, str) else ""
    if case["fn_name"] or plan.tail is None:
        expected = case["output"]
        return expected is None or stdout.rstrip("\n") == str(expected).rstrip("\n"), 0
    return verdict(plan, case, stdout, nonce)


def call_sandbox_fusion(url: str, payload: dict, request_timeout: float) -> dict | None:
    """POST /run_code; a 504 is retried (after 1 s, then 2 s), any other failure gives None (the case fails)."""
    data = json.dumps(payload).encode()
    for attempt in range(API_RETRIES):
        request = urllib.request.Request(url, data=data, method="POST", headers={
            "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=request_timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            if e.code == 504 and attempt < API_RETRIES - 1:
                time.sleep(attempt + 1)
                continue
            log.warning("code_exec: Sandbox Fusion at %s answered HTTP %d", url, e.code)
            return None
        except (OSError, ValueError, RecursionError) as e:  # unreachable, timed out, not JSON
            log.warning("code_exec: Sandbox Fusion at %s failed: %s", url, e)
            return None
    return None
