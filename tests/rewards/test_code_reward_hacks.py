"""Programs that try to score without passing (pyrl.rewards.code_exec): each scores 0 on every case it does not
genuinely pass. Early exits of every kind, objects that misbehave when compared, a patched harness, forged
harness lines, reading the tests, hostile output (never an exception: a counted error). Then the same through the
reward manager (the count becomes the metric reward/code_hostile_outputs), Sandbox Fusion, and the reward and
advantage stages of a GRPO step, where the early-exit sample must get no reward.

Each test runs in both of the sandbox's modes (tests/sandbox/sandbox_leftovers.isolation_for): "isolated" (what
this machine allows: namespaces, the run's uid, seccomp, Landlock, a cgroup) and "unisolated" (the same without
namespaces, what a machine without unshare runs when the user opts in): the scoring must hold in both.
Every sandbox run costs ~0.1 s: the cases are few."""

import json
import pathlib
import sys
import types

import numpy as np
import pytest
import test_code_exec
import torch
from test_code_exec import fenced

import pyrl.sandbox as sandbox
from pyrl.rewards import assert_cases, code_exec, counts
from pyrl.rewards.code_exec import HOSTILE, compute_score

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "sandbox"))
from sandbox_leftovers import isolation_for, unavailable  # noqa: E402

fusion = test_code_exec.fusion  # the Sandbox Fusion fixture: pytest finds it in this module by this name


@pytest.fixture(autouse=True, params=["isolated", "unisolated"])
def sandbox_mode(request, monkeypatch):
    """Runs in this process use the mode's isolation; unisolated runs as a user who opted in
    (reward.sandbox.allow_unisolated=true), so that the scoring, not the default deny, is what is tested."""
    mode = request.param
    if unavailable(mode):
        pytest.skip(unavailable(mode))
    iso = isolation_for(mode)
    monkeypatch.setattr(sandbox, "isolation", lambda: iso)
    if mode == "unisolated":
        check = sandbox._check_isolation
        monkeypatch.setattr(sandbox, "_check_isolation", lambda found, allow: check(found, True))
    return mode

ADD = "def add(a, b):\n    return a + b"
ASSERTS = {"assert_case": ["assert add(1, 2) == 3", "assert add(20, 22) == 42"]}
CALLS = {"fn_name": "add", "inputs": ["1\n2", "20\n22"], "outputs": ["3", "42"]}
STDIN = {"inputs": ["1 2\n", "20 22\n"], "outputs": ["3\n", "42\n"]}
CLEAN = {"assert_case": ["add(1, 2)", "add(20, 22)"]}  # a clean run: passes when it runs to the end


def scored(code: str, truth, **kwargs) -> tuple[float, int]:
    """(score, hostile outputs counted) of a fenced program."""
    with counts.recording() as record:
        score = compute_score(fenced(code), truth, timeout=2, **kwargs)
    return score, record[HOSTILE]


def test_an_honest_program_scores_one_on_every_kind_of_case():
    for truth in (ASSERTS, CALLS, CLEAN):
        assert scored(ADD, truth) == (1.0, 0)
    assert scored("a, b = map(int, input().split())\nprint(a + b)", STDIN) == (1.0, 0)


# ---- early exits: the tests never run, so nothing passes (even with a correct add) ----
EARLY_EXITS = {
    "sys.exit(0)": "import sys\nsys.exit(0)",
    "sys.exit()": "import sys\nsys.exit()",
    "os._exit(0)": "import os\nos._exit(0)",
    "raise SystemExit(0)": "raise SystemExit(0)",
    "SIGKILL to itself": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "SIGTERM raised": "import signal\nsignal.raise_signal(signal.SIGTERM)",
    "exit from a signal handler": "import os, signal, time\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\n"
                                  "signal.setitimer(signal.ITIMER_REAL, 0.01)\ntime.sleep(1)",
    "exit from a thread": "import os, threading, time\nthreading.Thread(target=os._exit, args=(0,)).start()\n"
                          "time.sleep(1)",
    "atexit after SystemExit": "import atexit, os\natexit.register(os._exit, 0)\nraise SystemExit",
    "stdout closed": "import os\nos.close(1)",
}


