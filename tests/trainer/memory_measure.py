"""Measured peak memory of the actor worker's phases on CPU, against the memory plan's estimate
(pyrl/trainer/memory_plan.py). Used by tests/trainer/test_memory_plan.py and benchmarks/memory_plan_accuracy.py.

How it measures: each configuration runs in a fresh Python process holding one ActorRolloutRefWorker (role
"actor": the FSDP-less single-process path, master float32) that runs the real update and log-prob code. A phase's
transient is the process's peak resident set during the phase minus its resident set just before: the kernel's
high-water mark (VmHWM) is reset to the current RSS through /proc/self/clear_refs ("5") before the phase and read
after it, so earlier phases (loading, warm-up) never mask a later one (as ru_maxrss, a lifetime maximum, would).
glibc's malloc is pinned to return every allocation above 64 KiB to the kernel on free (MALLOC_MMAP_THRESHOLD_, which
also stops its threshold from adapting upwards): a freed tensor then leaves the resident set at once, so the resident
set follows the live tensors, which is what the plan counts. Resident state (weights, gradients, AdamW's moments)
is what the RSS loses when the worker (after a warm-up update) is dropped. torch.profiler's memory events would
count the allocator's tensors exactly but miss what the kernel sees (the pages a RAM check is about), and
tracemalloc sees no torch allocation at all.

Run as a script: python memory_measure.py '<json spec>' prints one JSON line of measurements.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def make_model(path: str, hidden: int, layers: int, intermediate: int, vocab: int, heads: int = 4,
               kv_heads: int = 2) -> str:
    """A random Qwen2 checkpoint (head_dim 64, untied head) with pyrl's tiny tokenizer, made locally."""
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pyrl.models import tiny_model_path

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                         vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tiny = str(tiny_model_path())
    for name in os.listdir(tiny):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(os.path.join(tiny, name), path)
    return path


def config_overrides(spec: dict) -> list[str]:
    """The run's keys for a spec: one rank, rows = data.train_batch_size samples (rollout.n = 1), one mini-batch."""
    rows, micro = spec["rows"], spec["micro"]
    return [f"actor_rollout_ref.model.path={spec['model']}", "actor_rollout_ref.rollout.name=hf",
            f"data.max_prompt_length={spec['prompt']}", f"data.max_response_length={spec['response']}",
            f"data.train_batch_size={rows}", "actor_rollout_ref.rollout.n=1",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={rows}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
            f"actor_rollout_ref.model.enable_gradient_checkpointing={spec['checkpointing']}",
            f"actor_rollout_ref.model.use_fused_kernels={spec['fused']}",
            "actor_rollout_ref.actor.fsdp_config.dtype=float32", "actor_rollout_ref.rollout.dtype=float32",
            f"actor_rollout_ref.model.lora_rank={spec.get('lora', 0)}"]


def resolved_config(overrides: list[str]):
    from omegaconf import OmegaConf

    from pyrl.config import PPOConfig

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PPOConfig), OmegaConf.from_dotlist(overrides)))


def estimate(spec: dict) -> dict:
    """The memory plan's numbers for the measured process (one process, no process group: nothing gathered)."""
    from transformers import AutoConfig

    from pyrl.trainer.memory_plan import ModelShape, plan
    from pyrl.trainer.run_plan import resolve_run_plan

    config = resolved_config(config_overrides(spec))
    config.critic.enable = False  # the measured process holds the actor alone
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(spec["model"]),
                                      model_config=config.actor_rollout_ref.model)
    result = plan(config, resolve_run_plan(config), {"actor": shape}, capacity=1 << 50, distributed=False)
    phases = {p.name: p for p in result.phases}
    held = lambda name: sum(t.bytes for t in phases[name].resident if t.name.startswith("actor "))  # noqa: E731
    transient = lambda name: sum(t.bytes for t in phases[name].transient)  # noqa: E731
    resident = held("old_log_prob")  # weights and AdamW's moments (the update frees its gradients after its step)
    # measured from the resident set before the phase
    return {"resident": resident, "update_actor": held("update_actor") + transient("update_actor") - resident,
            "old_log_prob": transient("old_log_prob")}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _phase_peak(run) -> int:
    """Peak resident bytes above the resident set before `run()`."""
    import gc

    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    run()
    return _status("VmHWM") - before


def _batch(spec: dict):
    """Every row a full prompt and a full response (the plan's worst case), as a rollout returns them."""
    import torch

    from pyrl.protocol import DataProto

    g = torch.Generator().manual_seed(0)
    rows, width = spec["rows"], spec["prompt"] + spec["response"]
    ids = torch.randint(3, 280, (rows, width), generator=g)
    return DataProto.from_dict({
        "input_ids": ids, "attention_mask": torch.ones(rows, width, dtype=torch.int64),
        "position_ids": torch.arange(width).expand(rows, width).clone(), "responses": ids[:, spec["prompt"]:],
        "response_mask": torch.ones(rows, spec["response"], dtype=torch.int64),
        "advantages": torch.randn(rows, spec["response"], generator=g),
        "old_log_probs": -torch.rand(rows, spec["response"], generator=g) * 5,
    }, meta_info={"temperature": 1.0})


def _read_frozen_weights(module) -> None:
    """A frozen (LoRA) weight loaded from safetensors stays a view of the file's mapping, whose untouched pages (the
    embedding rows no batch looks up) are not resident, unlike a trained weight (a private copy from its first
    optimizer step): read them all, as the plan counts them. In a function, so no loop variable keeps a weight (and
    with it the whole file's storage) alive after the worker is dropped."""
    import torch

    with torch.no_grad():
        for param in module.parameters():
            if not param.requires_grad:
                param.sum()


def measure_here(spec: dict) -> dict:
    """In this process: the transients of an update and a log-prob pass, and the worker's resident state (what
    the resident set loses when the worker is dropped: its tensors, not the libraries it imported)."""
    import gc

    import torch

    from pyrl.workers.actor import ActorRolloutRefWorker

    torch.set_num_threads(spec.get("threads", 1))
    config = resolved_config(config_overrides(spec))
    batch = _batch(spec)
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, "actor")
    worker.init_model()
    _read_frozen_weights(worker.policy)
    worker.update_actor(batch)  # the first step allocates the gradients and AdamW's moments
    worker.compute_log_prob(batch)
    # the worker is bound into each lambda (which goes away after its call), so that `del worker` below drops it
    out = {"update_actor": _phase_peak(lambda worker=worker: worker.update_actor(batch)),
           "old_log_prob": _phase_peak(lambda worker=worker: worker.compute_log_prob(batch))}
    gc.collect()
    held = _status("VmRSS")
    del worker
    gc.collect()
    return {"resident": held - _status("VmRSS"), **out}


def measure(spec: dict, timeout: float = 600) -> dict:
    """measure_here in a fresh process with malloc pinned (see the module docstring)."""
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, os.path.join(here, "memory_measure.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **MALLOC_ENV})
    if proc.returncode:
        raise RuntimeError(f"memory_measure.py failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(measure_here(json.loads(sys.argv[1]))))
