"""Checkpoints that survive damage (pyrl.trainer.checkpoints): a manifest of sizes and SHA-256 digests written last;
a truncated, missing or bit-flipped file, or a missing manifest, makes a checkpoint not intact, named in one line;
resuming falls back to the newest intact checkpoint at or before the committed one. First on directories written
here, then through a real run resumed after its newest checkpoint was damaged."""

import os
import shutil

import pytest
from trainer_helpers import SMALL, compose, read_metrics

from pyrl.trainer import checkpoints


def fake_checkpoint(run_dir, step: int, critic: bool = False) -> str:
    directory = checkpoints.step_dir(str(run_dir), step)
    os.makedirs(os.path.join(directory, "actor"))
    files = [("data.pt", 300), ("actor/__0_0.distcp", 5000), ("actor/extra_rank0.pt", 700)]
    if critic:
        os.makedirs(os.path.join(directory, "critic"))
        files.append(("critic/__0_0.distcp", 4000))
    for name, size in files:
        with open(os.path.join(directory, name), "wb") as f:
            f.write(os.urandom(size))
    checkpoints.write_manifest(directory)
    return directory


def test_an_intact_checkpoint_and_each_kind_of_damage(tmp_path):
    directory = fake_checkpoint(tmp_path, 1)
    assert checkpoints.damage(directory) is None
    shard = os.path.join(directory, "actor", "__0_0.distcp")
    original = open(shard, "rb").read()

    with open(shard, "r+b") as f:  # one bit flipped, same size: only the digest tells
        f.seek(1234)
        f.write(bytes([original[1234] ^ 1]))
    assert checkpoints.damage(directory, digests=False) is None
    assert checkpoints.damage(directory).startswith("actor/__0_0.distcp has SHA-256 ")

    with open(shard, "wb") as f:  # truncated
        f.write(original[:100])
    assert checkpoints.damage(directory) == "actor/__0_0.distcp is 100 bytes, the manifest says 5000"
    os.remove(shard)
    assert checkpoints.damage(directory) == "actor/__0_0.distcp is missing"

    other = fake_checkpoint(tmp_path, 2)
    with open(os.path.join(other, checkpoints.MANIFEST), "w") as f:
        f.write('{"files": {"data.pt": {"bytes": 3')  # torn
    assert checkpoints.damage(other).startswith("manifest.json is unreadable (JSONDecodeError")
    os.remove(os.path.join(other, checkpoints.MANIFEST))
    assert checkpoints.damage(other) == "manifest.json is missing (the save did not finish)"


def test_the_newest_intact_checkpoint_is_chosen_and_each_skip_is_said(tmp_path, caplog):
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    with open(os.path.join(checkpoints.step_dir(str(tmp_path), 3), "data.pt"), "ab") as f:
        f.write(b"x")
    os.remove(os.path.join(checkpoints.step_dir(str(tmp_path), 4), checkpoints.MANIFEST))
    with caplog.at_level("WARNING", logger="pyrl"):
        assert checkpoints.newest_intact(str(tmp_path), 3) == checkpoints.step_dir(str(tmp_path), 2)
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping checkpoint")]
    # step 4 was never committed (latest is 3): not looked at
    assert skipped == [f"skipping checkpoint {checkpoints.step_dir(str(tmp_path), 3)}: data.pt is 301 bytes, "
                       "the manifest says 300"]
    for step in (1, 2):
        os.remove(os.path.join(checkpoints.step_dir(str(tmp_path), step), "actor", "extra_rank0.pt"))
    with pytest.raises(RuntimeError, match=r"no intact checkpoint to resume from .*global_step_3: data.pt is 301 bytes"
                                           r".*global_step_1: actor/extra_rank0.pt is missing.*resume_mode=disable"):
        checkpoints.newest_intact(str(tmp_path), 3)
    assert checkpoints.newest_intact(str(tmp_path / "nothing"), 3) is None