@pytest.mark.parametrize("exit_code", EARLY_EXITS.values(), ids=EARLY_EXITS.keys())
@pytest.mark.parametrize("truth", [ASSERTS, CLEAN], ids=["asserts", "clean-run"])
def test_early_exit_scores_zero(exit_code, truth):
    assert scored(ADD + "\n" + exit_code, truth) == (0.0, 0)


def test_early_exit_on_call_based_and_stdin_cases_scores_zero():
    assert scored(ADD + "\nimport os\nos._exit(0)", CALLS) == (0.0, 0)
    assert scored("import sys\nsys.exit(0)", STDIN) == (0.0, 0)  # it printed nothing: stdout is compared


# ---- objects that misbehave when compared ----
LIARS = {
    "__eq__ always True": "class T:\n    def __eq__(self, other): return True\n    __hash__ = None\n"
                          "def add(a, b): return T()",
    "int subclass": "class I(int):\n    def __eq__(self, other): return True\n"
                    "    def __ne__(self, other): return False\n    def __repr__(self): return '3'\n"
                    "    __hash__ = int.__hash__\ndef add(a, b): return I(0)",
    "str subclass": "class S(str):\n    def __eq__(self, other): return True\n    __hash__ = str.__hash__\n"
                    "def add(a, b): return S('no')",
    "list subclass": "class L(list):\n    def __eq__(self, other): return True\n"
                     "    def __iter__(self): return iter([3])\ndef add(a, b): return L([0])",
    "float subclass": "class F(float):\n    def __eq__(self, other): return True\n    __hash__ = float.__hash__\n"
                      "def add(a, b): return F(-1.0)",
    "dict subclass lying about its items": "class D(dict):\n    def items(self): return [(0, 3)]\n"
                                           "    def __eq__(self, other): return True\ndef add(a, b): return D()",
    "a spoofed __class__": "class C:\n    __class__ = property(lambda self: int)\n"
                           "    def __eq__(self, other): return True\ndef add(a, b): return C()",
}


@pytest.mark.parametrize("program", LIARS.values(), ids=LIARS.keys())
def test_objects_that_misbehave_when_compared_score_zero(program):
    assert scored(program, ASSERTS) == (0.0, 0)
    assert scored(program, CALLS) == (0.0, 0)


def test_truthiness_and_membership_are_judged_on_plain_values():
    truth = {"assert_case": ["assert is_even(4)", "assert not is_even(3)", "assert 2 in evens(3)"]}
    liar = ("class B:\n    def __bool__(self): return True\n    def __contains__(self, x): return True\n"
            "def is_even(n): return n % 2 == 1\ndef evens(n): return B()")
    assert scored(liar, truth) == (0.0, 0)  # its own bools are wrong, and B is no value the parent accepts


def test_methods_and_subscripts_of_a_returned_value_are_evaluated_on_its_plain_data():
    truth = {"assert_case": ["assert items(1).count(3) == 2", "assert table(1)['a'] == 1",
                             "assert table(1).get('a') == 1", "assert name(1).startswith('ab')"]}
    liar = ("class E:\n    def __eq__(self, other): return True\n    __hash__ = None\n"
            "class D(dict):\n    def __getitem__(self, k): return 1\n    def get(self, k, d=None): return 1\n"
            "class S(str):\n    def startswith(self, *a): return True\n"
            "def items(n): return [E(), E()]\ndef table(n): return D()\ndef name(n): return S('zz')")
    assert scored(liar, truth) == (0.0, 0)
    honest = "def items(n): return [3, 1, 3]\ndef table(n): return {'a': 1}\ndef name(n): return 'abc'"
    assert scored(honest, truth) == (1.0, 0)
    # an object of the program's own class: its methods are called in the sandbox (its answer is its own, as a
    # function's is), except a predicate whose argument would be the expected value
    design = ("class Cache:\n    def __init__(self): self.data = {'a': 1}\n    def get(self, k): return self.data[k]\n"
              "    def count(self, x): return 2\n    def __getitem__(self, k): return self.data[k]\n"
              "    def startswith(self, prefix): return True\n"
              "def items(n): return Cache()\ndef table(n): return Cache()\ndef name(n): return Cache()")
    assert scored(design, truth) == (0.75, 0)
    assert "'ab'" not in assert_cases.plan_snippet(truth["assert_case"][3]).tail


