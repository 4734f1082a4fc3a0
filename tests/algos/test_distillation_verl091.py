"""On-policy distillation's losses (pyrl.algos.distillation, pyrl.workers.policy.topk_log_probs) against float64
transcriptions of verl 0.9.1's trainer/distillation/losses.py, trainer/distillation/fsdp/losses.py and
core_algos.kl_penalty, on fresh random inputs with all-masked rows, clamps and gradients; and the start checks."""

import dataclasses

import pytest
import torch
from test_policy_losses_verl091 import verl_vanilla  # core_algos.compute_policy_loss_vanilla, transcribed

from pyrl.algos import distillation as D
from pyrl.config import DistillationConfig, DistillationLossConfig, PPOConfig, TeacherModelConfig
from pyrl.workers.policy import topk_log_probs

# ---- verl 0.9.1, transcribed (float64) ----


def verl_kl_penalty(logprob, ref_logprob, mode):
    """core_algos.kl_penalty_forward (0.9.1)."""
    if mode in ("kl", "k1"):
        return logprob - ref_logprob
    if mode == "abs":
        return (logprob - ref_logprob).abs()
    if mode in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if mode in ("low_var_kl", "k3"):
        kl = (ref_logprob - logprob).clamp(min=-20, max=20)
        ratio = torch.exp(kl)
        return (ratio - kl - 1).clamp(min=-10, max=10)
    raise ValueError(mode)


def verl_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, log_prob_min_clamp):
    """fsdp/losses.compute_forward_kl_topk (the default, unchunked path) + losses.compute_forward_kl_topk's clamp."""
    student_log_probs = torch.log_softmax(student_logits, dim=-1)
    student_topk_ids = torch.topk(student_log_probs, k=teacher_topk_ids.shape[-1], dim=-1).indices
    student_topk_log_probs = torch.gather(student_log_probs, dim=-1, index=teacher_topk_ids)
    student_mass = student_topk_log_probs.exp().sum(dim=-1)
    teacher_mass = teacher_topk_log_probs.exp().sum(dim=-1)
    if log_prob_min_clamp is not None:
        student_topk_log_probs = student_topk_log_probs.clamp_min(log_prob_min_clamp)
        teacher_topk_log_probs = teacher_topk_log_probs.clamp_min(log_prob_min_clamp)
    p = teacher_topk_log_probs.exp()
    losses = (p * (teacher_topk_log_probs - student_topk_log_probs)).sum(-1)
    overlap_mask = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(dim=-1)
    overlap_count = overlap_mask.sum(dim=-1)
    token_kl = teacher_topk_log_probs.exp() * (teacher_topk_log_probs - student_topk_log_probs)
    adv = (-token_kl * overlap_mask).sum(dim=-1) / overlap_count.clamp_min(1)
    adv = torch.where(overlap_count > 0, adv, torch.zeros_like(adv))
    return losses.clamp_min(0.0), student_mass, teacher_mass, overlap_count, adv


def token_mean(values, mask):
    return (values * mask).sum() / mask.sum()


# ---- shared inputs ----

B, T, V, K = 5, 7, 40, 6


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    student_logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    teacher_logits = student_logits + torch.randn(B, T, V, generator=g, dtype=torch.float64) * 1.5
    teacher_log_probs = teacher_logits.log_softmax(-1)
    teacher_topk_log_probs, teacher_topk_ids = teacher_log_probs.topk(K, dim=-1)
    mask = (torch.rand(B, T, generator=g) < 0.8).double()
    mask[1] = 0  # an all-masked row
    mask[0, 0] = 1
    return student_logits, teacher_topk_log_probs, teacher_topk_ids, mask, teacher_log_probs


def info(mask):
    return {"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": mask.shape[0],
            "response_tokens": int(mask.sum())}


@dataclasses.dataclass
class Actor:
    loss_agg_mode: str = "token-mean"


