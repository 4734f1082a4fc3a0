"""A pass with no micro-batch size and no token budget (verl's defaults): one micro-batch on GPUs, a token budget
of batching.CPU_TOKEN_BUDGET on a CPU worker (pyrl.workers.batching.micro_batching), the same update to rounding."""

import pytest
import torch
from worker_helpers import make_config, random_batch

from pyrl.algos.policy_loss import uses_micro_batch_statistics
from pyrl.protocol import token_budget_micro_batches
from pyrl.workers import batching
from pyrl.workers.actor import ActorRolloutRefWorker

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_only_an_unset_pass_on_cpu_takes_the_default_budget():
    budget = batching.CPU_TOKEN_BUDGET
    assert batching.micro_batching(None, False, 16384, on_cpu=True) == (None, True, budget)
    assert batching.micro_batching(None, False, 16384, on_cpu=False) == (None, False, 16384)  # GPUs: all in one
    assert batching.micro_batching(32, False, 16384, on_cpu=True) == (32, False, 16384)  # a size set is kept
    assert batching.micro_batching(None, True, 300, on_cpu=True) == (None, True, 300)  # a budget set is kept
    # a loss reading statistics of its micro-batch runs as configured
    assert batching.micro_batching(None, False, 16384, on_cpu=True, recut=False) == (None, False, 16384)
    cfg = make_config("actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov").actor_rollout_ref.actor
    assert uses_micro_batch_statistics(cfg)
    assert not uses_micro_batch_statistics(make_config().actor_rollout_ref.actor)
    assert uses_micro_batch_statistics(make_config(
        "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
        "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is_batch_normalize=true",
    ).actor_rollout_ref.actor)


def test_cpu_default_cuts_like_a_set_budget_and_runs_a_longer_row_alone_without_a_warning(recwarn):
    budget = batching.CPU_TOKEN_BUDGET
    seqlens = torch.full((256,), 48)
    cut = batching.micro_batch_indices(seqlens, None, False, 16384, CPU)
    assert cut == token_budget_micro_batches([48] * 256, budget, balanced=True)
    assert len(cut) == -(-256 // (budget // 48)) and sorted(r for b in cut for r in b) == list(range(256))
    # groups of 8 rows sharing a 16-token prompt (16 + 8 x 32 tokens each): whole groups, counted once each
    groups = ([list(range(g * 8, g * 8 + 8)) for g in range(32)], [16 + 8 * 32] * 32)
    cut = batching.micro_batch_indices(seqlens, None, False, 16384, CPU, groups)
    assert all(len(b) % 8 == 0 and b[0] % 8 == 0 for b in cut) and len(cut) == -(-32 * 272 // budget)
    # a row longer than the default budget runs alone, silently (a budget the user set warns, protocol.balance)
    long = torch.tensor([budget + 100, 10, 20])
    assert sorted(map(sorted, batching.micro_batch_indices(long, None, False, 16384, CPU))) == [[0], [1, 2]]
    assert not [w for w in recwarn if "longer than max_tokens" in str(w.message)]
    # a rank without rows runs the same count of (empty) micro-batches as the others: one here, with no group
    assert batching.micro_batch_indices(torch.zeros(0, dtype=torch.int64), None, False, 16384, CPU) == [[]]


def test_the_default_budget_updates_as_one_micro_batch_does(monkeypatch):
    """An on-policy update of 8 rows: one micro-batch of all of them (ppo_micro_batch_size_per_gpu=8) against the
    CPU default with its budget shrunk to 20 tokens, which cuts the rows into several micro-batches."""
    batch = random_batch(8, seed=5)
    g = torch.Generator().manual_seed(6)
    batch.batch["advantages"] = torch.randn(8, 6, generator=g) * batch.batch["response_mask"]
    cuts, real = [], batching.micro_batch_indices
    monkeypatch.setattr(batching, "micro_batch_indices", lambda *a, **k: cuts.append(real(*a, **k)) or cuts[-1])
    monkeypatch.setattr(batching, "CPU_TOKEN_BUDGET", 20)
    digests, metrics = [], []
    for micro in (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"], []):
        cfg = make_config("actor_rollout_ref.actor.optim.lr=0.001", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                          *micro).actor_rollout_ref
        worker = ActorRolloutRefWorker(cfg, "actor")
        worker.init_model()
        metrics.append(worker.update_actor(batch.select_idxs(list(range(8)))).meta_info["metrics"])
        digests.append(worker.state_digest())
    assert len(cuts[0]) == 1 and len(cuts[1]) > 2  # the default did cut
    assert metrics[1]["actor/pg_loss"] == pytest.approx(metrics[0]["actor/pg_loss"], rel=1e-5, abs=1e-7)
    assert metrics[1]["actor/grad_norm"] == pytest.approx(metrics[0]["actor/grad_norm"], rel=1e-5)
    for name, value in digests[0]["optimizer"].items():
        if name.endswith("exp_avg"):  # the gradients (Adam's first moment after one step), to float32 rounding
            torch.testing.assert_close(digests[1]["optimizer"][name], value, atol=1e-9, rtol=1e-4, msg=name)