def test_retention_keeps_whole_checkpoints_and_critics_separately(tmp_path, caplog):
    """max_actor_ckpt_to_keep=3 keeps the newest 3 checkpoints; max_critic_ckpt_to_keep=1 keeps the critic of the
    newest only, as verl keeps the two separately: the older ones keep their actor, say in their manifest what
    they lost, and are skipped by a resume with that reason; nothing is dropped while the newest is not whole."""
    run = str(tmp_path)
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step, critic=True)
    os.remove(os.path.join(checkpoints.step_dir(run, 4), "actor", "extra_rank0.pt"))
    with caplog.at_level("WARNING", logger="pyrl"):
        checkpoints.apply_retention(run, 4, 3, 1)
    assert checkpoints.saved_steps(run) == [1, 2, 3, 4]  # the newest is not intact: all kept
    assert "keeping every older checkpoint: the one just saved is not intact (actor/extra_rank0.pt is missing)" \
        in caplog.text
    shutil.rmtree(checkpoints.step_dir(run, 4))
    fake_checkpoint(tmp_path, 4, critic=True)
    checkpoints.apply_retention(run, 4, 3, 1)
    assert checkpoints.saved_steps(run) == [2, 3, 4]
    for step in (2, 3):
        directory = checkpoints.step_dir(run, step)
        assert (not os.path.exists(os.path.join(directory, "critic"))
                and os.path.exists(os.path.join(directory, "actor")))
        assert checkpoints.damage(directory) == ("its critic checkpoint was removed by retention "
                                                 "(trainer.max_critic_ckpt_to_keep)")
    assert checkpoints.damage(checkpoints.step_dir(run, 4)) is None
    os.remove(os.path.join(checkpoints.step_dir(run, 4), "data.pt"))
    with caplog.at_level("WARNING", logger="pyrl"):
        with pytest.raises(RuntimeError, match="global_step_3: its critic checkpoint was removed by retention"):
            checkpoints.newest_intact(run, 4)
    checkpoints.apply_retention(run, 3, None, None)  # neither key set: nothing happens
    checkpoints.apply_retention(run, 4, -1, 0)  # 0 or less keeps them all, as in verl
    assert checkpoints.saved_steps(run) == [2, 3, 4]
    # a checkpoint with no readable manifest (a save cut short): its critic goes, and retention carries on
    fake_checkpoint(tmp_path, 5, critic=True)
    fake_checkpoint(tmp_path, 6, critic=True)
    os.remove(os.path.join(checkpoints.step_dir(run, 5), checkpoints.MANIFEST))
    checkpoints.apply_retention(run, 6, None, 1)
    assert not os.path.exists(os.path.join(checkpoints.step_dir(run, 5), "critic"))
    assert os.path.exists(os.path.join(checkpoints.step_dir(run, 6), "critic"))