@pytest.mark.parametrize("mode", D.ESTIMATOR_MODES)
def test_estimator_losses_equal_verl(mode):
    g = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(B, T, generator=g) * 3, torch.randn(B, T, generator=g) * 3
    torch.testing.assert_close(D.estimator_losses(student, teacher, mode).double(),
                               verl_kl_penalty(student.double(), teacher.double(), mode), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("clamp", [None, -3.0])
def test_forward_kl_topk_equals_verl(clamp):
    student_logits, t_logp, t_ids, mask, _ = batch(2)
    s_logp = student_logits.log_softmax(-1).gather(-1, t_ids)
    s_ids = student_logits.topk(K, dim=-1).indices
    out = D.forward_kl_topk_losses(s_logp, t_logp, clamp)
    losses, s_mass, t_mass, count, adv = verl_forward_kl_topk(student_logits, t_logp, t_ids, clamp)
    torch.testing.assert_close(out["distillation_losses"].double(), losses, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["student_mass"].double(), s_mass, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out["teacher_mass"].double(), t_mass, atol=1e-6, rtol=1e-6)
    mine_count, mine_adv = D.topk_overlap(t_ids, s_ids, out["token_kl"])
    assert torch.equal(mine_count, count)
    torch.testing.assert_close(mine_adv.double(), adv, atol=1e-5, rtol=1e-5)


def test_forward_kl_topk_hand_case_clamped_at_zero():
    """Top-2 masses 0.6 (teacher) and 0.9 (student): 0.5 ln(0.5/0.6) + 0.1 ln(0.1/0.3) = -0.2010 < 0 -> 0; with
    the teacher's 0.1 raised to 0.3 by a clamp at ln 0.3 the sum is 0.5 ln(0.5/0.6) + 0.3 ln(0.3/0.3)."""
    teacher = torch.tensor([[0.5, 0.1]]).log()
    student = torch.tensor([[0.6, 0.3]]).log()
    assert D.forward_kl_topk_losses(student, teacher)["distillation_losses"].item() == 0.0
    swapped = D.forward_kl_topk_losses(teacher, student)["distillation_losses"].item()
    assert swapped == pytest.approx(0.6 * 0.18232155679395462 + 0.3 * 1.0986122886681098, rel=1e-6)
    clamped = D.forward_kl_topk_losses(student, teacher, log_prob_min_clamp=float(torch.tensor(0.3).log()))
    assert clamped["distillation_losses"].item() == 0.0  # 0.5 ln(5/6) + 0.3 * 0 < 0
    assert clamped["teacher_mass"].item() == pytest.approx(0.6)  # masses before the clamp


@pytest.mark.parametrize("chunk", [None, 4])
def test_topk_log_probs_equal_log_softmax_with_gradient(chunk):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, 8, generator=g, dtype=torch.float64)
    reference = (hidden @ weight.t() / 0.7).log_softmax(-1)
    values, ids = topk_log_probs(hidden.detach().float(), weight.float(), 0.7, k=K, chunk_rows=chunk)
    best, best_ids = reference.topk(K, dim=-1)
    assert torch.equal(ids, best_ids)
    torch.testing.assert_close(values.double(), best, atol=1e-5, rtol=1e-5)
    # the student's: log-probs at given ids, differentiable; its own top-k ids
    h32 = hidden.detach().float().requires_grad_(True)
    at, own = topk_log_probs(h32, weight.float(), 0.7, ids=best_ids.flip(-1), chunk_rows=chunk)
    assert torch.equal(own, best_ids)
    upstream = torch.randn(at.shape, generator=g, dtype=torch.float64)
    (at.double() * upstream).sum().backward()
    (reference.gather(-1, best_ids.flip(-1)) * upstream).sum().backward()
    torch.testing.assert_close(h32.grad.double(), hidden.grad, atol=1e-4, rtol=1e-4)
    empty, empty_ids = topk_log_probs(hidden[:0].detach().float(), weight.float(), 1.0, k=K)
    assert empty.shape == (0, K) and empty_ids.shape == (0, K)


def _loss(loss_config, mode_inputs, mask, student_log_probs, old_log_probs):
    return D.distillation_loss(loss_config, Actor(), mask, info(mask), student_log_probs, old_log_probs, mode_inputs)


