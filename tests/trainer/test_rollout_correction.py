"""The rollout-vs-trainer log-prob check and verl 0.9.1's rollout correction: the metrics against float64
transcriptions of verl's, the decoupled correction on a batch, and real runs with both engines."""

import math

import pytest
import torch
from trainer_helpers import SMALL, assert_rollout_matches_trainer, compose, read_metrics

from pyrl.algos.rollout_correction import apply_rollout_correction, offpolicy_metrics, rollout_probs_diff
from pyrl.config import RolloutCorrectionConfig
from pyrl.protocol import DataProto
from pyrl.workers.batching import global_batch_info


def _inputs(seed=0, rows=5, width=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, dtype=torch.float64, generator=g) * 3
    rollout = old + 0.3 * torch.randn(rows, width, dtype=torch.float64, generator=g)
    mask = (torch.rand(rows, width, generator=g) > 0.3).double()
    mask[:, 0] = 1  # every row valid somewhere; one of length 1
    mask[1, 1:] = 0
    return old, rollout, mask


def test_probs_diff_matches_verl_debug_metrics():
    old, rollout, mask = _inputs()
    got = rollout_probs_diff(old.float(), rollout.float(), mask)
    valid = mask.bool()
    diff = (old.exp() - rollout.exp()).abs()[valid]  # verl: |exp(old) - exp(rollout)| over the valid tokens
    assert got["training/rollout_probs_diff_valid"] == 1
    assert got["training/rollout_probs_diff_mean"] == pytest.approx(diff.mean().item(), rel=1e-5)
    assert got["training/rollout_probs_diff_max"] == pytest.approx(diff.max().item(), rel=1e-5)
    assert got["training/rollout_probs_diff_std"] == pytest.approx(diff.std().item(), rel=1e-4)
    pi, mu = old.exp()[valid], rollout.exp()[valid]
    pearson = ((pi - pi.mean()) * (mu - mu.mean())).sum() / ((pi - pi.mean()).norm() * (mu - mu.mean()).norm())
    assert got["training/rollout_actor_probs_pearson_corr"] == pytest.approx(pearson.item(), rel=1e-5)
    empty = rollout_probs_diff(old, rollout, torch.zeros_like(mask))
    assert empty["training/rollout_probs_diff_valid"] == 0 and math.isnan(empty["training/rollout_probs_diff_mean"])


def verl_offpolicy_metrics(old, rollout, mask):
    """verl 0.9.1's compute_offpolicy_metrics, transcribed."""
    def masked_mean(x, m, axis=None):
        return (x * m).sum() / (m.sum() + 1e-8) if axis is None else (x * m).sum(axis) / (m.sum(axis) + 1e-8)

    mean_old, mean_rollout = masked_mean(old, mask, -1), masked_mean(rollout, mask, -1)
    log_ratio = old - rollout
    log_ppl_diff = mean_rollout - mean_old
    seq = torch.clamp((log_ratio * mask).sum(-1), -20, 20)
    return {"training_ppl": torch.exp(-mean_old).mean(), "training_log_ppl": (-mean_old).mean(),
            "kl": masked_mean(rollout - old, mask), "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask),
            "rollout_ppl": torch.exp(-mean_rollout).mean(), "rollout_log_ppl": (-mean_rollout).mean(),
            "log_ppl_diff": log_ppl_diff.mean(), "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
            "log_ppl_diff_max": log_ppl_diff.max(), "log_ppl_diff_min": log_ppl_diff.min(),
            "ppl_ratio": torch.exp(log_ppl_diff).mean(),
            "chi2_token": masked_mean(torch.exp(torch.clamp(log_ratio, -20, 20)) ** 2, mask) - 1.0,
            "chi2_seq": torch.exp(2.0 * seq).mean() - 1.0}


def test_offpolicy_metrics_match_verl():
    old, rollout, mask = _inputs(seed=3)
    got = offpolicy_metrics(old, rollout, mask)
    for name, value in verl_offpolicy_metrics(old, rollout, mask).items():
        assert got[name] == pytest.approx(value.item(), rel=1e-9, abs=1e-12), name


