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
    stamp = os.stat(os.path.join(dest, "config.json")).st_mtime_ns
    assert shm_copy(str(src), str(root)) == dest  # reused: not copied again
    assert os.stat(os.path.join(dest, "config.json")).st_mtime_ns == stamp
    (src / "sub" / "weights.bin").write_bytes(os.urandom(8192))  # the source changed: copied again
    assert shm_copy(str(src), str(root)) == dest
    assert os.path.getsize(os.path.join(dest, "sub", "weights.bin")) == 8192
    assert [p for p in os.listdir(os.path.dirname(dest)) if p.startswith(".copying-")] == []  # no staging left


def test_a_racing_copy_that_lost_the_rename_is_no_error(tmp_path, monkeypatch):
    """Another process renamed its whole copy into place first: this one's rename fails, and the copy there is
    used."""
    src = make_model_dir(tmp_path)
    root = tmp_path / "shm"
    real_rename = os.rename

    def other_process_wins(a, b):
        real_rename(a, b)  # the other process's copy lands first
        raise OSError(39, "Directory not empty")

    monkeypatch.setattr(os, "rename", other_process_wins)
    dest = shm_copy(str(src), str(root))
    assert (open(os.path.join(dest, "config.json")).read()) == '{"a": 1}'


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
    from pyrl.workers.actor import load_policy

    monkeypatch.setattr(hub, "SHM_ROOT", str(tmp_path / "shm"))
    model = ModelConfig(path="pyrl:tiny", use_shm=True, use_fused_kernels=False)
    copied = model_dir(model)
    assert copied.startswith(str(tmp_path / "shm")) and os.path.isfile(os.path.join(copied, "config.json"))
    lm, _ = load_policy(model)
    assert lm.name_or_path == copied
    assert model_dir(ModelConfig(path="pyrl:tiny")) == hub.resolve_model_path("pyrl:tiny")  # off: the path itself
