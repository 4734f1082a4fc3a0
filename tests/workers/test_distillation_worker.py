"""On-policy distillation in the actor worker: the teacher pass against float64 HF, and one update's loss, metrics
and gradient (Adam's first moment after one step is 0.1 x the gradient) against float64 autograd of verl 0.9.1's
formulas (transcribed in tests/algos/test_distillation_verl091.py); two ranks give the single process's metrics."""

import pytest
import torch
from worker_helpers import RESPONSE_WIDTH, hf_response_logprobs, make_config, random_batch

from pyrl.controller import ResourcePool, WorkerGroup
from pyrl.workers.actor import ActorRolloutRefWorker

ROWS, K = 8, 5


def distill_config(teacher_path, *overrides):
    return make_config("distillation.enabled=true",
                       f"distillation.teacher_models.teacher_model.model_path={teacher_path}",
                       f"distillation.distillation_loss.topk={K}", "actor_rollout_ref.actor.optim.lr=1e-4",
                       "actor_rollout_ref.actor.optim.clip_grad=1e9",
                       f"actor_rollout_ref.actor.ppo_mini_batch_size={ROWS}",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", *overrides)


def verl_transcriptions():
    """tests/algos/test_distillation_verl091.py, whose float64 transcriptions of verl 0.9.1 these tests reuse."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).parents[1] / "algos" / "test_distillation_verl091.py"
    if str(path.parent) not in sys.path:  # it imports its neighbour's transcriptions, as pytest lets it there
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location("verl091_distillation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(config):
    w = ActorRolloutRefWorker(config.actor_rollout_ref, "actor", config.distillation)
    w.init_model()
    return w


def hf_logits(path, batch, requires_grad=False):
    """float64 HF model and its logits [B, R, V] at the positions that predict the responses."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    model.requires_grad_(requires_grad)
    logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                   position_ids=batch.batch["position_ids"]).logits
    return model, logits[:, -RESPONSE_WIDTH - 1:-1]


def test_teacher_pass_equals_hf(teacher_path):
    batch = random_batch(ROWS, seed=21)
    mask = batch.batch["response_mask"].bool()
    topk = worker(distill_config(teacher_path, "distillation.distillation_loss.loss_mode=forward_kl_topk"))
    out = topk.compute_teacher_log_probs(batch)
    assert out.batch["teacher_topk_log_probs"].shape == (ROWS, RESPONSE_WIDTH, K)
    with torch.no_grad():
        reference = hf_logits(teacher_path, batch)[1].log_softmax(-1)  # temperature 1 whatever the rollout's
    values, ids = reference.topk(K, dim=-1)
    assert torch.equal(out.batch["teacher_topk_ids"][mask], ids[mask])
    torch.testing.assert_close(out.batch["teacher_topk_log_probs"][mask].double(), values[mask], atol=1e-5, rtol=0)
    assert out.batch["teacher_topk_log_probs"][~mask].abs().max() == 0
    sampled = worker(distill_config(teacher_path)).compute_teacher_log_probs(batch)  # k3: the sampled token's
    logp, _ = hf_response_logprobs(teacher_path, batch)
    torch.testing.assert_close(sampled.batch["teacher_log_probs"][mask].double(), logp[mask], atol=1e-5, rtol=0)


def _first_moments(w):
    return {name[len("lm."):-len(".exp_avg")]: value for name, value in w.state_digest()["optimizer"].items()
            if name.endswith(".exp_avg")}


def _check_gradient(w, model, reference_loss):
    reference_loss.backward()
    moments = _first_moments(w)
    checked = 0
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(moments[name].double(), 0.1 * param.grad, atol=1e-8, rtol=2e-3, msg=name)
            checked += 1
    assert checked >= 20


