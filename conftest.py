"""Test order for CI's two-process runs (tests/ and benchmarks/ alike): the files that took longest in a recorded CI
run go first, so that both pytest-xdist workers stay busy to the end instead of one finishing a minutes-long file
while the other idles. xdist hands files (`--dist loadfile`) or tests (`--dist load`) out in the order collected
(the README's command turns off xdist's own default, fewest-tests-last, which put the few-test trainer files last).
Within a file the order is unchanged; a file the record does not name (a new one) goes last.

The record, .ci/test_durations.json (test id -> seconds, setup + call + teardown, for the tests of half a second or
more: 97% of the time in 10% of the tests), is written by a run with PYRL_RECORD_DURATIONS=1 set (e.g.
`PYRL_RECORD_DURATIONS=1 bash .ci/run` in a clone, then copy the file back): each test seen replaces its entry. A
stale record only makes the order worse, never a result."""

import json
import os
import pathlib
import sys
from collections import defaultdict

HERE = pathlib.Path(__file__).resolve().parent
# pytest put this directory first on sys.path to import this file; off again, so that the tests import the installed
# pyrl (with its built extension), not the source tree's package beside this file
if sys.path and pathlib.Path(sys.path[0]).resolve() == HERE:
    del sys.path[0]
RECORD = HERE / ".ci" / "test_durations.json"
RECORDED_FROM_S = 0.5
_seen: dict[str, float] = defaultdict(float)


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_configure(config):
    # Two test processes (-n 2) and the Ray workers of each share this machine's cores. OpenMP's threads (torch's,
    # vLLM's, pyrl._C's) spin after each parallel region, waiting for the next one, and that spinning takes the
    # cores the other process's threads need: two 4-step runs at once (pyrl:tiny, hf rollout, 2 cores) took 56-65
    # busy CPU-seconds and 31-36 s spinning, 39-53 and 23-30 s with threads that sleep as they wait. Only for
    # parallel test runs: a run alone is faster spinning (its steps took 0.47-0.54 s, 0.63-0.78 s sleeping), so pyrl
    # leaves OpenMP's default to its users. Set here, before xdist starts its workers, which inherit it (and their
    # Ray workers and subprocesses after them); a value in the environment already wins.
    if getattr(config.option, "numprocesses", None):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_collection_modifyitems(config, items):
    recorded = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    per_file: dict[str, float] = defaultdict(float)
    for nodeid, seconds in recorded.items():
        per_file[_file(nodeid)] += seconds
    items.sort(key=lambda item: -per_file.get(_file(item.nodeid), 0.0))  # stable: a file's order kept


def pytest_runtest_logreport(report):
    if os.environ.get("PYRL_RECORD_DURATIONS"):
        _seen[report.nodeid] += report.duration


def pytest_sessionfinish(session, exitstatus):
    if not os.environ.get("PYRL_RECORD_DURATIONS") or hasattr(session.config, "workerinput") or not _seen:
        return  # xdist's workers report to the controller, which writes the record once
    recorded = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    for nodeid, seconds in _seen.items():
        recorded.pop(nodeid, None)
        if seconds >= RECORDED_FROM_S:
            recorded[nodeid] = round(seconds, 1)
    tmp = RECORD.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(sorted(recorded.items())), indent=0, ensure_ascii=False) + "\n")
    tmp.replace(RECORD)