# ---- patching the harness ----
PATCHES = {
    "builtins": "import builtins\nbuiltins.type = lambda *a: int\nbuiltins.isinstance = lambda *a: True\n"
                "builtins.issubclass = lambda *a: True\nbuiltins.repr = lambda x: '3'\nbuiltins.len = lambda x: 0",
    "json": "import json, json.encoder\njson.dumps = lambda *a, **k: '3'\njson.loads = lambda *a, **k: [0, 3]\n"
            "json.encoder.encode_basestring_ascii = lambda s: '3'",
    "print and sys.stdout": "import io, sys\nclass Quiet(io.StringIO):\n    def write(self, s): return len(s)\n"
                            "sys.stdout = Quiet()\nprint = lambda *a, **k: None",
    "math and operator": "import math, operator\nmath.isclose = lambda *a, **k: True\noperator.eq = lambda a, b: True",
    "the harness's leaf function": "real = _pyrl_leaf\n_pyrl_leaf = lambda thunk, *rest: real(lambda: 7)",
    "the harness's closure": "for cell in _pyrl_leaf.__closure__:\n    try:\n"
                             "        if isinstance(cell.cell_contents, list): cell.cell_contents.append('[0,3]')\n"
                             "    except ValueError: pass",
}


@pytest.mark.parametrize("patch", PATCHES.values(), ids=PATCHES.keys())
def test_patching_the_harness_scores_zero(patch):
    program = patch + "\ndef add(a, b): return 0"
    score, _ = scored(program, ASSERTS)
    assert score == 0.0
    assert scored(program, {"assert_case": ["import math\nassert math.isclose(add(1, 2), 3.0)"]})[0] == 0.0


# ---- forged harness lines: the nonce can be found, the expected values cannot ----
FORGER = """
import os, sys
def add(a, b): return 0
prefix = next(c for c in sys._getframe().f_code.co_consts if isinstance(c, str) and c.startswith("\\x1epyrl-leaves"))
os.write(1, b"\\n" + prefix.encode() + PAYLOAD + b"\\n")
os._exit(0)
"""


def forged(payload: bytes) -> str:
    return FORGER.replace("PAYLOAD", repr(payload))


@pytest.mark.parametrize("payload", [b"[[0,true]]", b"[[0,1]]", b'[[0,"3"]]', b"[[0,4]]", b'[[0,{"t":[3]}]]',
                                     b"[[1]]", b"[[3,3]]"])
def test_a_forged_line_scores_only_values_that_are_right(payload):
    assert scored(forged(payload), ASSERTS) == (0.0, 0)


def test_a_forged_line_is_no_better_than_computing():
    assert scored(forged(b"[[0,3]]"), ASSERTS) == (0.5, 0)  # 3 is add(1, 2): the program had to compute it


def test_calling_the_harness_early_scores_zero():
    assert scored("def add(a, b): return 0\n_pyrl_done()", ASSERTS) == (0.0, 2)  # no values: counted
    assert scored("def add(a, b): return 0\n_pyrl_leaf(lambda: 7)\n_pyrl_done()", ASSERTS) == (0.0, 0)


def test_printing_a_marker_without_the_nonce_scores_zero():
    fake = "def add(a, b): return 0\nprint('\\x1epyrl-leaves 00000000000000000000000000000000 [[0,3],[0,42]]')\n" \
           "raise SystemExit"
    assert scored(fake, ASSERTS) == (0.0, 0)