def test_topk_supervised_update_equals_float64(teacher_path, tiny_path):
    """forward_kl_topk, no task rewards, both clamps, temperature 0.8 for the student, on-policy: the loss, its
    metrics and the gradient equal float64 autograd of verl's formula over the mini-batch's tokens."""
    verl_forward_kl_topk = verl_transcriptions().verl_forward_kl_topk
    config = distill_config(teacher_path, "distillation.distillation_loss.loss_mode=forward_kl_topk",
                            "distillation.distillation_loss.use_task_rewards=false",
                            "distillation.distillation_loss.log_prob_min_clamp=-6.0",
                            "distillation.distillation_loss.loss_max_clamp=1.0")
    w = worker(config)
    batch = random_batch(ROWS, seed=22)
    batch.meta_info["temperature"] = 0.8
    batch.union(w.compute_teacher_log_probs(batch))
    batch.batch["advantages"] = torch.zeros(ROWS, RESPONSE_WIDTH)
    metrics = w.update_actor(batch).meta_info["metrics"]
    model, logits = hf_logits(tiny_path, batch, requires_grad=True)
    mask = batch.batch["response_mask"].double()
    t_logp, t_ids = batch.batch["teacher_topk_log_probs"].double(), batch.batch["teacher_topk_ids"]
    losses, s_mass, _, count, adv = verl_forward_kl_topk(logits / 0.8, t_logp, t_ids, -6.0)
    reference = (losses.clamp(-1.0, 1.0) * mask).sum() / mask.sum()
    picked = losses[mask.bool()].detach()
    assert metrics["actor/distillation/loss"] == pytest.approx(reference.item(), rel=1e-4)
    assert metrics["actor/distillation/loss_max"] == pytest.approx(picked.max().item(), rel=1e-4)
    assert metrics["actor/distillation/loss_min"] == pytest.approx(picked.min().item(), abs=1e-5)
    assert metrics["actor/distillation/student_mass"] == pytest.approx(((s_mass * mask).sum() / mask.sum()).item(),
                                                                       rel=1e-4)
    assert metrics["actor/distillation/overlap_ratio"] == pytest.approx(
        ((count / K * mask).sum() / mask.sum()).item(), rel=1e-4)
    overlap = mask.bool() & (count > 0)
    assert metrics["actor/distillation/overlap_token_advantage"] == pytest.approx(adv[overlap].mean().item(),
                                                                                  rel=1e-3, abs=1e-6)
    assert "actor/pg_loss" not in metrics  # no policy loss without task rewards (verl's distillation-only)
    _check_gradient(w, model, reference)


def test_task_rewards_plus_policy_gradient_distillation_equals_float64(teacher_path, tiny_path):
    """k3 as PPO advantages (use_policy_gradient) beside the task's, distillation_loss_coef 0.5, on-policy (ratio
    1): the gradient of  mean(-A r) + 0.5 mean(d r)  with r = exp(logp - sg(logp)), d = k3(student, teacher)."""
    config = distill_config(teacher_path, "distillation.distillation_loss.use_policy_gradient=true",
                            "distillation.distillation_loss.distillation_loss_coef=0.5")
    w = worker(config)
    batch = random_batch(ROWS, seed=23)
    batch.union(w.compute_teacher_log_probs(batch))
    g = torch.Generator().manual_seed(24)
    batch.batch["advantages"] = torch.randn(ROWS, RESPONSE_WIDTH, generator=g) * batch.batch["response_mask"]
    metrics = w.update_actor(batch).meta_info["metrics"]
    model, logits = hf_logits(tiny_path, batch, requires_grad=True)
    mask = batch.batch["response_mask"].double()
    logp = logits.log_softmax(-1).gather(-1, batch.batch["responses"][..., None])[..., 0]
    ratio = torch.exp(logp - logp.detach())
    teacher = batch.batch["teacher_log_probs"].double()
    kl = (teacher - logp).clamp(-20, 20)
    d = (kl.exp() - kl - 1).clamp(-10, 10).detach()

    def mean(x):
        return (x * mask).sum() / mask.sum()

    reference = mean(-batch.batch["advantages"].double() * ratio) + 0.5 * mean(d * ratio)
    assert metrics["actor/pg_loss"] == pytest.approx(mean(-batch.batch["advantages"].double()).item(), rel=1e-4)
    assert metrics["actor/distillation/loss"] == pytest.approx(mean(d).item(), rel=1e-4)
    assert metrics["actor/distillation/pg_clipfrac"] == 0.0
    _check_gradient(w, model, reference)


