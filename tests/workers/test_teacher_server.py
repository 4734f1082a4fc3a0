"""Distillation's teachers in a pool of their own (pyrl.workers.teacher_server): real TeacherServer processes (Ray
actors, as the run places them) score the student's sequences as float64 transformers does, with pyrl's hf engine
and with vLLM (prompt_logprobs, as verl 0.9.1's teacher server): the top-k ids and log-probs (forward_kl_topk) and
the sampled tokens' log-probs (k3), 0 after each response (an empty response included); with several teachers each
row goes to the teacher its data_source names, and one teacher's rows spread over its replicas."""

import pytest
import torch
from test_distillation_worker import ROWS, K, hf_logits, keyed
from worker_helpers import hf_response_logprobs, make_config, random_batch

from pyrl.controller import ResourcePool, WorkerGroup
from pyrl.workers.teacher_server import ranks_of, replica_of, score_batch, spread, top_entries

POOL = ["distillation.enabled=true", "distillation.nnodes=1", "distillation.n_gpus_per_node=1",
        "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=1",
        f"distillation.distillation_loss.topk={K}"]


def pool_config(teacher_path, engine, *overrides):
    return make_config(*POOL, f"distillation.teacher_models.teacher_model.model_path={teacher_path}",
                       f"distillation.teacher_models.teacher_model.inference.name={engine}", *overrides)


def served_processes(config) -> int:
    from pyrl.trainer.run_plan import teacher_pool

    return teacher_pool(config).world_size


def served(config):
    """The run's teacher servers (TeacherServer x the pool's processes) on CPU."""
    from pyrl.workers.teacher_server import TeacherServer

    wg = WorkerGroup(ResourcePool([served_processes(config)]), TeacherServer, config.distillation,
                     group_name="teacher_server", init_distributed=False)
    wg.init_model()
    return wg


def assert_topk_equals_hf(out, path, batch, rows, atol):
    mask = batch.batch["response_mask"].bool()
    with torch.no_grad():
        values, ids = hf_logits(path, batch)[1].log_softmax(-1).topk(K, dim=-1)
    for r in rows:
        assert torch.equal(out.batch["teacher_topk_ids"][r][mask[r]], ids[r][mask[r]]), (path, r)
        torch.testing.assert_close(out.batch["teacher_topk_log_probs"][r][mask[r]].double(), values[r][mask[r]],
                                   atol=atol, rtol=0)
        assert not out.batch["teacher_topk_log_probs"][r][~mask[r]].any()
        assert not out.batch["teacher_topk_ids"][r][~mask[r]].any()


