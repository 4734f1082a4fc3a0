"""On-policy distillation with the teachers in a pool of their own (distillation.n_gpus_per_node x nnodes, as verl
0.9.1 serves them), end to end: a real run whose teacher scores from its own server process trains exactly as the
same run with the teacher in the actor's workers (the same samples, distillation metrics and update); the plan and
the memory plan place it; the pool's settings verl refuses, or pyrl cannot honour, stop the run at start."""

import json
import logging

import pytest
from trainer.trainer_helpers import SMALL, compose

import pyrl.ppo

DISTILL = ["distillation.enabled=true", "distillation.teacher_models.teacher_model.model_path=pyrl:tiny-wide",
           "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=4",
           "distillation.teacher_models.teacher_model.inference.dtype=float32"]
POOL = ["distillation.nnodes=1", "distillation.n_gpus_per_node=1",
        "distillation.teacher_models.teacher_model.inference.name=hf",
        "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1"]


def run(tmp_path, name, *overrides):
    config = compose(*SMALL, "trainer.total_training_steps=1", "actor_rollout_ref.rollout.name=hf",
                     "actor_rollout_ref.actor.fsdp_config.dtype=float32", "actor_rollout_ref.rollout.dtype=float32",
                     f"trainer.default_local_dir={tmp_path / name}", *DISTILL, *overrides)
    pyrl.ppo.run_ppo(config)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()][-1]


def test_a_teacher_in_its_own_pool_trains_as_the_colocated_one(ray_session, tmp_path):
    colocated = run(tmp_path, "colocated")
    pooled = run(tmp_path, "pooled", *POOL)
    assert "perf/mfu/teacher" in colocated and "perf/mfu/teacher" not in pooled  # the actor's workers scored there
    distilled = [key for key in colocated if key.startswith("actor/distillation/")]
    assert {"actor/distillation/loss", "actor/distillation/teacher_mass", "actor/distillation/overlap_ratio"} \
        <= set(distilled)
    for key in distilled + ["response_length/mean", "actor/grad_norm", "critic/score/mean"]:
        assert pooled[key] == pytest.approx(colocated[key], rel=1e-4, abs=1e-6), key


def plan_of(*overrides):
    from pyrl.ppo import resolve_settings

    config = compose(*SMALL, "trainer.n_gpus_per_node=0", *DISTILL, *overrides)
    return resolve_settings(config), config


def test_the_plan_and_the_memory_plan_place_the_teachers_pool():
    from pyrl.ppo import resolve_model_paths
    from pyrl.trainer.memory_plan import Capacity, memory_plan_of

    plan, config = plan_of("distillation.nnodes=1", "distillation.n_gpus_per_node=4",
                           "distillation.teacher_models.teacher_model.inference.name=vllm")
    # verl's default replica: tensor parallel 2, so 4 devices make 2 replicas, a server process each
    assert (plan.teacher_pool.nnodes, plan.teacher_pool.processes_per_node) == (1, 2)
    assert plan.group_of("teacher").worker.endswith("TeacherServer") and plan.group_of("teacher").pool == "teacher"
    assert "teacher_model 2 replica(s) of 2 device(s)" in dict(plan.why)["teacher"]
    resolve_model_paths(config, plan)  # as the run does before the memory plan
    phases = {p.name: p for p in memory_plan_of(config, plan, Capacity(10 ** 12, "test")).phases}
    assert not any(p.startswith("teacher (") or p == "teacher" for p in phases)  # nothing in the trainer's ranks
    assert "teacher vLLM KV cache" in " ".join(t.name for t in phases["teacher server (its own pool)"].transient)
    assert not any("teacher" in t.name for p in phases.values() if "server" not in p.name for t in p.resident)


