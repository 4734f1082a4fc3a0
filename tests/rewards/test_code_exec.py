"""Code-execution scoring (pyrl.rewards.code_exec): hand-written programs against hand-computed fractions of the
first 10 test cases passed, on both of verl 0.9.1's paths.

The Sandbox Fusion path talks to a small HTTP server in a thread on 127.0.0.1 that implements the /run_code
request and response format verl sends (sandbox_fusion/utils.py) and runs the code in pyrl.sandbox: the real
server is a Docker image (bytedance/SandboxFusion) that cannot run here."""

import functools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pyrl.rewards import assert_cases, code_exec
from pyrl.rewards.code_exec import compute_score, stdout_matches
from pyrl.rewards.scorers import default_compute_score
from pyrl.sandbox import SandboxLimits, run_code

# a + b on stdin; four cases, the third with a == 5
SUM = json.dumps({"inputs": ["1 2\n", "3 4\n", "5 6\n", "20 22\n"], "outputs": ["3\n", "7\n", "11\n", "42\n"]})


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nIt reads two numbers."


CORRECT = "a, b = map(int, input().split())\nprint(a + b)"
SMALL_ONLY = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"  # passes the first two of four
WRONG = "a, b = map(int, input().split())\nprint(a - b)"
CRASHING = "a, b = map(int, input().split())\nprint(a / 0)"
LOOPS_ON_FIVE = "a, b = map(int, input().split())\nwhile a == 5:\n    pass\nprint(a + b)"  # three of four


@pytest.mark.parametrize("code, expected", [
    (CORRECT, 1.0), (SMALL_ONLY, 0.5), (WRONG, 0.0), (CRASHING, 0.0), (LOOPS_ON_FIVE, 0.75),
], ids=["correct", "partly", "wrong", "crashing", "timing-out"])
def test_local_fraction_of_cases_passed(code, expected):
    assert compute_score(fenced(code), SUM, timeout=1) == expected


def test_without_a_code_block_the_local_path_runs_the_whole_response():
    assert compute_score("The answer is a + b.", SUM, timeout=1) == 0.0  # prose: a syntax error, every case fails
    assert compute_score(CORRECT, SUM, timeout=1) == 1.0  # prime_code takes a bare program as the program


def test_only_the_first_ten_cases_count():
    cases = {"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{i}\n" for i in range(12)]}
    fails_late = "n = int(input())\nprint(n if n < 10 else -1)"
    fails_first = "n = int(input())\nprint(n if n > 0 else -1)"
    assert compute_score(fenced(fails_late), cases) == 1.0
    assert compute_score(fenced(fails_first), cases) == 0.9


def test_prime_codes_header_and_output_comparison():
    cases = {"inputs": ["2\n", "10\n"], "outputs": [["1.41421", ""], "3.1622776"]}  # a list of lines is joined
    assert compute_score(fenced("print(sqrt(int(input())))"), cases) == 1.0  # sqrt without an import
    assert stdout_matches("a b  \nc\n", "a b\nc\n")  # stripped per line
    assert stdout_matches("a\n\nb\n", "a\nb\n")  # blank lines ignored
    assert stdout_matches("0.333333\n", "0.3333333333")  # numbers within rtol 1e-5
    assert not stdout_matches("0.3333\n", "0.3333333333")
    assert not stdout_matches("007\n", "7\n")  # plain integers are compared as text, as prime_code does
    assert not stdout_matches("1\n2\n", "1\n")


def test_call_based_cases_with_fn_name():
    cases = json.dumps({"fn_name": "combine", "inputs": ["1\n2", "3\n4", "[1]\n[2]"],
                        "outputs": ["3", "[7]", "[1, 2]"]})
    function = "def combine(a, b):\n    print('debugging output is ignored')\n    return a + b"
    method = "class Solution:\n    def combine(self, a, b):\n        return a + b if isinstance(a, int) else a"
    assert compute_score(fenced(function), cases) == 1.0  # [7]: a list's first element counts, as prime_code
    assert compute_score(fenced(method), cases) == pytest.approx(2 / 3)
    assert compute_score(fenced("def other(a, b):\n    return a + b"), cases) == 0.0