# ---- hostile output: 0, counted, never an exception ----
HOSTILE_LINES = {
    "10^6 nested [": b"[" * 10 ** 6,
    "deep but valid JSON": b"[[0," + b"[" * 5000 + b"]" * 5000 + b"]]",
    "nested past MAX_DEPTH": b"[[0," + b"[" * 200 + b"]" * 200 + b"]]",
    "a 10^5-digit int": b"[[0," + b"9" * 10 ** 5 + b"]]",
    "NaN": b"[[0,NaN]]",
    "Infinity": b"[[0,-Infinity]]",
    "invalid UTF-8": b'[[0,"\xff\xfe"]]',
    "a 10 MB line": b'[[0,"' + b"a" * 10 ** 7 + b'"]]',
    "an unknown tag": b'[[0,{"z":1}]]',
    "an unhashable set element": b'[[0,{"s":[[1]]}]]',
    "a dict entry that is no pair": b'[[0,{"d":[[1]]}]]',
    "too few entries": b"[]",
    "too many entries": b"[[0,3],[0,3]]",
    "not entries": b'{"a":1}',
}


@pytest.mark.parametrize("payload", HOSTILE_LINES.values(), ids=HOSTILE_LINES.keys())
def test_hostile_harness_lines_score_zero_and_are_counted(payload):
    assert scored(forged(payload), ASSERTS) == (0.0, 2)


def test_hostile_call_based_and_stdin_output_scores_zero_and_is_counted():
    assert scored(forged(b"[" * 10 ** 6), CALLS) == (0.0, 2)
    invalid = "import sys\nsys.stdout.buffer.write(b'3\\xff\\xfe\\n')"
    assert scored(invalid, STDIN) == (0.0, 2)
    huge = "import sys\nsys.stdout.write('4' * 10 ** 7)"
    assert scored(huge, STDIN) == (0.0, 2)


def test_honest_values_the_parent_refuses_to_expand_are_counted():
    truth = {"assert_case": ["assert 'ab' * add(10 ** 9, 0) != ''", "assert 2 ** add(10 ** 9, 0) > 0"]}
    assert scored(ADD, truth) == (0.0, 2)  # 10^9 repetitions / a 10^9-bit power: refused, never built


def test_values_that_cannot_be_serialized_fail_without_a_count():
    truth = {"assert_case": ["assert add(1, 2) == 3", "assert add(1, 2) != 3"]}
    deep = "def add(a, b):\n    x = []\n    for _ in range(500):\n        x = [x]\n    return x"
    cyclic = "def add(a, b):\n    x = []\n    x.append(x)\n    return x"
    generator = "def add(a, b):\n    return (i for i in range(3))"
    for program in (deep, cyclic, generator):
        assert scored(program, truth) == (0.0, 0)


# ---- the tests are never in the program's reach ----
DUMP = r"""
import os, sys
seen = [repr(sys._getframe().f_code.co_consts), repr(sorted(globals())), repr(dict(os.environ)), repr(sys.argv),
        sys.stdin.read()]
for fn in [v for v in globals().values() if callable(v)]:
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            seen.append(repr(cell.cell_contents))
        except ValueError:
            pass
for root, dirs, files in os.walk("."):
    for name in files:
        with open(os.path.join(root, name), errors="replace") as f:
            seen.append(f.read())
for path in ("/proc/self/cmdline", "/proc/self/environ", "/proc/1/cmdline"):
    try:
        with open(path, errors="replace") as f:
            seen.append(f.read())
    except OSError:
        pass
print("\n".join(seen))
def add(a, b): return 0
def greet(name): return ""
"""
SECRETS = ("918273645", "zebra-quokka", "8675309", "13579", "24680")