@pytest.mark.parametrize("overrides, error", [
    (["distillation.nnodes=1", "distillation.n_gpus_per_node=3"],
     r"distillation.n_gpus_per_node=3: a teacher replica spans 2 device\(s\)"),
    (["distillation.teacher_models.teacher_model.num_replicas=1"],
     r"num_replicas=1: replicas serve from the teachers' own pool, and .* gives none"),
    (["distillation.nnodes=1", "distillation.n_gpus_per_node=2",
      "distillation.teacher_models.teacher_model.inference.name=hf"],
     r"inference.tensor_model_parallel_size=2: pyrl's hf engine runs a replica on one device"),
    (["distillation.nnodes=1", "distillation.n_gpus_per_node=2",
      "distillation.teacher_models.teacher_model.inference.name=hf",
      "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1",
      "distillation.teacher_models.teacher_model.inference.max_num_seqs=8"],
     r"inference.max_num_seqs=8: verl's teacher server option; the teacher's pool serves it with pyrl's hf engine"),
    (["distillation.teacher_models.teacher_model.inference.gpu_memory_utilization=0.3"],
     r"gpu_memory_utilization=0.3: .* scores in the actor's workers \(distillation.nnodes=0\)"),
    (["distillation.nnodes=1", "distillation.n_gpus_per_node=4",
      "+distillation.teacher_models.a.model_path=pyrl:tiny", "+distillation.teacher_models.a.key=a",
      "+distillation.teacher_models.a.num_replicas=1",
      "+distillation.teacher_models.b.model_path=pyrl:tiny", "+distillation.teacher_models.b.key=b",
      "+distillation.teacher_models.b.num_replicas=2"],
     r"num_replicas x replica devices sum to 6; they must fill the pool, .* = 4"),
    (["distillation.nnodes=1", "distillation.n_gpus_per_node=4",
      "+distillation.teacher_models.a.model_path=pyrl:tiny", "+distillation.teacher_models.a.key=a",
      "+distillation.teacher_models.a.num_replicas=2",
      "+distillation.teacher_models.b.model_path=pyrl:tiny", "+distillation.teacher_models.b.key=b",
      "+distillation.teacher_models.b.inference.tensor_model_parallel_size=1",
      "+distillation.teacher_models.b.num_replicas=0"],
     r"replicas of different sizes"),
    (["distillation.nnodes=1", "distillation.n_gpus_per_node=2",
      "distillation.teacher_models.teacher_model.inference.free_cache_engine=false"],
     r"inference.free_cache_engine=False: verl.s teacher server option; pyrl.s vLLM teacher server does not take"),
    (["distillation.nnodes=1", "distillation.n_gpus_per_node=0"],
     r"distillation.nnodes=1 asks for the teachers' own pool, and distillation.n_gpus_per_node=0 gives it no device"),
    (["distillation.nnodes=1", "distillation.n_gpus_per_node=2",
      "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=0"],
     r"inference.tensor_model_parallel_size=0: must be >= 1"),
    (["distillation.nnodes=1", "distillation.n_gpus_per_node=2",
      "+distillation.teacher_models.teacher_model.inference.engine_kwargs.vllm.max_logprobs=2"],
     r"engine_kwargs.vllm.max_logprobs=2 is below distillation.distillation_loss.topk=4"),
])
def test_pool_settings_pyrl_cannot_honour_stop_at_start(overrides, error):
    with pytest.raises((ValueError, NotImplementedError), match=error):
        plan_of(*overrides)


def test_one_teachers_num_replicas_is_set_by_the_pool_as_in_verl(caplog):
    """verl 0.9.1 sets a lone teacher's num_replicas to the pool's replica count whatever was given: taken, with
    one log line, and the plan serves the pool's count."""
    with caplog.at_level(logging.INFO, logger="pyrl"):
        plan, _ = plan_of("distillation.nnodes=1", "distillation.n_gpus_per_node=2",
                          "distillation.teacher_models.teacher_model.num_replicas=3")
    assert "teacher_model 1 replica(s) of 2 device(s)" in dict(plan.why)["teacher"]
    assert any("num_replicas=3: 1 instead, as verl 0.9.1 sets it" in r.getMessage() for r in caplog.records)


def test_a_vllm_teacher_pool_without_vllm_stops_at_start(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"teacher_model.inference.name=vllm, but vLLM is not installed here"):
        plan_of("distillation.nnodes=1", "distillation.n_gpus_per_node=2",
                "distillation.teacher_models.teacher_model.inference.name=vllm")
