"""Ctrl-C during training: the run ends with one line (the step it stopped at, the checkpoint a rerun resumes
from), exit code 130, no traceback and no process left behind."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from trainer_helpers import SMALL, marked_processes

# timing-bound (Ray's view of free resources, signals, hang detection): run alone, after the parallel tests
pytestmark = pytest.mark.serial


def test_ctrl_c_ends_with_one_line_and_leaves_nothing_behind(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYRL_TEST_INTERRUPT": str(tmp_path)}  # inherited by Ray's processes and the workers
    # its own process group, which gets the SIGINT as a terminal's foreground group gets a Ctrl-C
    proc = subprocess.Popen([sys.executable, "-m", "pyrl.ppo", *SMALL, "actor_rollout_ref.rollout.name=hf",
                             "trainer.total_training_steps=50", "trainer.save_freq=1", "trainer.logger=[console]",
                             f"trainer.default_local_dir={run_dir}"], cwd=tmp_path, env=env, start_new_session=True,
                            stdout=open(tmp_path / "out.txt", "w"), stderr=open(tmp_path / "err.txt", "w"),
                            # as a terminal's foreground command has it: a test run started in the background by a
                            # non-interactive shell (`cmd &`) inherits SIGINT ignored, and Python then installs no
                            # KeyboardInterrupt handler, so the run would rightly go on to its last step
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        latest = run_dir / "latest_checkpointed_iteration.txt"
        deadline = time.monotonic() + 300
        while not latest.exists():
            assert proc.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint in 300 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out, err = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    (last,) = [text.rstrip().splitlines()[-1] for text in (out, err) if "interrupted at step" in text]
    found = re.search(r"interrupted at step (\d+) of 50: rerunning the same command resumes from "
                      r"(.*/global_step_(\d+))$", last)
    assert found, last
    assert 1 <= int(found[3]) <= int(found[1]) and os.path.exists(os.path.join(found[2], "data.pt"))
    deadline = time.monotonic() + 15  # Ray's processes end on their own once the driver is gone
    while (left := marked_processes(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [(p.pid, p.name()) for p in left]
