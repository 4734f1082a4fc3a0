"""Checkpoints that survive damage: each global_step_<k> directory gets a manifest of its files (relative path,
size, SHA-256), written last and atomically, so a checkpoint is intact exactly when every file it lists is there
with its size and digest. Resuming verifies it and falls back to the newest intact checkpoint, saying in one line
which one it skipped and why; retention never deletes the newest intact one.

What the manifest costs: one read of every file the step wrote, hashed in parallel threads (hashlib releases the GIL),
about a second per GB per core; the tiny model's checkpoints hash in milliseconds.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import shutil

log = logging.getLogger("pyrl")

MANIFEST = "manifest.json"
LATEST = "latest_checkpointed_iteration.txt"  # verl's: the step a resume starts from, written once its row is logged
TRAINER_STATE = "data.pt"  # the trainer's own state (step, sampler, ...), beside the workers' shards
STEP_PREFIX = "global_step_"
CHUNK = 1 << 20


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, f"{STEP_PREFIX}{step}")


def saved_steps(run_dir: str) -> list[int]:
    """The steps with a global_step_<k> directory in `run_dir`, ascending."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    return sorted(int(name[len(STEP_PREFIX):]) for name in names
                  if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit())


def _files(directory: str) -> list[str]:
    """Every regular file under `directory` (relative paths), the manifest and unfinished *.tmp writes excluded."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.endswith(".tmp"))
        for name in sorted(files):
            path = os.path.relpath(os.path.join(root, name), directory)
            if path != MANIFEST and not name.endswith(".tmp"):
                found.append(path)
    return found


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _digests(directory: str, names: list[str]) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda name: _sha256(os.path.join(directory, name)), names))


def write_manifest(directory: str) -> None:
    """List every file of the finished checkpoint in DIRECTORY/manifest.json (via a temporary file and a rename:
    the manifest is whole or absent, and its presence says the checkpoint was completed)."""
    names = _files(directory)
    files = {name: {"bytes": os.path.getsize(os.path.join(directory, name)), "sha256": digest}
             for name, digest in zip(names, _digests(directory, names))}
    _replace_manifest(directory, {"version": 1, "files": files})


def _replace_manifest(directory: str, recorded: dict) -> None:
    """DIRECTORY/manifest.json := recorded, via a synced temporary file and a rename: whole or absent."""
    tmp = os.path.join(directory, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(recorded, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, MANIFEST))


def damage(directory: str, digests: bool = True) -> str | None:
    """Why the checkpoint in DIRECTORY is not intact (one line naming the file, expected vs found), or None.
    digests=False checks presence and sizes only (retention's quick look at a checkpoint just written)."""
    manifest = os.path.join(directory, MANIFEST)
    try:
        with open(manifest) as f:
            recorded = json.load(f)
        files, pruned = recorded["files"], recorded.get("pruned", [])
    except FileNotFoundError:
        return f"{MANIFEST} is missing (the save did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    if "data.pt" not in files:
        return f"{MANIFEST} does not list data.pt"
    if pruned:
        return f"its {' and '.join(pruned)} checkpoint was removed by retention ({PRUNED_BY[pruned[0]]})"
    for name, entry in files.items():
        path = os.path.join(directory, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            return f"{name} is missing"
        if size != entry["bytes"]:
            return f"{name} is {size} bytes, the manifest says {entry['bytes']}"
    if digests:
        names = list(files)
        for name, digest in zip(names, _digests(directory, names)):
            if digest != files[name]["sha256"]:
                return f"{name} has SHA-256 {digest[:12]}..., the manifest says {files[name]['sha256'][:12]}..."
    return None


PRUNED_BY = {"critic": "trainer.max_critic_ckpt_to_keep"}


def apply_retention(run_dir: str, newest: int, keep: int | None, keep_critic: int | None) -> None:
    """verl's max_actor_ckpt_to_keep / max_critic_ckpt_to_keep, once checkpoint `newest` is there whole (never the
    newest intact one is dropped): checkpoints older than the newest `keep` are removed, and of those left, the
    critic/ part of any older than the newest `keep_critic` (as verl keeps the actor's and the critic's separately);
    such a checkpoint's manifest then says so, and resuming skips it (a critic run needs both)."""
    keep = keep if keep and keep > 0 else None  # verl: 0 or less keeps them all
    keep_critic = keep_critic if keep_critic and keep_critic > 0 else None
    if not keep and not keep_critic:
        return
    problem = damage(step_dir(run_dir, newest), digests=False)
    if problem is not None:
        log.warning("keeping every older checkpoint: the one just saved is not intact (%s)", problem)
        return
    older = [step for step in saved_steps(run_dir) if step < newest]
    if keep:
        for old in older[:max(len(older) - keep + 1, 0)]:
            shutil.rmtree(step_dir(run_dir, old), ignore_errors=True)
        older = older[max(len(older) - keep + 1, 0):]
    if keep_critic:
        for old in older[:max(len(older) - keep_critic + 1, 0)]:
            _prune(step_dir(run_dir, old), "critic")


def _prune(directory: str, part: str) -> None:
    """Remove DIRECTORY/part and record it in the manifest (its other files keep their entries and digests)."""
    if not os.path.isdir(os.path.join(directory, part)):
        return
    manifest = os.path.join(directory, MANIFEST)
    try:
        with open(manifest) as f:
            recorded = json.load(f)
        recorded["files"] = {name: entry for name, entry in recorded["files"].items()
                             if not name.startswith(part + "/")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # not intact anyway: nothing to keep it for
        shutil.rmtree(os.path.join(directory, part), ignore_errors=True)
        return
    recorded["pruned"] = sorted(set(recorded.get("pruned", [])) | {part})
    _replace_manifest(directory, recorded)  # first: a crash in between leaves a checkpoint that says what it lacks
    shutil.rmtree(os.path.join(directory, part), ignore_errors=True)


def newest_intact(run_dir: str, latest: int, digests: bool = True) -> str | None:
    """The newest intact checkpoint at or before step `latest` (the committed one), logging one line per
    checkpoint skipped on the way; None when there is none at all; an error naming each one when every one is
    damaged (starting over silently would discard them: trainer.resume_mode=disable does that on purpose).
    digests=False: sizes only (a quick answer for a message; the resume itself verifies the digests)."""
    problems = []
    for step in sorted((s for s in saved_steps(run_dir) if s <= latest), reverse=True):
        directory = step_dir(run_dir, step)
        problem = damage(directory, digests)
        if problem is None:
            return directory
        log.warning("skipping checkpoint %s: %s", directory, problem)
        problems.append(f"{os.path.basename(directory)}: {problem}")
    if problems:
        raise RuntimeError(f"no intact checkpoint to resume from in {run_dir} ({'; '.join(problems)}); "
                           "trainer.resume_mode=disable starts over")
    return None


# ---- a trainer's side of a checkpoint (the PPO and the SFT trainers) ----

def save_trainer_state(directory: str, state: dict) -> None:
    """The trainer's `state` as data.pt (through a temporary file), then the manifest, last: a step directory
    without one is an unfinished save. The workers' shards are written before this."""
    # lazy: torch loads with the checkpoints
    import torch

    from pyrl.workers.checkpoint import save_failed

    tmp = os.path.join(directory, TRAINER_STATE + ".tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(directory, TRAINER_STATE))
        write_manifest(directory)
    except Exception as e:  # noqa: BLE001 - a full disk, said plainly (torch says "unexpected pos")
        raise save_failed(directory, e) from e


def load_trainer_state(directory: str) -> dict:
    import torch  # lazy: torch loads with the checkpoints

    return torch.load(os.path.join(directory, TRAINER_STATE), weights_only=False)


def commit(run_dir: str, step: int, keep: int | None, keep_critic: int | None) -> None:
    """Make the saved `step` the one to resume from (latest_checkpointed_iteration.txt, replaced atomically), then
    retention (apply_retention)."""
    latest_tmp = os.path.join(run_dir, LATEST + ".tmp")
    with open(latest_tmp, "w") as f:
        f.write(str(step))
    os.replace(latest_tmp, os.path.join(run_dir, LATEST))
    apply_retention(run_dir, step, keep, keep_critic)


def to_resume(run_dir: str, mode: str, resume_from_path: str | None, digests: bool = True) -> str | None:
    """The checkpoint directory trainer.resume_mode picks: disable, none; resume_path, trainer.resume_from_path
    (which must be intact); auto, the newest intact one up to the committed step (None: start over)."""
    if mode == "disable":
        return None
    if mode == "resume_path":
        if not resume_from_path or not os.path.exists(os.path.join(resume_from_path, TRAINER_STATE)):
            raise FileNotFoundError(f"trainer.resume_from_path: {resume_from_path!r} is not a global_step_<k> "
                                    f"checkpoint directory (no {TRAINER_STATE})")
        problem = damage(resume_from_path, digests)
        if problem is not None:
            raise ValueError(f"trainer.resume_from_path: {resume_from_path!r} is not intact: {problem}")
        return os.path.abspath(resume_from_path)  # the workers (on other nodes too) read it from their own cwd
    if mode != "auto":
        raise ValueError(f"trainer.resume_mode: expected auto, disable or resume_path, got {mode!r}")
    latest = os.path.join(run_dir, LATEST)
    if not os.path.exists(latest):
        return None
    with open(latest) as f:
        committed = int(f.read().strip())
    found = newest_intact(run_dir, committed, digests)  # logs each damaged one it skips
    if found is None:
        log.warning("%s names step %d, but %s holds no checkpoint: starting over", LATEST, committed, run_dir)
    return found