def test_supervised_topk_loss_value_metrics_and_gradient():
    """loss_mode=forward_kl_topk, use_policy_gradient=false: the token mean of the clamped per-token loss, with
    verl's metrics; its gradient with respect to the student's logits equals float64 autograd of verl's."""
    student_logits, t_logp, t_ids, mask, _ = batch(4)
    cfg = DistillationLossConfig(loss_mode="forward_kl_topk", topk=K, log_prob_min_clamp=-4.0, loss_max_clamp=0.5,
                                 use_task_rewards=False)
    logits32 = student_logits.float().requires_grad_(True)
    logp_all = logits32.log_softmax(-1)
    inputs = {"student_topk_log_probs": logp_all.gather(-1, t_ids), "teacher_topk_log_probs": t_logp.float(),
              "teacher_topk_ids": t_ids, "student_topk_ids": logits32.detach().topk(K, dim=-1).indices}
    loss, metrics = _loss(cfg, inputs, mask.float(), torch.zeros(B, T), torch.zeros(B, T))
    logits64 = student_logits.clone().requires_grad_(True)
    losses, s_mass, t_mass, count, adv = verl_forward_kl_topk(logits64, t_logp, t_ids, -4.0)
    picked = losses[mask.bool()].detach()
    reference = token_mean(losses.clamp(-0.5, 0.5), mask)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert metrics["distillation/loss_min"] == pytest.approx(float(picked.min()), abs=1e-6)
    assert metrics["distillation/loss_max"] == pytest.approx(float(picked.max()), rel=1e-5)  # before the clamp
    assert float(picked.max()) > 0.5  # so the clamp cuts something
    assert metrics["distillation/student_mass"] == pytest.approx(float(token_mean(s_mass, mask)), rel=1e-5)
    assert metrics["distillation/teacher_mass_min"] == pytest.approx(float(t_mass[mask.bool()].min()), rel=1e-5)
    assert metrics["distillation/overlap_ratio"] == pytest.approx(float(token_mean(count.double() / K, mask)),
                                                                  rel=1e-5)
    finished = D.finish_metrics({f"actor/{k}": v for k, v in metrics.items()})
    overlap = mask.bool() & (count > 0)
    assert finished["actor/distillation/overlap_token_advantage"] == pytest.approx(float(adv[overlap].mean()),
                                                                                   rel=1e-4)
    loss.backward()
    reference.backward()
    torch.testing.assert_close(logits32.grad.double(), logits64.grad, atol=1e-6, rtol=1e-4)
    assert logits32.grad[1].abs().max() == 0  # the all-masked row adds nothing


@pytest.mark.parametrize("mode", ["k3", "k2", "abs"])
def test_supervised_estimator_gradient(mode):
    student_logits, _, _, mask, teacher_log_probs = batch(5)
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, V, (B, T), generator=g)
    teacher = teacher_log_probs.gather(-1, tokens[..., None])[..., 0]
    logits32 = student_logits.float().requires_grad_(True)
    student = logits32.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    cfg = DistillationLossConfig(loss_mode=mode, use_task_rewards=False, loss_max_clamp=2.0)
    loss, metrics = _loss(cfg, {"teacher_log_probs": teacher.float()}, mask.float(), student, student.detach())
    logits64 = student_logits.clone().requires_grad_(True)
    s64 = logits64.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    per_token = verl_kl_penalty(s64, teacher, mode)
    reference = token_mean(per_token.clamp(-2.0, 2.0), mask)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert metrics["distillation/abs_loss"] == pytest.approx(float(token_mean(per_token.abs(), mask)), rel=1e-5)
    loss.backward()
    reference.backward()
    torch.testing.assert_close(logits32.grad.double(), logits64.grad, atol=1e-6, rtol=1e-4)


def test_policy_gradient_loss_is_ppo_on_negative_distillation_loss():
    """use_policy_gradient=true: the vanilla PPO-clip loss with advantages -d (detached), the distillation section's
    clip ratios; off-policy old log-probs so that clipping takes part."""
    student_logits, _, _, mask, teacher_log_probs = batch(7)
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, V, (B, T), generator=g)
    teacher = teacher_log_probs.gather(-1, tokens[..., None])[..., 0]
    logits32 = student_logits.float().requires_grad_(True)
    student = logits32.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    old = student.detach() + 0.4 * torch.randn(B, T, generator=g)
    cfg = DistillationLossConfig(loss_mode="k1", use_policy_gradient=True, clip_ratio_low=0.1, clip_ratio_high=0.3)
    loss, metrics = _loss(cfg, {"teacher_log_probs": teacher.float()}, mask.float(), student, old)
    logits64 = student_logits.clone().requires_grad_(True)
    s64 = logits64.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
    advantages = -verl_kl_penalty(s64, teacher, "k1").detach()
    reference = token_mean(verl_vanilla(old.double(), s64, advantages, mask, 0.1, 0.3)[0], mask)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert 0 < metrics["distillation/pg_clipfrac"] < 1
    loss.backward()
    reference.backward()
    torch.testing.assert_close(logits32.grad.double(), logits64.grad, atol=1e-6, rtol=1e-4)


# ---- the start checks ----


