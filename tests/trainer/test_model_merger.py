"""Checkpoints as Hugging Face models: save_contents with hf_model (verl's <checkpoint>/huggingface) and
`python -m pyrl.model_merger` (verl's command line), on a real one-step run started offline from a hub id."""

import os
import subprocess
import sys

import pytest
import torch
from trainer_helpers import SMALL, compose, run_cli

WITH_HF = "[model,optimizer,extra,hf_model]"


@pytest.fixture(scope="module")
def step_dir(hub_cache, tmp_path_factory):
    """global_step_1 of a GAE run (actor and critic) from the cached hub model, with HF_HUB_OFFLINE=1."""
    run_dir = tmp_path_factory.mktemp("run")
    args = [a for a in SMALL if not a.startswith("actor_rollout_ref.model.path=")] + [
        f"actor_rollout_ref.model.path={hub_cache.id}", "actor_rollout_ref.rollout.name=hf",
        "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.optim.lr=0.002", "trainer.total_training_steps=1",
        "trainer.save_freq=1", f"actor_rollout_ref.actor.checkpoint.save_contents={WITH_HF}",
        f"critic.checkpoint.save_contents={WITH_HF}", f"trainer.default_local_dir={run_dir}"]
    proc = run_cli(args, cwd=run_dir, env=hub_cache.env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hub_cache.snapshot in (run_dir / "config.yaml").read_text()  # the workers got the cached snapshot
    return run_dir / "global_step_1"


def merger(*args, cwd):
    return subprocess.run([sys.executable, "-m", "pyrl.model_merger", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_hf_model_in_the_checkpoint(step_dir, hub_cache):
    from transformers import AutoModelForCausalLM

    for role in ("actor", "critic"):
        assert {"config.json", "model.safetensors",
                "tokenizer.json"} <= set(os.listdir(step_dir / role / "huggingface"))
    assert (step_dir / "actor" / "huggingface" / "generation_config.json").exists()
    assert not [p for p in step_dir.rglob("*.tmp")]
    trained = AutoModelForCausalLM.from_pretrained(step_dir / "actor" / "huggingface", dtype=torch.float32).state_dict()
    start = AutoModelForCausalLM.from_pretrained(hub_cache.source, dtype=torch.float32).state_dict()
    assert trained.keys() == start.keys() and any(not torch.equal(v, start[k]) for k, v in trained.items())


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_merge_gives_the_trained_model(step_dir, tmp_path, role):
    """The merged directory loads with transformers and equals the model the worker exported at the save (its
    own weights, gathered from the live FSDP model): the same weights, so the same logits; `test` agrees."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    local_dir, target = step_dir / role, tmp_path / "merged"
    proc = merger("merge", "--backend", "fsdp", "--local_dir", str(local_dir), "--target_dir", str(target),
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = set(os.listdir(target))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert ("generation_config.json" in files) == (role == "actor")
    cls = AutoModelForCausalLM if role == "actor" else AutoModelForTokenClassification
    merged = cls.from_pretrained(target, dtype=torch.float32)
    saved = cls.from_pretrained(local_dir / "huggingface", dtype=torch.float32)
    want = saved.state_dict()
    assert merged.state_dict().keys() == want.keys()
    for key, value in merged.state_dict().items():
        assert torch.equal(value, want[key]), key
    tokenizer = AutoTokenizer.from_pretrained(target)
    ids = tokenizer(["<|im_start|>user\n12+34=<|im_end|>"], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(merged(ids).logits, saved(ids).logits)

    proc = merger("test", "--backend", "fsdp", "--local_dir", str(local_dir), "--test_hf_dir", str(target),
                  cwd=tmp_path)
    assert proc.returncode == 0 and "checks passed" in proc.stdout, proc.stderr[-3000:]


def test_merger_errors(step_dir, tmp_path):
    for local_dir in (tmp_path / "missing", step_dir):  # step_dir: the step, not its actor/ or critic/
        proc = merger("merge", "--backend", "fsdp", "--local_dir", str(local_dir),
                      "--target_dir", str(tmp_path / "out"), cwd=tmp_path)
        assert proc.returncode != 0 and f"--local_dir {str(local_dir)!r}: not a pyrl checkpoint" in proc.stderr
    proc = merger("merge", "--backend", "megatron", "--local_dir", str(step_dir / "actor"), cwd=tmp_path)
    assert proc.returncode != 0 and "pyrl saves FSDP checkpoints" in proc.stderr


def test_checkpoint_without_hf_model_keeps_config_and_tokenizer(tmp_path):
    """The default save_contents: <checkpoint>/huggingface holds what the merger needs besides the shards (the
    config, generation config and tokenizer), not the weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyrl.models import tiny_model_path
    from pyrl.workers.checkpoint import write_hf

    path = tiny_model_path()
    write_hf(str(tmp_path), AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), rank=0)
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(os.listdir(tmp_path))
    assert not [f for f in os.listdir(tmp_path) if f.endswith((".safetensors", ".bin"))]


def test_checkpoint_contents_are_checked():
    from pyrl.config import check_supported

    base = [a for a in SMALL if not a.startswith("actor_rollout_ref.model.path=")]
    check_supported(compose(*base, f"actor_rollout_ref.actor.checkpoint.save_contents={WITH_HF}",
                            f"critic.checkpoint.save_contents={WITH_HF}"))  # load_contents follows: hf_model ignored
    for key, value in (("actor_rollout_ref.actor.checkpoint.save_contents", "[model,optimizer,extra,foo]"),
                       ("critic.checkpoint.load_contents", "[model]")):
        with pytest.raises(ValueError, match=f"{key}=.* is not supported"):
            check_supported(compose(*base, f"{key}={value}"))


VLLM_GREEDY = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=64, seed=0)
out = llm.generate([TokensPrompt(prompt_token_ids=json.loads(sys.argv[2]))],
                   SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
print(json.dumps(list(out[0].outputs[0].token_ids)))
"""


def test_vllm_loads_the_merged_actor(step_dir, tmp_path):
    """vLLM serves the merged directory: its greedy tokens are transformers' greedy tokens."""
    pytest.importorskip("vllm")
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tmp_path / "merged"
    proc = merger("merge", "--backend", "fsdp", "--local_dir", str(step_dir / "actor"), "--target_dir", str(target),
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = AutoTokenizer.from_pretrained(target)("<|im_start|>user\n12+34=<|im_end|>").input_ids
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", VLLM_GREEDY, str(target), json.dumps(ids)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads(proc.stdout.strip().splitlines()[-1])
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                  min_new_tokens=6)[0, len(ids):]
    assert served == expected.tolist()
