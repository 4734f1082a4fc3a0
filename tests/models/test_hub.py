"""Model paths as Hugging Face hub ids, resolved through the Hugging Face cache once in the driver
(pyrl.models.hub); local directories and pyrl's own models as before."""

import json
import os
import subprocess
import sys

import pytest

from pyrl.models.hub import is_hub_id, resolve_model_path

# run in a fresh interpreter: huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE when it is imported
OFFLINE_LOAD = r"""
import json, sys
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer
from pyrl.config import PPOConfig
from pyrl.ppo import resolve_model_paths
from pyrl.trainer.run_plan import resolve_run_plan
from pyrl.workers.models import load_policy, load_tokenizer

hub_id, source = sys.argv[1:3]
def config(path):
    keys = [f"actor_rollout_ref.model.path={path}", f"actor_rollout_ref.model.tokenizer_path={path}",
            "algorithm.adv_estimator=gae"]
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PPOConfig), OmegaConf.from_dotlist(keys)))
cfg = config(hub_id)
resolve_model_paths(cfg, resolve_run_plan(cfg))
model = cfg.actor_rollout_ref.model
lm, _ = load_policy(model)
want = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
text = "<|im_start|>user\n12+34=<|im_end|>"
try:
    missing = config("pyrl-test/not-cached")
    resolve_model_paths(missing, resolve_run_plan(missing))
    error = None
except FileNotFoundError as e:
    error = str(e)
print(json.dumps({
    "paths": [model.path, model.tokenizer_path, cfg.critic.model.path],
    "weights_equal": lm.state_dict().keys() == want.keys() and all(torch.equal(v, want[k])
                                                                   for k, v in lm.state_dict().items()),
    "tokens_equal": load_tokenizer(model)(text).input_ids == AutoTokenizer.from_pretrained(source)(text).input_ids,
    "error": error}))
"""


def test_hub_id_loads_offline_from_the_cache(hub_cache):
    """With HF_HUB_OFFLINE=1 and the model in the cache, every model key resolves to the cached snapshot, and
    the policy and tokenizer load from it; a hub id not in the cache is one error naming the key, the id and
    HF_HUB_OFFLINE."""
    proc = subprocess.run([sys.executable, "-c", OFFLINE_LOAD, hub_cache.id, hub_cache.source], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **hub_cache.env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["paths"] == [hub_cache.snapshot] * 3
    assert out["weights_equal"] and out["tokens_equal"]
    assert "actor_rollout_ref.model.path='pyrl-test/not-cached'" in out["error"]
    assert "HF_HUB_OFFLINE=1" in out["error"] and hub_cache.env["HF_HUB_CACHE"] in out["error"]


def test_missing_hub_id_stops_the_run_before_workers_start(hub_cache, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pyrl.ppo", "actor_rollout_ref.model.path=nobody/no-such-model",
                           f"trainer.default_local_dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **hub_cache.env, "WANDB_MODE": "offline"})
    assert proc.returncode != 0
    assert "actor_rollout_ref.model.path='nobody/no-such-model' is neither a local directory nor" in proc.stderr
    assert "HF_HUB_OFFLINE=1" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


def test_local_paths_and_pyrl_models(tmp_path):
    from pyrl.models import tiny_model_path

    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("pyrl:tiny") == tiny_model_path()
    with pytest.raises(FileNotFoundError, match=r"critic.model.path='/no/such/dir': no such directory"):
        resolve_model_path("/no/such/dir", "critic.model.path")
    with pytest.raises(ValueError, match="reward_model.model.path is empty"):
        resolve_model_path("", "reward_model.model.path")
    with pytest.raises(ValueError, match=r"model paths on remote file systems .*: not implemented in pyrl "
                                         r"\(actor_rollout_ref.model.path=hdfs://nn/models/q asks for it"):
        resolve_model_path("hdfs://nn/models/q", "actor_rollout_ref.model.path")  # verl copies it to local disk
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("gpt2")
    assert not any(is_hub_id(p) for p in ("./model", "/abs/model", "~/model", "a/b/c", "bad id/x"))
