"""model.use_shm (verl's key): each node loads the model from its copy in shared memory, made once, whole or not at
all, and made again when the source changes; the workers load from it."""

import os

import pytest

from pyrl.models.hub import model_dir, shm_copy


def make_model_dir(root):
    src = root / "src" / "my-model"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "sub" / "weights.bin").write_bytes(os.urandom(4096))
    return src


def test_a_copy_is_made_once_and_remade_when_the_source_changes(tmp_path):
    src = make_model_dir(tmp_path)
    root = tmp_path / "shm"
    dest = shm_copy(str(src), str(root))
    assert dest.startswith(str(root)) and os.path.basename(dest) == "my-model"
    assert open(os.path.join(dest, "sub", "weights.bin"), "rb").read() == (src / "sub" / "weights.bin").read_bytes()
    inode = os.stat(os.path.join(dest, "config.json")).st_ino
    assert shm_copy(str(src), str(root)) == dest  # reused: not copied again
    assert os.stat(os.path.join(dest, "config.json")).st_ino == inode
    (src / "sub" / "weights.bin").write_bytes(os.urandom(4096))  # re-saved, same size: copied again
    assert shm_copy(str(src), str(root)) == dest
    assert open(os.path.join(dest, "sub", "weights.bin"), "rb").read() == (src / "sub" / "weights.bin").read_bytes()
    (src / "config.json").unlink()  # a file gone from the source is gone from the copy
    assert not os.path.exists(os.path.join(shm_copy(str(src), str(root)), "config.json"))
    # the copy replaced last is kept aside (a reader may hold its files open); older ones went with the next copy
    leftovers = [p for p in os.listdir(os.path.dirname(dest)) if p.startswith((".copying-", ".stale-"))]
    assert len(leftovers) == 1 and leftovers[0].startswith(".stale-")


def _copy_in_child(src, root, queue):
    queue.put(shm_copy(src, root))


def test_processes_racing_make_one_copy(tmp_path):
    """A node's ranks load at once: one copies, the others wait on the lock and find the copy made."""
    import multiprocessing

    src = make_model_dir(tmp_path)
    root = tmp_path / "shm"
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    children = [context.Process(target=_copy_in_child, args=(str(src), str(root), queue)) for _ in range(3)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    assert [child.exitcode for child in children] == [0, 0, 0]
    paths = {queue.get(timeout=5) for _ in children}
    assert len(paths) == 1
    home = os.path.dirname(paths.pop())
    assert sorted(os.listdir(home)) == [".lock", "my-model"]


def test_a_copy_that_fails_names_the_sizes(tmp_path, monkeypatch):
    import shutil

    src = make_model_dir(tmp_path)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copytree", full)
    with pytest.raises(OSError, match=r"model.use_shm=true: copying .*my-model \(0.00 GiB\) into .* GiB free\) failed"):
        shm_copy(str(src), str(tmp_path / "shm"))


def test_the_workers_load_from_the_copy(tmp_path, monkeypatch):
    import pyrl.models.hub as hub
    from pyrl.config import ModelConfig
    from pyrl.workers.models import load_policy

    monkeypatch.setattr(hub, "SHM_ROOT", str(tmp_path / "shm"))
    model = ModelConfig(path="pyrl:tiny", use_shm=True, use_fused_kernels=False)
    copied = model_dir(model)
    assert copied.startswith(str(tmp_path / "shm")) and os.path.isfile(os.path.join(copied, "config.json"))
    lm, _ = load_policy(model)
    assert lm.name_or_path == copied
    assert model_dir(ModelConfig(path="pyrl:tiny")) == hub.resolve_model_path("pyrl:tiny")  # off: the path itself