def test_two_ranks_report_the_single_process_metrics(ray_session, teacher_path):
    """Sums, minima and maxima reduced over micro-batches and ranks (token budgets on 2 ranks, 3 rows per
    micro-batch on 1): the same mini-batch metrics and the same teacher scores."""
    overrides = ("distillation.distillation_loss.loss_mode=forward_kl_topk",
                 "distillation.distillation_loss.use_task_rewards=false")
    single = worker(distill_config(teacher_path, *overrides))
    batch = random_batch(ROWS, seed=25)
    scores = single.compute_teacher_log_probs(batch)
    batch.union(scores)
    batch.batch["advantages"] = torch.zeros(ROWS, RESPONSE_WIDTH)
    # rank r holds rows [4r, 4r + 4): one mini-batch of all rows on both sides
    expected = single.update_actor(batch).meta_info["metrics"]
    config = distill_config(teacher_path, *overrides, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20",
                            "distillation.teacher_models.teacher_model.inference.max_num_batched_tokens=16")
    wg = WorkerGroup(ResourcePool([2]), ActorRolloutRefWorker, config.actor_rollout_ref, "actor", config.distillation)
    try:
        wg.init_model()
        sent = batch.to_packed("attention_mask", keys=["input_ids", "position_ids"])  # as the trainer sends it
        group_scores = wg.compute_teacher_log_probs(sent)
        metrics = {k: v[0] for k, v in wg.update_actor(sent).meta_info["metrics"].items()}
    finally:
        wg.kill()
    mask = batch.batch["response_mask"].bool()
    assert torch.equal(group_scores.batch["teacher_topk_ids"][mask], scores.batch["teacher_topk_ids"][mask])
    torch.testing.assert_close(group_scores.batch["teacher_topk_log_probs"], scores.batch["teacher_topk_log_probs"],
                               atol=1e-5, rtol=0)
    names = [k for k in expected if k.startswith("actor/distillation/")]
    assert len(names) == 11
    for name in names + ["actor/grad_norm"]:
        assert metrics[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name


def two_teachers(teacher_path, tiny_path, *overrides):
    """verl 0.9.1's multi-teacher config: rows of data_source "noisy" to the noisy teacher, "tiny" to pyrl:tiny."""
    return make_config("distillation.enabled=true", f"distillation.distillation_loss.topk={K}",
                       "distillation.distillation_loss.loss_mode=forward_kl_topk",
                       f"distillation.teacher_models.noisy.model_path={teacher_path}",
                       "distillation.teacher_models.noisy.key=noisy",
                       f"distillation.teacher_models.tiny.model_path={tiny_path}",
                       "distillation.teacher_models.tiny.key=tiny", *overrides)


def keyed(batch, keys):
    import numpy as np

    batch.non_tensor_batch["data_source"] = np.array(keys, dtype=object)
    return batch


def test_several_teachers_each_score_the_rows_their_key_names(ray_session, teacher_path, tiny_path):
    """Each row's top-k is its own teacher's (float64 HF), chosen by data_source; on 2 ranks one rank routes no row
    to a teacher (it still runs that teacher's collectives) and the scores are the single process's; a row whose
    key is no teacher's stops the pass naming it."""
    keys = ["noisy", "tiny", "tiny", "noisy", "noisy", "noisy", "noisy", "noisy"]  # rank 1's rows: all "noisy"
    batch = keyed(random_batch(ROWS, seed=27), keys)
    mask = batch.batch["response_mask"].bool()
    single = worker(two_teachers(teacher_path, tiny_path))
    assert len(single.teachers) == 2  # the default teacher_model entry dropped, as verl does
    out = single.compute_teacher_log_probs(batch)
    for path, rows in ((teacher_path, [0, 3, 4, 5, 6, 7]), (tiny_path, [1, 2])):
        with torch.no_grad():
            values, ids = hf_logits(path, batch)[1].log_softmax(-1).topk(K, dim=-1)
        for r in rows:
            assert torch.equal(out.batch["teacher_topk_ids"][r][mask[r]], ids[r][mask[r]]), (path, r)
            torch.testing.assert_close(out.batch["teacher_topk_log_probs"][r][mask[r]].double(), values[r][mask[r]],
                                       atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"row 2's data_source='math' is no teacher's key"):
        single.compute_teacher_log_probs(keyed(random_batch(ROWS, seed=27), ["tiny", "noisy", "math"] + keys[3:]))
    config = two_teachers(teacher_path, tiny_path)
    wg = WorkerGroup(ResourcePool([2]), ActorRolloutRefWorker, config.actor_rollout_ref, "actor", config.distillation)
    try:
        wg.init_model()
        group = wg.compute_teacher_log_probs(batch.to_packed("attention_mask", keys=["input_ids", "position_ids"]))
    finally:
        wg.kill()
    assert torch.equal(group.batch["teacher_topk_ids"][mask], out.batch["teacher_topk_ids"][mask])
    torch.testing.assert_close(group.batch["teacher_topk_log_probs"], out.batch["teacher_topk_log_probs"], atol=1e-5,
                               rtol=0)