def config_with(**loss):
    config = PPOConfig()
    config.distillation = DistillationConfig(enabled=True, distillation_loss=DistillationLossConfig(**loss))
    config.distillation.teacher_models["teacher_model"].model_path = "pyrl:tiny"
    for key in ("name", "dtype", "prompt_length", "response_length", "temperature"):  # resolved interpolations
        setattr(config.distillation.teacher_models["teacher_model"].inference, key,
                {"name": "vllm", "dtype": "bfloat16", "prompt_length": 512, "response_length": 512,
                 "temperature": 1.0}[key])
    return config


def test_defaults_pass_and_disabled_checks_nothing():
    D.check_config(config_with())
    D.check_config(PPOConfig())


@pytest.mark.parametrize("change, match", [
    (lambda c: setattr(c.distillation.distillation_loss, "loss_mode", "k1"), r"loss_mode=k1 with use_policy_gradient"),
    (lambda c: setattr(c.distillation.distillation_loss, "loss_mode", "jsd"), r"loss_mode='jsd': expected one of"),
    (lambda c: setattr(c.distillation.distillation_loss, "policy_loss_mode", "gspo"), r"policy_loss_mode='gspo'"),
    (lambda c: setattr(c.distillation.distillation_loss, "log_prob_min_clamp", -5.0), r"only forward_kl_topk"),
    (lambda c: (setattr(c.distillation.distillation_loss, "use_task_rewards", False),
                setattr(c.distillation.distillation_loss, "distillation_loss_coef", 0.5)), r"distillation_loss_coef"),
    (lambda c: setattr(c.distillation.teacher_models["teacher_model"], "model_path", None), r"model_path: "),
    (lambda c: setattr(c.distillation.teacher_models["teacher_model"].inference, "gpu_memory_utilization", 0.9),
     r"inference.gpu_memory_utilization=0.9: verl's teacher server option"),
    (lambda c: setattr(c.distillation.teacher_models["teacher_model"].inference, "max_model_len", 100),
     r"max_model_len=100: the teacher needs room .* 1025"),
    (lambda c: c.distillation.teacher_models.update(a=TeacherModelConfig(model_path="x", key="gsm8k"),
                                                    b=TeacherModelConfig(model_path="y")),
     r"teacher_models.b.key: with several teachers each takes the rows whose distillation.teacher_key"),
    (lambda c: c.distillation.teacher_models.update(a=TeacherModelConfig(model_path="x", key="gsm8k"),
                                                    b=TeacherModelConfig(model_path="y", key="gsm8k")),
     r"several teachers have key 'gsm8k'"),
    (lambda c: c.distillation.teacher_models.clear(), r"teacher_models is empty"),
])
def test_refusals_name_the_key(change, match):
    config = config_with()
    change(config)
    with pytest.raises((ValueError, NotImplementedError), match=match):
        D.check_config(config)


def test_a_pool_lays_out_the_teachers_replicas_as_verl():
    config = config_with()
    assert "actor's workers" in D.teacher_placement(config.distillation)  # verl's default: 8 x 0
    config.distillation.nnodes = 1  # one teacher takes the pool: 8 devices / verl's default TP 2 = 4 replicas
    assert [(name, replicas) for name, _, replicas in D.teacher_replicas(config.distillation)] == [("teacher_model", 4)]
    assert "teacher_model 4 replica(s) of 2 device(s)" in D.teacher_placement(config.distillation)


def test_one_added_teacher_replaces_the_default_entry():
    config = config_with()
    config.distillation.teacher_models["mine"] = TeacherModelConfig(model_path="pyrl:tiny")
    assert [name for name, _ in D.teachers_of(config.distillation)] == ["mine"]
    assert D.route_rows(config.distillation, ["a", "b", "a"]) == [[0, 1, 2]]  # one teacher: every row, any key


def test_several_teachers_take_the_rows_their_key_names():
    config = config_with()
    config.distillation.teacher_models.update(math=TeacherModelConfig(model_path="x", key="openai/gsm8k"),
                                              geo=TeacherModelConfig(model_path="y", key="geometry3k"))
    assert [name for name, _ in D.teachers_of(config.distillation)] == ["math", "geo"]  # teacher_model dropped
    keys = ["geometry3k", "openai/gsm8k", "openai/gsm8k", "geometry3k", "openai/gsm8k"]
    assert D.route_rows(config.distillation, keys) == [[1, 2, 4], [0, 3]]
    assert D.route_rows(config.distillation, ["geometry3k"]) == [[], [0]]
    with pytest.raises(ValueError, match=r"row 1's data_source='math500' is no teacher's key"):
        D.route_rows(config.distillation, ["geometry3k", "math500"])