@pytest.mark.parametrize("truth", [
    {"assert_case": ["assert add(1, 2) == 918273645", "assert greet('x') == 'zebra-quokka'",
                     "expected = [13579, 24680]\nassert [add(1, 1), add(2, 2)] == expected"]},
    {"inputs": ["1 2\n"], "outputs": ["8675309\n"]},
    {"fn_name": "add", "inputs": ["1\n2"], "outputs": ["[13579, 24680]"]},
], ids=["asserts", "stdin", "call-based"])
def test_the_expected_values_never_reach_the_sandbox(monkeypatch, truth):
    sent, outputs = [], []
    real = code_exec.run_code

    def spy(code, **kwargs):
        sent.append(code + kwargs["stdin"] + json.dumps(kwargs.get("files") or {}))
        result = real(code, **kwargs)
        outputs.append(result.stdout + result.stderr)
        return result

    monkeypatch.setattr(code_exec, "run_code", spy)
    assert compute_score(fenced(DUMP), truth) == 0.0
    assert sent and all("def add(a, b): return 0" in text for text in sent)
    assert all(secret not in text for secret in SECRETS for text in sent + outputs)
    assert any("_pyrl_leaf" in out or "1 2" in out for out in outputs)  # the dump did run and print


# ---- through the reward manager: the count is a metric ----
class CharTokenizer:
    """One token per character (id = code point + 2; 0 pads, 1 ends): enough for the reward manager."""

    pad_token_id, eos_token_id, eos_token = 0, 1, "</s>"

    def encode(self, text: str) -> list[int]:
        return [ord(c) + 2 for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(int(i) - 2) if i >= 2 else ("" if skip_special_tokens else "</s>") for i in ids)


def code_batch(tokenizer, responses: list[str], truth, uids=None, source="apps"):
    """A rollout batch of code responses for one data source (right-padded responses, one prompt token)."""
    rows = [tokenizer.encode(r) + [tokenizer.eos_token_id] for r in responses]
    width = max(map(len, rows))
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    prompts = torch.full((len(rows), 1), ord("?") + 2)
    from pyrl.protocol import DataProto

    return DataProto.from_dict(
        {"prompts": prompts, "responses": tokens, "response_mask": mask,
         "attention_mask": torch.cat([torch.ones_like(prompts), mask], -1),
         "input_ids": torch.cat([prompts, tokens], -1)},
        {"data_source": np.array([source] * len(rows), dtype=object),
         "reward_model": np.array([{"ground_truth": json.dumps(truth), "style": "rule"}] * len(rows), dtype=object),
         "uid": np.array(uids or ["p0"] * len(rows), dtype=object)})


HONEST, EXITS = fenced(ADD), fenced(ADD + "\nimport os\nos._exit(0)")


def test_the_reward_manager_reports_hostile_outputs_as_a_metric():
    from pyrl.rewards.managers import RewardManager

    tokenizer = CharTokenizer()
    data = code_batch(tokenizer, [HONEST, EXITS, fenced(forged(b"[" * 10 ** 6))], ASSERTS)
    scores, extra, metrics = RewardManager(tokenizer)(data)  # default_compute_score: verl's code sources
    assert scores.sum(-1).tolist() == [1.0, 0.0, 0.0]
    assert extra == {"acc": [1.0, 0.0, 0.0]}  # the scores stay floats, as verl's prime_code returns
    assert metrics == {"reward/scorer_errors": 0, "reward/scorer_timeouts": 0, f"reward/{HOSTILE}": 2}


def test_counts_come_back_from_the_scoring_processes():
    from pyrl.rewards.managers import RewardManager, close_scoring_pools

    tokenizer = CharTokenizer()
    data = code_batch(tokenizer, [HONEST, fenced(forged(b"[[0,NaN]]"))], {"assert_case": ["assert add(1, 2) == 3"]})
    try:
        scores, _, metrics = RewardManager(tokenizer, num_workers=2)(data)
    finally:
        close_scoring_pools()
    assert scores.sum(-1).tolist() == [1.0, 0.0] and metrics[f"reward/{HOSTILE}"] == 1


