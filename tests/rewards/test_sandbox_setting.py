"""reward.sandbox.allow_unisolated and the code_interpreter tool's allow_unisolated: on a machine whose kernel cannot
isolate untrusted code, code rewards and the tool stop the run at start (or, at the latest, at the first scoring),
naming what is missing and the key; never a scorer error counted as 0, never a tool error answer."""

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest

import pyrl.sandbox as sandbox
from pyrl.rewards.managers import attempt
from pyrl.rewards.scorers import default_compute_score
from pyrl.sandbox import SandboxUnavailable
from pyrl.tools.code_interpreter import CodeInterpreterTool
from pyrl.trainer.checks import check_default_scorer

CASES = json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})
PROGRAM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


@pytest.fixture
def unisolated(monkeypatch):
    """This machine as one without namespaces (what a machine without unshare or user namespaces gets)."""
    iso = dataclasses.replace(sandbox.isolation(), namespace=(), userns=False,
                              missing=("namespaces (unshare: not found)",))
    monkeypatch.setattr(sandbox, "isolation", lambda: iso)
    monkeypatch.setattr(sandbox, "_warned_unisolated", False)
    return iso


def config(allow: bool, url=None, custom=None, reward_model=False):
    reward = SimpleNamespace(sandbox=SimpleNamespace(allow_unisolated=allow),
                             sandbox_fusion=SimpleNamespace(url=url),
                             custom_reward_function=SimpleNamespace(path=custom),
                             reward_model=SimpleNamespace(enable=reward_model))
    rollout = SimpleNamespace(agent=SimpleNamespace(agent_loop_config_path=None),
                              multi_turn=SimpleNamespace(interaction_config_path=None))
    return SimpleNamespace(reward=reward, data=SimpleNamespace(reward_fn_key="data_source"),
                           actor_rollout_ref=SimpleNamespace(rollout=rollout))


def datasets(*sources, path="train.parquet"):
    return [SimpleNamespace(rows=[{"data_source": s} for s in sources], place=lambda i: f"data file {path!r} row {i}")]


def test_start_check_stops_a_code_run_naming_the_key(unisolated):
    with pytest.raises(SandboxUnavailable, match=r"missing namespaces \(unshare: not found\).*"
                                                 r"reward\.sandbox\.allow_unisolated=true"):
        check_default_scorer(config(False), datasets("openai/gsm8k", "apps"))


@pytest.mark.parametrize("cfg, data", [
    (config(True), datasets("apps")),  # opted in
    (config(False), datasets("openai/gsm8k")),  # no code rows
    (config(False, url="http://127.0.0.1:1/run_code"), datasets("apps")),  # Sandbox Fusion runs them
    (config(False, custom="my_reward.py"), datasets("apps")),  # the user's scorer decides
], ids=["allowed", "no-code-rows", "sandbox-fusion", "custom-scorer"])
def test_start_check_passes_when_no_local_code_runs_unisolated(unisolated, cfg, data):
    check_default_scorer(cfg, data)


@pytest.mark.parametrize("source, why", [("numina_olympiads", "verl 0.9.1 scores it with a scorer whose packages pyrl "
                                                             "does not install"),
                                         ("openai/gsm8k_typo", "no rule-based scorer for it")])
def test_start_check_stops_a_source_nothing_scores(source, why):
    """A data source the default scorer cannot score stops the run naming the row and the source, where scoring
    would have given every one of its samples 0; a custom function or a reward model scores it instead."""
    with pytest.raises(ValueError, match=rf"data file 'val.parquet' row 1: data_source '{source}': {why}; set "
                                         r"reward.custom_reward_function.path"):
        check_default_scorer(config(True), datasets("openai/gsm8k") + datasets("aime2024", source, path="val.parquet"))
    check_default_scorer(config(True, custom="my_reward.py"), datasets(source))
    check_default_scorer(config(True, reward_model=True), datasets(source))


def test_scoring_raises_through_the_manager_instead_of_counting_a_zero(unisolated):
    with pytest.raises(SandboxUnavailable):  # attempt() counts every other scorer failure as a 0
        attempt(default_compute_score, 10.0, {"data_source": "apps", "solution_str": PROGRAM, "ground_truth": CASES})


def test_opted_in_scoring_runs_and_warns_once(unisolated, caplog):
    with caplog.at_level(logging.WARNING, logger="pyrl.sandbox"):
        scores = [default_compute_score("apps", PROGRAM, CASES, allow_unisolated=True) for _ in range(2)]
    assert [s["score"] if isinstance(s, dict) else s for s in scores] == [1.0, 1.0]
    warnings = [r for r in caplog.records if "WITHOUT a kernel boundary" in r.getMessage()]
    assert len(warnings) == 1


def test_code_interpreter_tool_refuses_at_construction(unisolated):
    with pytest.raises(SandboxUnavailable, match="allow_unisolated: true"):
        CodeInterpreterTool({"type": "native"})
    CodeInterpreterTool({"type": "native", "allow_unisolated": True})
    with pytest.raises(ValueError, match="allow_unisolated: expected true or false"):
        CodeInterpreterTool({"type": "native", "allow_unisolated": "yes"})


def test_isolated_machine_needs_no_opt_in():
    iso = sandbox.isolation()
    if not iso.kernel_boundary:
        pytest.fail(f"this machine kind is expected to isolate code: {iso.describe()}; missing {iso.missing}")
    check_default_scorer(config(False), datasets("apps"))