def test_assert_cases():
    cases = {"assert_case": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]}
    assert compute_score(fenced("def add(a, b):\n    return a + b"), cases) == 0.5


@pytest.mark.parametrize("truth, message", [
    ("not json", "ground_truth: not JSON"),
    ({"inputs": ["1"]}, "expected 'inputs' and 'outputs' lists"),
    ({"inputs": ["1"], "outputs": []}, "as many inputs as outputs"),
    ({"inputs": [], "outputs": []}, "at least one"),
    ([1, 2], "expected a dict of test cases, got list"),
])
def test_malformed_ground_truth_is_a_clear_error(truth, message):
    with pytest.raises(ValueError, match=message):
        compute_score(fenced(CORRECT), truth)


@pytest.mark.parametrize("source", code_exec.DATA_SOURCES)
def test_default_compute_score_routes_verls_code_sources(source):
    assert default_compute_score(source, fenced(CORRECT), SUM) == 1.0
    assert default_compute_score(source, fenced(SMALL_ONLY), SUM) == 0.5


class FakeSandboxFusion(BaseHTTPRequestHandler):
    """POST /run_code as Sandbox Fusion answers it, the code run in pyrl.sandbox."""

    def do_POST(self):
        server = self.server
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.requests.append((self.path, payload))
            server.in_flight += 1
            server.peak = max(server.peak, server.in_flight)
            gateway_timeout = server.fail_first and len(server.requests) == 1
        try:
            if gateway_timeout:
                self.send_error(504)
                return
            result = run_code(payload["code"], stdin=payload["stdin"] or "", limits=SandboxLimits(
                wall_s=payload["run_timeout"], cpu_s=payload["run_timeout"], memory_mb=payload["memory_limit_MB"]))
            run = {"status": "TimeLimitExceeded" if result.status == "timeout" else "Finished",
                   "execution_time": result.wall_s, "return_code": result.returncode, "stdout": result.stdout,
                   "stderr": result.stderr}
            body = json.dumps({"status": "Success" if result.ok else "Failed", "message": "", "compile_result": None,
                               "run_result": run, "files": {}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        finally:
            with server.lock:
                server.in_flight -= 1

    def log_message(self, *args):
        pass


@pytest.fixture
def fusion(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeSandboxFusion)
    server.lock, server.requests, server.in_flight, server.peak, server.fail_first = threading.Lock(), [], 0, 0, False
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}/run_code"
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("code, expected", [
    (CORRECT, 1.0), (SMALL_ONLY, 0.5), (WRONG, 0.0), (CRASHING, 0.0), (LOOPS_ON_FIVE, 0.75),
], ids=["correct", "partly", "wrong", "crashing", "timing-out"])
def test_sandbox_fusion_fraction_of_cases_passed(fusion, code, expected):
    assert compute_score(fenced(code), SUM, sandbox_fusion_url=fusion.url, timeout=1) == expected
    assert len(fusion.requests) == 4
    path, payload = fusion.requests[0]
    assert path == "/run_code"
    assert set(payload) == {"compile_timeout", "run_timeout", "code", "stdin", "memory_limit_MB", "language", "files",
                            "fetch_files"}  # verl's payload
    assert payload["language"] == "python" and payload["memory_limit_MB"] == 1024 and payload["run_timeout"] == 1


def test_sandbox_fusion_needs_a_code_block_and_takes_a_plain_fence(fusion):
    assert compute_score(CORRECT, SUM, sandbox_fusion_url=fusion.url) == 0.0 and fusion.requests == []
    assert compute_score(f"```py\n{CORRECT}\n```", SUM, sandbox_fusion_url=fusion.url) == 1.0


def test_sandbox_fusion_call_based_and_assert_cases(fusion):
    cases = {"fn_name": "add", "inputs": ["1\n2", "3\n4"], "outputs": ["3", "8"]}  # compared as printed text
    assert compute_score(fenced("def add(a, b):\n    return a + b"), cases, sandbox_fusion_url=fusion.url) == 0.5
    asserts = {"assert_case": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]}
    assert compute_score(fenced("def add(a, b):\n    return a + b"), asserts, sandbox_fusion_url=fusion.url) == 0.5