def test_a_run_resumes_from_the_newest_intact_checkpoint(tmp_path, ray_session, caplog):
    """Three steps saved; the newest's actor shard truncated: the rerun skips it, saying why, resumes from step
    2 (metrics.jsonl keeps steps 1-2) and trains steps 3 and 4, saving a sound step 3 in place of the damaged one;
    trainer.val_only validates step 4's weights. trainer.resume_from_path naming a damaged checkpoint stops the
    run, naming the file."""
    from pyrl.ppo import run_ppo

    args = [*SMALL, "actor_rollout_ref.rollout.name=hf", "trainer.save_freq=1", f"trainer.default_local_dir={tmp_path}"]
    run_ppo(compose(*args, "trainer.total_training_steps=3"))
    step3 = checkpoints.step_dir(str(tmp_path), 3)
    shard = next(os.path.join(root, name) for root, _, names in os.walk(os.path.join(step3, "actor"))
                 for name in names if name.endswith(".distcp"))
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level("INFO", logger="pyrl"):
        run_ppo(compose(*args, "trainer.total_training_steps=4"))
    relative = os.path.relpath(shard, step3)
    assert f"skipping checkpoint {step3}: {relative} is {size // 2} bytes, the manifest says {size}" in caplog.text
    assert f"resumed from {checkpoints.step_dir(str(tmp_path), 2)} (step 2)" in caplog.text
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert checkpoints.damage(step3) is None  # saved again, whole
    # val_only validates the checkpoint the run resumes from (verl 0.9.1: only with val_before_train, which
    # SMALL turns off; else it trains) and trains nothing
    run_ppo(compose(*args, "trainer.total_training_steps=4", "trainer.val_only=true", "data.val_max_samples=8"))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4] and "val-core/pyrl/toy_addition/acc/mean@1" in rows[-1]
    with open(os.path.join(step3, "data.pt"), "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match=r"trainer.resume_from_path: .*global_step_3' is not intact: data.pt is "):
        run_ppo(compose(*args, "trainer.total_training_steps=5", "trainer.resume_mode=resume_path",
                        f"trainer.resume_from_path={step3}"))



DISK_FULL = r"""
set -u
mount -t tmpfs -o size=1g pyrl-test "$BASE"
run() {  # run LABEL STEPS: python -m pyrl.ppo, its output in $OUT/LABEL.log and exit code in $OUT/LABEL.rc
    "$PYTHON" -m pyrl.ppo trainer.total_training_steps=$2 $ARGS trainer.default_local_dir="$BASE/run" \
        > "$OUT/$1.log" 2>&1
    echo $? > "$OUT/$1.rc"
}
run first 1
used=$(df --output=used -B1 "$BASE" | tail -1)
step=$(du -sb "$BASE/run/global_step_1" | cut -f1)
mount -o remount,size=$((used + step / 2)) "$BASE"  # room for half a checkpoint more
run full 2
"$PYTHON" -c "from pyrl.trainer import checkpoints; print(checkpoints.damage('$BASE/run/global_step_1'))" \
    > "$OUT/damage"
cat "$BASE/run/latest_checkpointed_iteration.txt" > "$OUT/latest"
mount -o remount,size=1g "$BASE"
run again 2
cat "$BASE/run/latest_checkpointed_iteration.txt" > "$OUT/latest_again"
"""


def test_a_save_that_runs_out_of_disk_leaves_the_last_checkpoint_loadable(tmp_path):
    """In a mount namespace of its own, the run directory on a tmpfs with room for half a checkpoint more than
    step 1's: step 2's save fails (ENOSPC) and the run stops with an error saying so; step 1's checkpoint is intact
    and still the committed one; with room again the same command resumes from it and finishes."""
    import shutil
    import subprocess
    import sys

    unshare = shutil.which("unshare")
    assert unshare, "util-linux unshare (the sandbox needs it too)"
    base, out = tmp_path / "disk", tmp_path / "out"
    base.mkdir()
    out.mkdir()
    namespace = [unshare, "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else
                                                                     ["--user", "--map-root-user"])
    args = " ".join([*SMALL, "actor_rollout_ref.rollout.name=hf", "trainer.save_freq=1", "trainer.logger=[jsonl]"])
    env = {**os.environ, "BASE": str(base), "OUT": str(out), "PYTHON": sys.executable, "ARGS": args}
    proc = subprocess.run([*namespace, "bash", "-c", DISK_FULL], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    logs = {p.stem: p.read_text() for p in out.glob("*.log")}
    codes = {p.stem: int(p.read_text()) for p in out.glob("*.rc")}
    assert proc.returncode == 0 and set(codes) == {"first", "full", "again"}, (proc.stderr[-2000:], logs)
    assert codes["first"] == 0 and codes["again"] == 0, logs
    assert codes["full"] != 0 and "No space left on device" in logs["full"], logs["full"][-3000:]
    assert (out / "damage").read_text().strip() == "None" and (out / "latest").read_text().strip() == "1"
    assert "resumed from" in logs["again"] and "global_step_1 (step 1)" in logs["again"], logs["again"][-3000:]
    assert (out / "latest_again").read_text().strip() == "2"