@pytest.mark.parametrize("engine, tensor_parallel", [("hf", 1), ("vllm", 1), ("vllm", 2)])
def test_a_served_teacher_scores_as_float64_transformers(ray_session, teacher_path, engine, tensor_parallel):
    """tensor_parallel 2 (verl's default replica): one server process, vLLM's own worker per device (on CPU two
    workers sharing the cores)."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    atol = 1e-5 if engine == "hf" else 1e-4  # vLLM's CPU kernels sum in another order
    batch = random_batch(ROWS, seed=31)
    mask = batch.batch["response_mask"].bool()
    replica = [f"distillation.n_gpus_per_node={tensor_parallel}",
               f"distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size={tensor_parallel}"]
    configs = {loss_mode: pool_config(teacher_path, engine, f"distillation.distillation_loss.loss_mode={loss_mode}",
                                      "distillation.teacher_models.teacher_model.inference.dtype=float32", *replica)
               for loss_mode in ("forward_kl_topk", "k3")}
    assert served_processes(configs["k3"]) == 1
    wg = served(configs["forward_kl_topk"])  # one server answers both (the top k, or the sampled token's)
    try:
        topk, sampled = (score_batch(wg, configs[mode].distillation, batch) for mode in ("forward_kl_topk", "k3"))
        with pytest.raises(Exception, match=r"topk=-1: 0 \(the sampled tokens\) up to"):
            wg.score([[[1, 2]]], [[1]], [-1])
    finally:
        wg.kill()
    assert topk.batch["teacher_topk_log_probs"].shape == batch.batch["responses"].shape + (K,)
    assert_topk_equals_hf(topk, teacher_path, batch, range(ROWS), atol)
    logp, _ = hf_response_logprobs(teacher_path, batch)
    torch.testing.assert_close(sampled.batch["teacher_log_probs"][mask].double(), logp[mask], atol=atol, rtol=0)
    assert not sampled.batch["teacher_log_probs"][~mask].any()


def test_two_teachers_route_by_key_and_one_spreads_over_its_replicas(ray_session, teacher_path, tiny_path):
    """Pool of 3 devices: the noisy teacher 2 replicas, pyrl:tiny 1 (verl's num_replicas); every row scored by its
    own teacher, the noisy teacher's rows split between its two servers; a row naming no teacher stops the pass."""
    config = make_config("distillation.enabled=true", "distillation.nnodes=1", "distillation.n_gpus_per_node=3",
                         "distillation.distillation_loss.loss_mode=forward_kl_topk",
                         f"distillation.distillation_loss.topk={K}",
                         *(f"distillation.teacher_models.{name}.{key}={value}"
                           for name, path, replicas in (("noisy", teacher_path, 2), ("tiny", tiny_path, 1))
                           for key, value in (("model_path", path), ("key", name), ("num_replicas", replicas),
                                              ("inference.name", "hf"), ("inference.dtype", "float32"),
                                              ("inference.tensor_model_parallel_size", 1))))
    assert ranks_of(config.distillation) == [[0, 1], [2]]
    assert [replica_of(config.distillation, r)[::2] for r in range(3)] == [("noisy", 0), ("noisy", 1), ("tiny", 0)]
    keys = ["noisy", "tiny", "noisy", "noisy", "tiny", "noisy", "noisy", "noisy"]
    batch = keyed(random_batch(ROWS, seed=33), keys)
    wg = served(config)
    try:
        described = wg.describe()
        out = score_batch(wg, config.distillation, batch)
        with pytest.raises(ValueError, match=r"row 2's data_source='math' is no teacher's key"):
            score_batch(wg, config.distillation, keyed(random_batch(ROWS, seed=33), keys[:2] + ["math"] + keys[3:]))
    finally:
        wg.kill()
    assert [d.split(" (")[0] for d in described] == ["noisy replica 0", "noisy replica 1", "tiny replica 0"]
    assert_topk_equals_hf(out, teacher_path, batch, [r for r, k in enumerate(keys) if k == "noisy"], 1e-5)
    assert_topk_equals_hf(out, tiny_path, batch, [r for r, k in enumerate(keys) if k == "tiny"], 1e-5)


def test_rows_spread_over_replicas_by_tokens():
    tokens = [10, 1, 7, 3, 3, 9]
    parts = spread([0, 2, 3, 4, 5], tokens, 2)
    assert sorted(r for p in parts for r in p) == [0, 2, 3, 4, 5]
    assert [sum(tokens[r] for r in p) for p in parts] == [16, 16]  # 10+3+3 and 9+7
    assert spread([], tokens, 3) == [[], [], []]


class Entry:  # vLLM's Logprob: a log-prob and its rank
    def __init__(self, logprob, rank):
        self.logprob, self.rank = logprob, rank


def test_top_entries_read_vllm_prompt_logprobs_by_rank():
    # the prompt's own token (id 9) ranks 5th, beyond k = 2: vLLM adds it, verl drops it
    position = {9: Entry(-3.0, 5), 4: Entry(-0.5, 2), 7: Entry(-0.1, 1)}
    assert top_entries(position, 2) == ([7, 4], [-0.1, -0.5])
    with pytest.raises(RuntimeError, match="rank <= 3"):
        top_entries(position, 3)