def test_sandbox_fusion_retries_a_gateway_timeout_and_bounds_concurrency(fusion):
    fusion.fail_first = True
    assert compute_score(fenced(CORRECT), SUM, sandbox_fusion_url=fusion.url, max_concurrent=2) == 1.0
    assert len(fusion.requests) == 5 and fusion.peak <= 2  # four cases and the retried one


def test_sandbox_fusion_unreachable_scores_zero():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/run_code"
    assert compute_score(fenced(CORRECT), SUM, sandbox_fusion_url=url) == 0.0


def test_the_reward_manager_binds_reward_sandbox_fusion(fusion):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))
    from trainer_helpers import compose

    from pyrl.rewards.managers import load_reward_manager

    config = compose("preset=toy", f"reward.sandbox_fusion.url={fusion.url}", "reward.sandbox_fusion.max_concurrent=8",
                     "reward.sandbox_fusion.memory_limit_mb=512", "reward.num_workers=1")
    score = load_reward_manager(config, None).compute_score
    assert isinstance(score, functools.partial) and score.keywords == {
        "sandbox_fusion_url": fusion.url, "memory_limit_mb": 512, "max_concurrent": 8, "allow_unisolated": False}
    assert score(data_source="apps", solution_str=fenced(SMALL_ONLY), ground_truth=SUM) == 0.5
    assert fusion.requests and all(payload["memory_limit_MB"] == 512 for _, payload in fusion.requests)
    assert score(data_source="openai/gsm8k", solution_str="#### 3", ground_truth="3") == 1.0  # others unchanged


# ---- assert cases: the parent evaluates the asserts (see pyrl.rewards.assert_cases' docstring) ----
ADD = "def add(a, b):\n    return a + b"


def parent_verdicts(snippet: str, namespace: dict) -> list[bool]:
    """What the parent concludes for each assert of `snippet`, its leaves evaluated here with Python in
    `namespace` (trusted, hand-written functions: no sandbox needed to test the parent's logic)."""
    import re

    plan = assert_cases.plan_snippet(snippet)
    scope, values = dict(namespace), []
    for line in plan.tail.splitlines():
        leaf = re.fullmatch(r"_pyrl_leaf\(lambda: \((.*?)\)(?:, lambda _pyrl_v: \(.*\), (?:True|False))?\)", line)
        if leaf is None:
            exec(line, scope)
            continue
        try:
            values.append(("ok", eval(leaf.group(1), scope)))
        except Exception:
            values.append(("raised", None))
    return [assert_cases.holds(check, assert_cases.Leaves(values)) for check in plan.checks]


def python_verdict(snippet: str, namespace: dict) -> bool:
    try:
        exec(snippet, dict(namespace))
    except Exception:
        return False
    return True


NAMESPACE = {"add": lambda a, b: a + b, "rev": lambda x: x[::-1], "pair": lambda: (4, 5), "evens": lambda: {2, 4},
             "table": lambda: {"a": 1, 2: [1, 2]}, "third": lambda: 0.1 + 0.2, "nothing": lambda: None,
             "words": lambda s: s.split(), "math": __import__("math")}


