"""Where a model or tokenizer path points: a local Hugging Face model directory, one of pyrl's own models
(BUILTIN_MODELS: "pyrl:tiny", "pyrl:tiny-toy-sft", "pyrl:tiny-tool-sft", ..., made on first use), or a Hugging Face
hub id ("Qwen/Qwen2.5-0.5B-Instruct") fetched into, or found in, the Hugging Face cache (HF_HOME / HF_HUB_CACHE;
HF_HUB_OFFLINE=1 uses the cache only).

The driver resolves every path of a run once, before workers start (pyrl.ppo.resolve_model_paths), so that workers,
vLLM and the checkpoints all see one local directory and no worker contacts the hub.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import tempfile

from pyrl.models import warm_start
from pyrl.models.tiny import TinyModelSpec, tiny_classifier_path, tiny_model_path
from pyrl.verl_features import NotImplementedFeature

# files neither transformers nor vLLM reads from a model repository (other frameworks' weights, raw originals)
IGNORED = ["*.gguf", "*.onnx", "*.onnx_data", "*.h5", "*.msgpack", "*.ot", "*.tflite", "original/*", "onnx/*"]


def _tiny(**spec):
    return tiny_model_path(TinyModelSpec(**spec))


def _warm_start(name: str, **kwargs):
    return getattr(warm_start, name)(**kwargs)


BUILTIN_MODELS = {  # pyrl's own models by name -> a function making it on first use (cached) and giving its directory
    "pyrl:tiny": _tiny,
    "pyrl:tiny-toy-sft": lambda: _warm_start("toy_warm_start_path"),  # the toy task's (pyrl.data.toy)
    # a wider, deeper model over the same tokenizer (the tokenizer depends on the seed and vocabulary size only):
    # the toy distillation demo's teacher (README, On-policy distillation)
    "pyrl:tiny-wide": lambda: _tiny(hidden_size=192, num_layers=3, num_heads=3, intermediate_size=512),
    # the tiny model with a seeded one-label score head: a served discriminative reward model (untrained)
    "pyrl:tiny-classifier": lambda: tiny_classifier_path(),
    "pyrl:tiny-tool": lambda: _tiny(tools=True),  # the tool-calling variant (tokenizer and chat template know calls)
    "pyrl:tiny-tool-sft": lambda: _warm_start("tool_warm_start_path"),  # the tool task's (pyrl.data.tool_calc)
    # the tool task's transfer variant (preset=tool_calc_transfer): the calculator shown on sums and differences
    # only, products absent / products answered without it
    "pyrl:tiny-tool-transfer-sft": lambda: _warm_start("tool_transfer_warm_start_path"),
    "pyrl:tiny-tool-transfer-guess-sft": lambda: _warm_start("tool_transfer_warm_start_path", products="guessed"),
}


def resolve_model_path(path: str, key: str = "model.path") -> str:
    """The local directory of `path`; errors name the config `key` it came from."""
    if path in BUILTIN_MODELS:
        return str(BUILTIN_MODELS[path]())
    if not path:
        raise ValueError(f"{key} is empty: give a local Hugging Face model directory, a Hugging Face hub id, or "
                         f"one of pyrl's own models ({', '.join(BUILTIN_MODELS)})")
    if os.path.isdir(path):
        return path
    if "://" in path:  # verl copies hdfs:// (and other fsspec URLs) to local disk first
        raise NotImplementedFeature("model paths on remote file systems (hdfs:// and other URLs)", f"{key}={path}",
                                    "copy the model to a local directory and give that")
    if not is_hub_id(path):
        raise FileNotFoundError(f"{key}={path!r}: no such directory")
    return hub_snapshot(path, key)


SHM_ROOT = "/dev/shm/pyrl-models"


def model_dir(model_config) -> str:
    """The directory this process loads model_config's model from: resolve_model_path's, or with model.use_shm
    (verl's key) its copy in this node's shared memory (shm_copy)."""
    path = resolve_model_path(model_config.path)
    return shm_copy(path) if model_config.use_shm else path


def shm_copy(path: str, root: str | None = None) -> str:
    """A copy of model directory `path` in shared memory (root, a tmpfs; SHM_ROOT by default) and its path: made
    once per node, under a lock the node's processes share, and reused while its files match the source's (names,
    sizes, modification times: copy2 keeps them), as verl's copy_to_shm. A stale copy is moved aside, never deleted
    under a reader's feet; a full tmpfs stops with the sizes."""
    root = root or SHM_ROOT
    src = os.path.abspath(path)
    home = os.path.join(root, hashlib.md5(src.encode()).hexdigest()[:16])
    dest = os.path.join(home, os.path.basename(src))
    if _same_files(src, dest):
        return dest
    os.makedirs(home, exist_ok=True)
    with open(os.path.join(home, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one copy per node: the others wait, then find it made
        if _same_files(src, dest):
            return dest
        for leftover in os.listdir(home):  # a copy killed midway, or an old one moved aside
            if leftover.startswith((".copying-", ".stale-")):
                shutil.rmtree(os.path.join(home, leftover), ignore_errors=True)
        staging = tempfile.mkdtemp(prefix=".copying-", dir=home)
        try:
            shutil.copytree(src, os.path.join(staging, "copy"), dirs_exist_ok=True)  # follows a snapshot's links
            if os.path.isdir(dest):  # the source changed since: readers of the old copy keep their open files
                os.rename(dest, tempfile.mkdtemp(prefix=".stale-", dir=home) + "/copy")
            os.rename(os.path.join(staging, "copy"), dest)
        except OSError as e:
            need = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(src) for f in fs)
            raise OSError(f"model.use_shm=true: copying {src} ({need / 2**30:.2f} GiB) into {root} "
                          f"({shutil.disk_usage(root).free / 2**30:.2f} GiB free) failed: {e}") from e
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _same_files(src: str, dest: str) -> bool:
    """dest holds exactly src's files, each with src's size and modification time."""
    if not os.path.isdir(dest):
        return False
    listed = set()
    for directory, _, files in os.walk(src):
        for name in files:
            rel = os.path.relpath(os.path.join(directory, name), src)
            listed.add(rel)
            there, here = os.path.join(dest, rel), os.stat(os.path.join(directory, name))
            if not os.path.isfile(there):
                return False
            copied = os.stat(there)
            if copied.st_size != here.st_size or copied.st_mtime_ns != here.st_mtime_ns:
                return False
    copied_files = {os.path.relpath(os.path.join(d, f), dest) for d, _, fs in os.walk(dest) for f in fs}
    return copied_files == listed


def is_hub_id(path: str) -> bool:
    """"org/name" or "name" as the hub spells repositories; anything path-like ("./x", "/x", "a/b/c") is not."""
    # lazy: huggingface_hub loads only for a hub id
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


@functools.lru_cache(maxsize=None)  # the critic's and the actor's path are usually the same id: look it up once
def _snapshot(repo_id: str) -> str:
    from huggingface_hub import HfApi, constants, snapshot_download  # lazy: huggingface_hub loads only for a hub id

    ignored = list(IGNORED)
    if not constants.HF_HUB_OFFLINE:
        try:  # repositories often hold the weights twice; both loaders prefer safetensors
            if any(f.endswith(".safetensors") for f in HfApi().list_repo_files(repo_id)):
                ignored += ["*.bin", "*.pt", "*.pth"]
        except Exception:  # noqa: BLE001 - hub unreachable or no such repo: snapshot_download says which below
            pass
    # online it downloads what the cache lacks; offline (HF_HUB_OFFLINE=1, or the hub unreachable) it returns
    # the cached snapshot of the main revision, or raises
    return snapshot_download(repo_id, ignore_patterns=ignored)


def hub_snapshot(repo_id: str, key: str) -> str:
    from huggingface_hub import constants  # lazy: huggingface_hub loads only for a hub id

    try:
        return _snapshot(repo_id)
    except Exception as e:  # noqa: BLE001 - one clear error whatever the hub client raised
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        offline = "HF_HUB_OFFLINE=1: the hub is not contacted" if constants.HF_HUB_OFFLINE else "HF_HUB_OFFLINE is off"
        raise FileNotFoundError(
            f"{key}={repo_id!r} is neither a local directory nor a Hugging Face hub model found in the cache "
            f"{constants.HF_HUB_CACHE} or downloadable ({offline}; {reason}). Download it where the hub is "
            f"reachable (hf download {repo_id}) into this cache (HF_HOME / HF_HUB_CACHE), or give a local "
            "directory") from None