def test_decoupled_correction_rejects_tokens_and_adds_weights():
    old, rollout, mask = _inputs(seed=5)
    batch = DataProto.from_dict({"old_log_probs": old.float(), "rollout_log_probs": rollout.float(),
                                 "response_mask": mask.long()})
    config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1",
                                     rollout_rs_threshold=1.2)
    metrics = apply_rollout_correction(batch, config)
    log_ratio = (old - rollout).float()
    expected_weights = torch.exp(log_ratio).clamp(max=1.5) * mask
    torch.testing.assert_close(batch.batch["rollout_is_weights"], expected_weights.float(), rtol=1e-5, atol=1e-6)
    # token_k1 with U = 1.2 keeps log(1/1.2) <= -log ratio <= log(1.2)
    keep = ((-log_ratio >= math.log(1 / 1.2)) & (-log_ratio <= math.log(1.2))).long()
    assert torch.equal(batch.batch["response_mask"], mask.long() * keep)
    assert batch.batch["response_mask"].sum() < mask.sum()  # something was rejected
    # the losses still divide by the tokens before rejection, and by the rows, as verl 0.9.1's engine does
    # (loss_mask kept from before it): a rejected token adds 0 to the mean, it does not leave it
    assert torch.equal(batch.batch["loss_mask"], mask.long())
    info = global_batch_info(batch.batch["response_mask"], torch.device("cpu"), 1, batch.batch["loss_mask"])
    assert info == {"batch_num_tokens": float(mask.sum()), "global_batch_size": float(mask.shape[0]), "dp_size": 1,
                    "response_tokens": float(batch.batch["response_mask"].sum()),  # the metrics' token means
                    "response_rows": float((batch.batch["response_mask"].sum(-1) > 0).sum())}
    assert {"rollout_corr/kl", "rollout_corr/training_ppl", "rollout_corr/rollout_is_mean"} <= set(metrics)
    untouched = DataProto.from_dict({"old_log_probs": old.float(), "rollout_log_probs": rollout.float(),
                                     "response_mask": mask.long()})
    metrics = apply_rollout_correction(untouched, RolloutCorrectionConfig())  # off: metrics only
    assert torch.equal(untouched.batch["response_mask"], mask.long()) and "rollout_is_weights" not in untouched.batch
    assert "loss_mask" not in untouched.batch
    assert "rollout_corr/chi2_seq" in metrics


@pytest.mark.parametrize("engine,update", [("hf", "2 epochs"), ("vllm", "2 epochs"), ("vllm", "on-policy")])
def test_engines_log_probs_match_the_trainer_after_updates(engine, update, tmp_path, ray_session):
    """Both rollout engines return the log-probs of what they sampled; after several updates and weight pushes
    they still match the trainer's in fp32 (the check verl logs as training/rollout_probs_diff_*). On-policy
    (one epoch, one mini-batch) there is no old-log-prob pass: the update's own log-probs give the check."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    from pyrl.ppo import run_ppo

    sizes = ["actor_rollout_ref.actor.ppo_epochs=2"] if update == "2 epochs" else [
        "actor_rollout_ref.actor.ppo_epochs=1", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]  # 8 = train_batch_size
    config = compose(*SMALL, f"actor_rollout_ref.rollout.name={engine}",
                     "actor_rollout_ref.rollout.calculate_log_probs=true", *sizes, "trainer.total_training_steps=3",
                     "actor_rollout_ref.actor.fsdp_config.dtype=float32", "actor_rollout_ref.rollout.dtype=float32",
                     f"trainer.default_local_dir={tmp_path}")
    run_ppo(config)
    rows = read_metrics(tmp_path)
    assert_rollout_matches_trainer(rows, 3)
    assert all(("timing_s/old_log_prob" in row) == (update == "2 epochs") for row in rows)
    for row in rows:
        assert abs(row["rollout_corr/kl"]) < 1e-4 and "rollout_corr/training_ppl" in row
    assert rows[-1]["actor/lr"] > 0 and rows[0]["actor/pg_clipfrac"] >= 0


@pytest.mark.parametrize("mode", ["decoupled", "bypass"])
def test_rollout_correction_modes_train(mode, tmp_path, ray_session):
    from pyrl.ppo import run_ppo

    keys = {"decoupled": ["algorithm.rollout_correction.rollout_is=token",
                          "algorithm.rollout_correction.rollout_rs=token_k1",
                          "algorithm.rollout_correction.rollout_rs_threshold=2.0"],
            "bypass": ["algorithm.rollout_correction.bypass_mode=true",
                       "algorithm.rollout_correction.rollout_is=sequence"]}
    config = compose(*SMALL, "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.calculate_log_probs=true",
                     "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path}", *keys[mode])
    run_ppo(config)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    if mode == "decoupled":
        assert "rollout_corr/rollout_is_mean" in rows[-1] and "timing_s/old_log_prob" in rows[-1]
        assert all(0 <= row["rollout_corr/rollout_rs_masked_fraction"] <= 1 for row in rows)
    else:  # no old-log-prob pass; the loss reports the correction it applied
        assert "timing_s/old_log_prob" not in rows[-1] and "actor/rollout_corr/kl" in rows[-1]


def test_rollout_correction_needs_the_engines_log_probs():
    from pyrl.ppo import apply_rollout_correction_config

    config = compose(*SMALL, "actor_rollout_ref.rollout.calculate_log_probs=false",
                     "algorithm.rollout_correction.bypass_mode=true")
    with pytest.raises(ValueError, match="rollout_correction.bypass_mode compares .*rollout.calculate_log_probs=true"):
        apply_rollout_correction_config(config)
    config = compose(*SMALL, "algorithm.rollout_correction.bypass_mode=true",
                     "actor_rollout_ref.rollout.calculate_log_probs=true",
                     "actor_rollout_ref.actor.policy_loss.loss_mode=gspo")
    with pytest.raises(ValueError, match="uses the bypass_mode loss"):
        apply_rollout_correction_config(config)