@pytest.mark.parametrize("snippet", [
    "assert add(1, 2) == 3", "assert add(1, 2) == 4", "assert rev([1, 2]) == [2, 1]", "assert rev([1, 2]) == (2, 1)",
    "assert pair() == (4, 5)", "assert set(pair()) == {5, 4}", "assert evens() == {4, 2}", "assert evens() == [2, 4]",
    "assert table() == {2: [1, 2], 'a': 1}", "assert table()['a'] == 1 and table().get('z', 0) == 0",
    "assert third() == 0.3", "assert math.isclose(third(), 0.3)", "assert abs(third() - 0.3) < 1e-9",
    "assert round(third(), 2) == 0.3", "assert not add(1, 1) == 3", "assert not add(1, 1) == 2",
    "assert 3 in rev([3, 1]) and 5 not in rev([3, 1])", "assert nothing() is None", "assert add(0, 0) or nothing()",
    "assert add('a', 'b') * 2 == 'abab'", "assert words('a b c') == ['a', 'b', 'c']", "assert len(words('a b')) == 2",
    "assert sorted(table().keys(), key=str) == [2, 'a']", "assert [add(i, 1) for i in range(3)] == [1, 2, 3]",
    "assert all(add(i, i) == 2 * i for i in range(4))", "assert all(x > 1 for x in rev([1, 2]))",
    "assert sum(x for x in rev([1, 2, 3])) == 6", "assert isinstance(pair(), tuple) and type(rev([1])) == list",
    "assert f'{add(1, 1):03d}' == '002'", "assert ' '.join(map(str, rev([1, 2]))) == '2 1'",
    "expected = [2, 1]\nassert rev([1, 2]) == expected", "xs = [1, 2]\nassert rev(xs) == [2, 1]\nassert xs == [1, 2]",
    "for a, b in [(1, 2), (3, 4)]:\n    assert add(a, b) == a + b", "for a in range(3):\n    assert add(a, 1) == 2",
    "assert add(1, 2) == 3, 'the message is never evaluated'", "if __name__ == '__main__':\n    assert add(1, 1) == 2",
    "assert add(1, 1) == 2\nassert add(2, 2) == 5",
    "assert [add(x, y) for x in range(2) for y in range(x + 1)] == [0, 1, 2]",
])
def test_the_parent_judges_asserts_as_python_does(snippet):
    assert all(parent_verdicts(snippet, NAMESPACE)) == python_verdict(snippet, NAMESPACE)


@pytest.mark.parametrize("snippet, message", [
    ("def check(candidate):\n    assert candidate(1, 2) == 3\ncheck(add)", "inside functiondef"),
    ("for x in inputs():\n    assert add(x, 0) == x", "not a literal"),
    ("if add(1, 1) != 2:\n    raise AssertionError", "inside if"),
    ("assert [add(x, 0) == x for x in inputs()]", "computes a verdict in the program's process"),
    ("assert add(1, 2) == 3 +", "not valid Python"),
])
def test_asserts_the_parent_cannot_check_are_a_clear_error(snippet, message):
    with pytest.raises(ValueError, match=message):
        compute_score(fenced(ADD), {"assert_case": [snippet]})


def test_expected_values_stay_in_the_parent():
    plan = assert_cases.plan_snippet("expected = [31337, 4242]\nassert sorted(f([4242, 31337])) == expected\n"
                                     "assert math.isclose(g(2), 1.41421, rel_tol=1e-3)\nassert 'kiwi' not in h(271828)")
    assert "[31337, 4242]" not in plan.tail and "expected" not in plan.tail and "1.41421" not in plan.tail
    assert "kiwi" not in plan.tail and "271828" in plan.tail  # the inputs are sent, the expected values are not
    assert plan.leaves == 3