def test_sandbox_fusion_asserts_get_the_same_hardening(fusion):
    for program, expected in ((ADD, 1.0), (ADD + "\nimport sys\nsys.exit(0)", 0.0), (LIARS["__eq__ always True"], 0.0),
                              (PATCHES["json"] + "\ndef add(a, b): return 0", 0.0)):
        assert scored(program, ASSERTS, sandbox_fusion_url=fusion.url) == (expected, 0)
    assert scored(forged(b"[[0,NaN]]"), ASSERTS, sandbox_fusion_url=fusion.url) == (0.0, 2)
    assert scored(ADD + "\nimport os\nos._exit(0)", CLEAN, sandbox_fusion_url=fusion.url) == (0.0, 0)
    assert all(SECRET not in payload["code"] for _, payload in fusion.requests for SECRET in ("== 3", "== 42"))


# ---- a GRPO step's reward and advantage stages: the early exit is never rewarded ----
class OneBatchRollout:
    """The rollout worker of a step whose generation returns these responses, n per prompt."""

    def __init__(self, tokenizer, responses, truth):
        self.tokenizer, self.responses, self.truth = tokenizer, responses, truth

    def generate_sequences(self, prompts):
        uids = [uid for uid in prompts.non_tensor_batch["uid"] for _ in range(len(self.responses))]
        out = code_batch(self.tokenizer, self.responses * len(prompts), self.truth, uids=uids)
        out.meta_info = dict(prompts.meta_info)
        return out

    def sleep_rollout(self):
        pass


class PromptsDataset:
    def __init__(self, size: int):
        self.size = size

    def __len__(self):
        return self.size

    def batch(self, indices, pad_token_id):
        from pyrl.protocol import DataProto

        return DataProto.from_dict({"input_ids": torch.full((len(indices), 1), 65)},
                                   {"data_source": np.array(["apps"] * len(indices), dtype=object)})


def test_a_grpo_step_never_rewards_the_early_exit():
    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "trainer"))
    from trainer_helpers import compose

    from pyrl.rewards.managers import load_reward_manager
    from pyrl.trainer.ppo_trainer import PPOTrainer, compute_advantage
    from pyrl.trainer.run_plan import resolve_run_plan

    config = compose("preset=toy", "algorithm.adv_estimator=grpo", "data.train_batch_size=1",
                     "actor_rollout_ref.rollout.n=4", "reward.num_workers=1", "trainer.total_training_steps=1")
    tokenizer = CharTokenizer()
    responses = [HONEST, EXITS, fenced(ADD + "\nraise SystemExit(0)"), fenced("def add(a, b):\n    return a * b")]
    truth = {"assert_case": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}  # a * b passes the second
    workers = types.SimpleNamespace(critic=None, reward_model=None, actor=None, world_size=1,
                                    rollout=OneBatchRollout(tokenizer, responses, truth))
    trainer = PPOTrainer(config, tokenizer, PromptsDataset(1), None, load_reward_manager(config, tokenizer),
                         None, workers, resolve_run_plan(config))
    timing, metrics = {}, {}
    batch = trainer.collect_batch(timing, metrics)  # sample prompts, generate, score: the step's reward stage
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]  # train_step without KL in the reward
    compute_advantage(batch, config.algorithm)
    scores = batch.batch["token_level_scores"]
    lengths = batch.batch["response_mask"].sum(-1)
    assert scores.sum(-1).tolist() == [1.0, 0.0, 0.0, 0.5]
    assert scores[0, lengths[0] - 1] == 1.0 and scores[1].abs().sum() == 0 and scores[2].abs().sum() == 0
    advantages = batch.batch["advantages"][:, 0]
    assert advantages[0] > advantages[3] > 0 > advantages[1] == advantages[2]
    assert metrics[f"reward/{HOSTILE}"] == 0 and metrics["reward/scorer_errors"] == 0