def test_assert_cases_end_to_end():
    cases = {"assert_case": [
        "import math\nassert math.isclose(area(2), 12.566, rel_tol=1e-3)",
        "assert not is_even(3) and is_even(4)",
        "assert 'b' in letters(2)",
        "assert pairs(2) == [(0, 0), (1, 1)] and counts('aab') == {'a': 2, 'b': 1}",
    ]}
    correct = ("import math\nfrom collections import Counter\ndef area(r): return math.pi * r * r\n"
               "def is_even(n): return n % 2 == 0\ndef letters(n): return 'abc'[:n]\n"
               "def pairs(n): return [(i, i) for i in range(n)]\ndef counts(s): return Counter(s)")
    assert compute_score(fenced(correct), cases) == 1.0  # Counter: a dict subclass, read as the dict it holds
    half = correct.replace("math.pi * r * r", "3 * r * r").replace("'abc'[:n]", "'xyz'[:n]")
    assert compute_score(fenced(half), cases) == 0.5


def test_program_objects_compare_through_str_repr_len():
    cases = {"assert_case": ["assert str(node(2)) == 'N2'", "assert len(node(3)) == 3", "assert node(3) == 3"]}
    program = ("class N:\n    def __init__(self, v): self.v = v\n    def __str__(self): return f'N{self.v}'\n"
               "    def __len__(self): return self.v\n    def __eq__(self, other): return True\n"
               "def node(v): return N(v)")
    assert compute_score(fenced(program), cases) == pytest.approx(2 / 3)  # its __eq__ is never asked


def test_clean_run_cases_need_the_program_and_the_snippet_to_finish():
    cases = {"inputs": ["1\n", "2\n"], "outputs": [None, None]}
    assert compute_score(fenced("n = int(input())\nassert n > 0"), cases) == 1.0
    assert compute_score(fenced("n = int(input())\nassert n == 1"), cases) == 0.5
    snippet = {"assert_case": ["add(1, 2)", "add(1, 'x')"]}  # setup only: passes when it runs without raising
    assert compute_score(fenced(ADD), snippet) == 0.5
    assert compute_score(fenced("import sys\nsys.exit(0)\n" + ADD), snippet) == 0.0


def test_call_based_values_are_read_through_the_builtin_types():
    cases = {"fn_name": "f", "inputs": ["1", "2"], "outputs": ["[1, 2]", '{"a": 2}']}
    program = ("from collections import namedtuple, Counter\nP = namedtuple('P', 'x y')\n"
               "def f(n):\n    return P(1, 2) if n == 1 else Counter({'a': 2})")
    assert compute_score(fenced(program), cases) == 1.0


def test_allow_unisolated_reaches_the_sandbox(monkeypatch):
    seen = []
    real = code_exec.run_code

    def spy(code, **kwargs):
        seen.append(kwargs["allow_unisolated"])
        return real(code, **kwargs)

    monkeypatch.setattr(code_exec, "run_code", spy)
    compute_score(fenced(CORRECT), SUM, allow_unisolated=True)
    compute_score(fenced(CORRECT), SUM)
    assert seen == [True] * 4 + [False] * 4


@pytest.mark.parametrize("truth, message", [
    ({"assert_case": ["assert f() == 1"], "fn_name": "f"}, "both 'fn_name'"),
    ({"assert_case": ["assert f() == 1"], "inputs": "x"}, "must be lists when given"),
])
def test_assert_case_ground_truth_checked(truth, message):
    with pytest.raises(ValueError, match=message):
        compute_score(fenced("def f():\n    return 1"), truth)


def test_many_large_honest_leaves_stay_within_the_line_bound():
    """40 leaves whose values fill the harness's budget: the line (brackets, tags and commas counted) is read, not
    refused as hostile; the leaves past the budget fail, the ones within it pass."""
    from pyrl.rewards.assert_cases import MARKER_MAX_CHARS

    size = MARKER_MAX_CHARS // 40 - 8
    asserts = "\n".join(f"assert f({i}) == 'x' * {size}" for i in range(40))
    score = compute_score(fenced(f"def f(i):\n    return 'x' * {size}"), {"assert_case": [asserts]})
    assert score == 1.0
