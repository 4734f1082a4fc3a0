"""The FSDP2 actor/rollout/ref worker on 2 Ray processes over gloo, against single-process references."""

import contextlib
import os

import pytest
import torch
from worker_helpers import (
    PROMPT_WIDTH,
    check_rollout_fields,
    hf_greedy,
    hf_response_logprobs,
    make_config,
    one_rank_process_group,
    random_batch,
    rollout_prompts,
)

from pyrl import ops
from pyrl.controller import ResourcePool, WorkerError, WorkerGroup
from pyrl.workers import fsdp
from pyrl.workers.actor import ActorRolloutRefWorker
from pyrl.workers.precision import cpu_has_bf16

ROWS = 8
TRAIN = [
    "actor_rollout_ref.actor.optim.lr=0.001", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
    "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.clip_ratio_high=0.28",
    "actor_rollout_ref.rollout.calculate_log_probs=true",
]
# the 2-rank group packs micro-batches under a token budget; the reference uses fixed micro-batches of 3
SHARDED_OVERRIDES = (*TRAIN, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20")
SHARDED = make_config(*SHARDED_OVERRIDES)
SINGLE = make_config(*TRAIN, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
                     "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3")


@pytest.fixture(scope="module", params=[-1, 1], ids=["sharded_over_both", "hybrid_shard_groups_of_1"])
def group(request, ray_session):
    """Two ranks sharding the actor and the reference between them (fsdp_size -1), or verl's hybrid sharding with
    groups of one rank (fsdp_size 1: a ("replicate", "shard") mesh of 2 x 1, each rank a whole copy, the
    gradients averaged): the same numbers either way."""
    size = request.param
    config = SHARDED if size == -1 else make_config(*SHARDED_OVERRIDES, *(
        f"actor_rollout_ref.{role}.fsdp_config.fsdp_size={size}" for role in ("actor", "ref")))
    wg = WorkerGroup(ResourcePool([2]), ActorRolloutRefWorker, config.actor_rollout_ref, "actor_rollout_ref")
    wg.init_model()
    wg.hybrid = size == 1
    yield wg
    wg.kill()


@pytest.fixture(scope="module")
def train_batch(group):
    batch = random_batch(ROWS, seed=3)
    batch.union(group.compute_log_prob(batch).select(["old_log_probs"], meta_info_keys=[]))
    ref = group.compute_ref_log_prob(batch)
    assert all(0 < mfu < 1 for mfu in ref.meta_info.pop("metrics")["perf/mfu/ref"])  # one per rank
    batch.union(ref)
    g = torch.Generator().manual_seed(4)
    batch.batch["old_log_probs"] = batch.batch["old_log_probs"] + 0.3 * torch.randn(ROWS, 6, generator=g)  # off-policy
    batch.batch["advantages"] = torch.randn(ROWS, 6, generator=g) * batch.batch["response_mask"]
    return batch


def test_sharded_log_probs_equal_hf(group, tiny_path):
    batch = random_batch(ROWS, seed=1)
    batch.meta_info["temperature"] = 0.7
    out = group.compute_log_prob(batch)
    ref_logp, ref_entropy = hf_response_logprobs(tiny_path, batch, temperature=0.7)
    mask = batch.batch["response_mask"].bool()
    assert out.batch["old_log_probs"].shape == (ROWS, 6)
    torch.testing.assert_close(out.batch["old_log_probs"][mask].double(), ref_logp[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.batch["entropys"][mask].double(), ref_entropy[mask], atol=1e-5, rtol=0)
    ref_out = group.compute_ref_log_prob(batch)  # the frozen reference copy starts from the same weights
    torch.testing.assert_close(ref_out.batch["ref_log_prob"][mask].double(), ref_logp[mask], atol=1e-5, rtol=0)


def test_update_on_two_ranks_equals_single_process(group, train_batch):
    single = ActorRolloutRefWorker(SINGLE.actor_rollout_ref, "actor")
    single.init_model()
    before = single.state_digest()
    # rank r holds rows [4r, 4r + 4) and takes its mini-batch m from rows 4r + 2m, 4r + 2m + 1: the global
    # mini-batch m is those rows of both ranks, which the single process must see together
    order = [0, 1, 4, 5, 2, 3, 6, 7]
    metrics_single = single.update_actor(train_batch.select_idxs(order)).meta_info["metrics"]
    out = group.update_actor(train_batch)
    metrics = {k: v[0] for k, v in out.meta_info["metrics"].items()}
    after_group, after_single = group.state_digest()[0], single.state_digest()
    # fsdp_size -1: each rank holds about half of the weights; groups of one rank: each holds them all
    whole = after_single["held_elements"]  # a single process holds every parameter once
    assert after_group["held_elements"] == (whole if group.hybrid else pytest.approx(whole / 2, rel=0.02))
    changed = max((after_single["params"][k] - before["params"][k]).abs().max().item() for k in before["params"])
    assert changed > 1e-3  # two Adam steps move weights by up to ~2 lr
    for name, value in after_single["params"].items():
        # Adam divides by |grad|, so float32 summation-order noise in near-zero gradients shows as ~1e-2 lr
        torch.testing.assert_close(after_group["params"][name], value, atol=1e-5, rtol=0, msg=name)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy_loss", "actor/kl_loss",
                "actor/grad_norm"):
        assert metrics[key] == pytest.approx(metrics_single[key], rel=1e-4, abs=1e-6), key
    assert metrics["actor/pg_clipfrac"] > 0  # the perturbed old log-probs clip some tokens
    assert metrics["actor/lr"] == pytest.approx(0.001)


def test_generate_fields_are_consistent(group):
    pushed = [push["perf/update_weights_bytes"] for push in group.update_weights()]
    # each rank of groups of one holds the weights whole: its hf engine generates with them, nothing is copied
    assert all(bytes_ == 0 if group.hybrid else bytes_ > 0 for bytes_ in pushed), pushed
    prompts = rollout_prompts(4, seed=5)
    prompts.meta_info["n"] = 2
    out = group.generate_sequences(prompts)
    check_rollout_fields(out, prompts, n=2)
    # the rollout's own log-probs are the policy's (temperature 1, no top-k/top-p)
    logp = group.compute_log_prob(out).batch["old_log_probs"]
    mask = out.batch["response_mask"].bool()
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], logp[mask], atol=1e-4, rtol=0)


def force_fsdp2(monkeypatch):
    """FSDP2 on one rank, which pyrl wraps only on CUDA and only with mixed precision (fsdp.wraps_with_fsdp2): the
    path of one CUDA rank, and the reference a plain module is held to."""
    monkeypatch.setattr(fsdp, "wraps_with_fsdp2", lambda world, mixed_precision, offloads, device: True)


@pytest.mark.parametrize("fsdp2", [False, True], ids=["plain_module", "fsdp2_on_one_rank"])
def test_the_hf_engine_generates_with_the_actors_own_weights(tmp_path, fsdp2, monkeypatch):
    """One rank, the engine in the actor's dtype: the engine's parameters are the actor's tensors (with FSDP2, its
    shards' local tensors), so the optimizer's steps reach it with no push, and it generates what transformers
    does from the exported weights."""
    from torch.distributed.tensor import DTensor

    if fsdp2:  # a process group of one rank, as a trainer's, and FSDP2 sharding the actor over it
        force_fsdp2(monkeypatch)
    with one_rank_process_group() if fsdp2 else contextlib.nullcontext():
        worker = ActorRolloutRefWorker(SINGLE.actor_rollout_ref, "actor_rollout")
        worker.init_model()
        assert all(isinstance(t, DTensor) == fsdp2 for t in worker.policy.state_dict().values())
        assert worker.update_weights()["perf/update_weights_bytes"] == 0
        engine = worker.engine.model.state_dict()
        before = {name: tensor.clone() for name, tensor in engine.items()}
        batch = random_batch(ROWS, seed=7)
        batch.union(worker.compute_log_prob(batch).select(["old_log_probs"], meta_info_keys=[]))
        batch.batch["ref_log_prob"] = batch.batch["old_log_probs"]
        batch.batch["advantages"] = torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(8))
        worker.update_actor(batch)  # no push after it
        actor = dict(fsdp.local_state_items(worker.policy, "lm."))
        assert actor.keys() == engine.keys()
        for name, tensor in actor.items():
            assert engine[name].data_ptr() == tensor.data_ptr() and torch.equal(engine[name], tensor), name
        assert max((engine[k] - v).abs().max().item() for k, v in before.items()) > 1e-4  # the step moved them
        prompts = rollout_prompts(4, seed=6)
        prompts.meta_info["do_sample"] = False
        out = worker.generate_sequences(prompts)
        worker.export_hf(str(tmp_path / "hf"))
    got = [row[:n].tolist() for row, n in zip(out.batch["responses"], out.batch["response_mask"].sum(-1).tolist())]
    assert got == hf_greedy(str(tmp_path / "hf"), prompts, max_new_tokens=out.batch["responses"].shape[1])


def one_rank_actor(cfg, fsdp2: bool, monkeypatch) -> ActorRolloutRefWorker:
    """An "actor" worker on this process's one-rank group: its policy a plain module, or with fsdp2 FSDP2's."""
    from torch.distributed.fsdp import FSDPModule

    if fsdp2:
        force_fsdp2(monkeypatch)
    worker = ActorRolloutRefWorker(cfg, "actor")
    worker.init_model()
    assert isinstance(worker.policy, FSDPModule) == fsdp2
    return worker


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_rank_reduces_its_gradients_once_per_mini_batch(monkeypatch, dtype):
    """FSDP2 on one rank (each rank's weights whole) leaves the gradients unreduced until a mini-batch's last
    micro-batch (pyrl.workers.update.gradient_sync_can_wait; not with param_offload on CUDA); the update equals one
    that reduces after every micro-batch bit for bit, bf16 compute included (the micro-batches' gradients accumulate
    in float32 both ways)."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import FSDPModule

    from pyrl.workers import update

    if dtype == "bfloat16" and not cpu_has_bf16():
        pytest.skip("this CPU has no native bf16 (fsdp_config.dtype=bfloat16 computes in fp32)")
    force_fsdp2(monkeypatch)  # FSDP2 wraps one rank on CUDA with mixed precision only
    calls, can_wait = [], update.gradient_sync_can_wait
    sync = FSDPModule.set_requires_gradient_sync
    monkeypatch.setattr(FSDPModule, "set_requires_gradient_sync",
                        lambda self, on, **kw: (calls.append(on), sync(self, on, **kw))[1])
    cfg = make_config(*TRAIN, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                      f"actor_rollout_ref.actor.fsdp_config.dtype={dtype}").actor_rollout_ref
    batch = random_batch(ROWS, seed=11)
    batch.batch["old_log_probs"] = torch.zeros(ROWS, 6)
    batch.batch["ref_log_prob"] = torch.zeros(ROWS, 6)
    batch.batch["advantages"] = torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(12))
    weights = {}
    with one_rank_process_group():
        for deferred in (True, False):
            monkeypatch.setattr(update, "gradient_sync_can_wait", lambda model, config, device, d=deferred: d)
            worker = ActorRolloutRefWorker(cfg, "actor")
            worker.init_model()
            assert can_wait(worker.policy, cfg.actor.fsdp_config, worker.device)  # one rank: the weights whole
            assert not can_wait(worker.policy, SimpleNamespace(param_offload=True), torch.device("cuda"))
            before = {k: v.clone() for k, v in fsdp.local_state_items(worker.policy)}
            worker.update_actor(batch)
            weights[deferred] = {k: v.clone() for k, v in fsdp.local_state_items(worker.policy)}
    for name, value in weights[True].items():
        assert torch.equal(value, weights[False][name]), name
    # 2 mini-batches of 4 rows, micro-batches of 3 and 1: unreduced after the first, reduced after the last
    assert calls == [False, True, False, True, True]  # the last: sync restored after the update
    assert max((weights[True][k] - v).abs().max().item() for k, v in before.items()) > 1e-4  # the steps moved them


def test_one_rank_in_the_master_dtype_trains_a_plain_module_as_fsdp2_would(monkeypatch, tmp_path, ray_session):
    """One rank computing in its master dtype (float32 here) holds a plain module, no FSDP2 (fsdp.wraps_with_fsdp2:
    FSDP2 would only copy every weight and gradient), and its update, micro-batches and gradient clipping
    included, moves the weights as FSDP2 on that rank does, to rounding: FSDP2's weights are views into its
    all-gather buffer, and where the CPU's matmul kernels round differently for them (5.3e-7 at most on an AMD
    EPYC, the code before pyrl.models.embedding too; under 1e-7 on the Intel Xeon box) AdamW's first step, which
    divides each gradient by its own size, carries a near-cancelled element's rounding into the weight: within a
    thousandth of a step (lr 1e-3 here). With mixed precision on CUDA FSDP2 wraps it (on a CPU it casts per forward,
    the next test). Its checkpoint loads into two ranks sharding the model (a run resumed with more workers)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not fsdp.wraps_with_fsdp2(1, False, False, cpu) and not fsdp.wraps_with_fsdp2(1, False, False, cuda)
    assert fsdp.wraps_with_fsdp2(2, False, False, cpu) and fsdp.wraps_with_fsdp2(1, True, False, cuda)
    assert not fsdp.wraps_with_fsdp2(1, True, False, cpu)  # mixed precision on a CPU: fsdp.cast_per_forward
    assert fsdp.wraps_with_fsdp2(1, False, True, cuda)  # param_offload on CUDA: FSDP2's CPUOffloadPolicy
    cfg = make_config(*TRAIN, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                      "actor_rollout_ref.actor.fsdp_config.dtype=float32", "actor_rollout_ref.actor.grad_clip=0.5"
                      ).actor_rollout_ref
    batch = random_batch(ROWS, seed=13)
    batch.batch["old_log_probs"] = torch.zeros(ROWS, 6)
    batch.batch["ref_log_prob"] = torch.zeros(ROWS, 6)
    batch.batch["advantages"] = torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(14))
    weights, metrics = {}, {}
    with one_rank_process_group():
        for wrapped in (False, True):
            worker = one_rank_actor(cfg, wrapped, monkeypatch)
            metrics[wrapped] = worker.update_actor(batch).meta_info["metrics"]
            weights[wrapped] = {k: v.clone() for k, v in fsdp.local_state_items(worker.policy)}
            if not wrapped:
                worker.save_checkpoint(str(tmp_path / "ckpt"))
                plain = worker.state_digest()
    assert weights[True].keys() == weights[False].keys()
    for name, value in weights[True].items():
        torch.testing.assert_close(weights[False][name], value, atol=1e-6, rtol=0, msg=name)
    assert metrics[False]["actor/grad_norm"] == pytest.approx(metrics[True]["actor/grad_norm"], rel=1e-6)
    two = WorkerGroup(ResourcePool([2]), ActorRolloutRefWorker, cfg, "actor")
    try:
        two.init_model()
        two.load_checkpoint(str(tmp_path / "ckpt"))
        loaded = two.state_digest()
    finally:
        two.kill()
    for digest in loaded:  # each rank holds half of the elements, and gathers the whole state
        assert digest["held_elements"] < plain["held_elements"]
        for name, value in plain["params"].items():
            assert torch.equal(digest["params"][name], value), name
        assert digest["optimizer"].keys() == plain["optimizer"].keys() and plain["optimizer"]
        for name, value in plain["optimizer"].items():
            assert torch.equal(torch.as_tensor(digest["optimizer"][name]), torch.as_tensor(value)), name


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded_recomputed"])
def test_one_cpu_rank_with_mixed_precision_casts_per_forward_as_fsdp2_would(monkeypatch, packed):
    """One CPU rank with bf16 compute over float32 masters holds a plain module whose decoder layers and root cast
    their weights to bf16 for each forward (fsdp.cast_per_forward), no FSDP2: the log-probs, the update's
    metrics and the weights after it (micro-batches, gradient clipping, float32 gradient accumulation; padded with
    gradient checkpointing, whose recomputed layers cast again) equal FSDP2's on that rank bit for bit; the
    weights stay float32 parameters outside the forward (what checkpoints, the rollout engine and exports read);
    inside it the layers compute in bf16. bf16 runs here even on a CPU that only emulates it (slowly, to the same
    numbers both ways)."""
    from pyrl.workers import precision

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    cfg = make_config(*TRAIN, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                      "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
                      "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16", "actor_rollout_ref.actor.grad_clip=0.5",
                      f"actor_rollout_ref.model.use_remove_padding={str(packed).lower()}",
                      f"actor_rollout_ref.model.enable_gradient_checkpointing={str(not packed).lower()}"
                      ).actor_rollout_ref
    weights, metrics, log_probs, seen = {}, {}, {}, {}
    with one_rank_process_group():
        for wrapped in (False, True):
            worker = one_rank_actor(cfg, wrapped, monkeypatch)
            assert worker.compute_dtype == torch.bfloat16
            layer = worker.lm.model.layers[0].mlp.down_proj
            handle = layer.register_forward_hook(
                lambda module, args, out, w=wrapped: seen.__setitem__(w, (module.weight.dtype, out.dtype)))
            batch = random_batch(ROWS, seed=17)
            log_probs[wrapped] = worker.compute_log_prob(batch).batch["old_log_probs"]
            handle.remove()
            batch.batch["old_log_probs"] = log_probs[False]
            batch.batch["ref_log_prob"] = torch.zeros(ROWS, 6)
            batch.batch["advantages"] = torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(18))
            metrics[wrapped] = worker.update_actor(batch).meta_info["metrics"]
            weights[wrapped] = {k: v.clone() for k, v in fsdp.local_state_items(worker.policy)}
            if not wrapped:
                assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32
                           for p in worker.policy.parameters())
    assert seen[False] == seen[True] == (torch.bfloat16, torch.bfloat16)
    torch.testing.assert_close(log_probs[False], log_probs[True], atol=0, rtol=0)
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy_loss", "actor/kl_loss", "actor/ppo_kl"):
        assert metrics[False][name] == metrics[True][name], name
    assert weights[True].keys() == weights[False].keys()
    for name, value in weights[True].items():
        assert weights[False][name].dtype == torch.float32
        assert torch.equal(weights[False][name], value), name


def test_checkpoint_round_trip_and_hf_export(group, train_batch, tmp_path):
    from transformers import AutoModelForCausalLM

    group.save_checkpoint(str(tmp_path / "ckpt"))
    saved = group.state_digest()[0]
    assert not os.path.exists(str(tmp_path / "ckpt.tmp"))
    group.update_actor(train_batch)
    moved = group.state_digest()[0]
    assert any(not torch.equal(moved["params"][k], v) for k, v in saved["params"].items())
    group.load_checkpoint(str(tmp_path / "ckpt"))
    restored = group.state_digest()[0]
    for k, v in saved["params"].items():
        assert torch.equal(restored["params"][k], v), k
    assert saved["optimizer"].keys() == restored["optimizer"].keys() and saved["optimizer"]
    for k, v in saved["optimizer"].items():
        assert torch.equal(torch.as_tensor(restored["optimizer"][k]), torch.as_tensor(v)), k
    assert restored["lr"] == saved["lr"]

    group.export_hf(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    state = model.state_dict()
    for k, v in saved["params"].items():
        assert torch.equal(state[k], v), k


def test_missing_field_names_worker_rank_and_method(group):
    batch = random_batch(4, seed=6)
    with pytest.raises(WorkerError, match=r"ActorRolloutRefWorker rank \d \(node .*\) "
                                          r"raised in update_actor\(\).*advantages"):
        group.update_actor(batch)


def _with_loss_mask_holes(batch):
    """Tokens attended to but not trained on (as multi-turn tool output will be): a hole in the middle of
    row 0's response and the first token of row 2's."""
    batch = batch.select_idxs(list(range(len(batch))))
    mask = batch.batch["response_mask"].clone()
    mask[0, 2], mask[2, 0] = 0, 0
    batch.batch["response_mask"] = mask
    batch.batch["advantages"] = batch.batch["advantages"] * mask
    return batch


@pytest.mark.parametrize("ranks", [1, 2])
def test_packed_equals_padded(ray_session, train_batch, ranks):
    """use_remove_padding=true (packed, varlen attention) and false (padded) give the same log-probs, entropy,
    loss metrics, gradients (Adam's first moment after one step) and weights after one optimizer step, on 1 rank
    (padded batches sent) and on 2 (packed batches sent, as the trainer does); responses of lengths 0..6,
    loss-mask holes."""
    batch = _with_loss_mask_holes(train_batch)
    digests, metrics, outputs = {}, {}, {}
    for packed in (True, False):
        cfg = make_config(*TRAIN, f"actor_rollout_ref.model.use_remove_padding={packed}",
                          "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                          *(["actor_rollout_ref.actor.use_dynamic_bsz=true",
                             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20"] if ranks == 2 else
                            ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3"])).actor_rollout_ref
        if ranks == 1:
            worker = ActorRolloutRefWorker(cfg, "actor")
            worker.init_model()
            outputs[packed] = worker.compute_log_prob(batch)
            metrics[packed] = worker.update_actor(batch).meta_info["metrics"]
            digests[packed] = worker.state_digest()
        else:
            wg = WorkerGroup(ResourcePool([2]), ActorRolloutRefWorker, cfg, "actor")
            sent = batch.to_packed("attention_mask", keys=["input_ids", "position_ids"])  # as the trainer sends it
            try:
                wg.init_model()
                outputs[packed] = wg.compute_log_prob(sent)
                metrics[packed] = {k: v[0] for k, v in wg.update_actor(sent).meta_info["metrics"].items()}
                digests[packed] = wg.state_digest()[0]
            finally:
                wg.kill()
    seen = batch.batch["attention_mask"][:, -6:].bool()
    for key in ("old_log_probs", "entropys"):
        torch.testing.assert_close(outputs[True].batch[key][seen], outputs[False].batch[key][seen], atol=1e-5, rtol=0)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy_loss", "actor/kl_loss",
                "actor/grad_norm"):
        assert metrics[True][key] == pytest.approx(metrics[False][key], rel=1e-4, abs=1e-6), key
    grads = {name: value for name, value in digests[False]["optimizer"].items() if name.endswith("exp_avg")}
    assert len(grads) >= 20  # every trained tensor (the tied lm_head shares the embedding's)
    for name, value in grads.items():
        torch.testing.assert_close(digests[True]["optimizer"][name], value, atol=1e-7, rtol=1e-4, msg=name)
    for name, value in digests[False]["params"].items():
        torch.testing.assert_close(digests[True]["params"][name], value, atol=1e-5, rtol=0, msg=name)
    assert 0 < metrics[True]["perf/mfu/actor"] < 1
    mfu = outputs[True].meta_info["metrics"]["perf/mfu/actor_infer"]  # a list of the ranks' on 2 ranks
    assert all(0 < value < 1 for value in (mfu if isinstance(mfu, list) else [mfu]))


def _with_shared_prompts(batch):
    """Rows 1 and 2 take row 0's prompt, rows 4 and 6 row 3's (not adjacent): two groups of 3, and singles."""
    batch = batch.select_idxs(list(range(len(batch))))
    for source, targets in ((0, [1, 2]), (3, [4, 6])):
        for key in ("input_ids", "attention_mask"):
            batch.batch[key][targets, :PROMPT_WIDTH] = batch.batch[key][source, :PROMPT_WIDTH].clone()
        batch.batch["prompts"][targets] = batch.batch["prompts"][source].clone()
    batch.batch["position_ids"] = (batch.batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return batch


def test_fast_paths_equal_the_plain_update(ray_session, train_batch, monkeypatch):
    """pyrl's fast paths, on by default (pyrl.ppo.resolve_fast_paths), against verl's plain ones (unfused, unshared,
    gradient checkpointing on, 1 rank): model.use_fused_kernels (packed and padded), actor.use_prefix_grouper (each
    prompt runs once for its samples, in the log-prob pass and the update, groups kept whole in token-budget
    micro-batches) and no gradient checkpointing (the memory plan's choice where the update fits) give the
    same log-probs, metrics and trained weights, on 1 rank and on 2 (packed transport, as the trainer sends), with
    loss-mask holes."""
    from pyrl.workers.batching import ModelInputs

    batch = _with_loss_mask_holes(_with_shared_prompts(train_batch))
    share_prompts, tokens = ModelInputs._share_prompts.__func__, []  # (tokens run, tokens unshared) per forward

    def counted(cls, ids, positions, layout, *args):
        inputs = share_prompts(cls, ids, positions, layout, *args)
        tokens.append((inputs.num_tokens, int(layout.cu_seqlens[-1])))
        return inputs

    monkeypatch.setattr(ModelInputs, "_share_prompts", classmethod(counted))
    results = {}
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"
    for name, ranks, extra in (("plain", 1, [micro]),
                               ("fused", 1, [micro]),
                               ("fused-padded", 1, [micro, "actor_rollout_ref.model.use_remove_padding=false"]),
                               ("shared", 1, [micro]),
                               ("uncheckpointed", 1, [micro,
                                                      "actor_rollout_ref.model.enable_gradient_checkpointing=false"]),
                               ("shared-fused-2-ranks", 2, ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                                                            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=30",
                                                            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                                                            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30"])):
        paths = [f"actor_rollout_ref.actor.use_prefix_grouper={name.startswith('shared')}",
                 f"actor_rollout_ref.model.use_fused_kernels={'fused' in name}"]
        cfg = make_config(*TRAIN, "actor_rollout_ref.actor.ppo_mini_batch_size=8", *paths, *extra).actor_rollout_ref
        if ranks == 1:
            worker = ActorRolloutRefWorker(cfg, "actor")
            worker.init_model()
            logp = worker.compute_log_prob(batch).batch["old_log_probs"]
            metrics = worker.update_actor(batch).meta_info["metrics"]
            digest = worker.state_digest()
        else:
            wg = WorkerGroup(ResourcePool([2]), ActorRolloutRefWorker, cfg, "actor")
            sent = batch.to_packed("attention_mask", keys=["input_ids", "position_ids"])
            try:
                wg.init_model()
                logp = wg.compute_log_prob(sent).batch["old_log_probs"]
                metrics = {k: v[0] for k, v in wg.update_actor(sent).meta_info["metrics"].items()}
                digest = wg.state_digest()[0]
            finally:
                wg.kill()
        results[name] = (logp, metrics, digest)
    assert tokens and sum(run for run, _ in tokens) < sum(unshared for _, unshared in tokens)  # prompts did run once
    seen = batch.batch["attention_mask"][:, -6:].bool()
    plain_logp, plain_metrics, plain_digest = results["plain"]
    for name in ("fused", "fused-padded", "shared", "uncheckpointed", "shared-fused-2-ranks"):
        logp, metrics, digest = results[name]
        torch.testing.assert_close(logp[seen], plain_logp[seen], atol=1e-5, rtol=0, msg=name)
        for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy_loss", "actor/kl_loss",
                    "actor/grad_norm"):
            assert metrics[key] == pytest.approx(plain_metrics[key], rel=1e-4, abs=1e-6), (name, key)
        for key, value in plain_digest["optimizer"].items():  # Adam's first moment after one step: the gradient
            if key.endswith("exp_avg"):
                torch.testing.assert_close(digest["optimizer"][key], value, atol=1e-7, rtol=1e-4,
                                           msg=lambda m, name=name, key=key: f"{name}: {key}: {m}")
        # Adam's first step moves a weight by ~lr x sign(gradient): where a gradient is ~0, float32 noise in the
        # summation order (2 ranks, other micro-batches) shows as a few % of the lr=1e-3 step
        for param, value in plain_digest["params"].items():
            torch.testing.assert_close(digest["params"][param], value, atol=5e-5, rtol=0,
                                       msg=lambda m, name=name, param=param: f"{name}: {param}: {m}")


@pytest.mark.parametrize("micro, agg", [(None, "token-mean"), (3, "seq-mean-token-mean")],
                         ids=["one_micro_batch", "micro_batches_of_3_seq_mean_an_empty_row"])
def test_on_policy_update_skips_old_log_probs(train_batch, micro, agg):
    """ppo_epochs=1 and one mini-batch: update_actor needs no old_log_probs (its own detached log-probs stand in,
    so the ratio is 1 and nothing clips) and moves the weights exactly as with the extra pass. With the rollout
    engine's log-probs in the batch it returns its own, taken before its optimizer step: the extra pass's."""
    cfg = make_config(*TRAIN, "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.shuffle=true",
                      f"actor_rollout_ref.actor.loss_agg_mode={agg}",
                      *([f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}"] if micro else [])
                      ).actor_rollout_ref
    train_batch = train_batch.select_idxs(list(range(ROWS)))
    scored = train_batch.batch["response_mask"].bool()  # the tokens each pass scores
    if agg.startswith("seq-mean"):  # a row left without a loss token: the loss counts it, verl's entropy does not
        train_batch.batch["response_mask"][2] = 0
    digests, metrics, outputs = [], [], []
    for with_old in (True, False):
        worker = ActorRolloutRefWorker(cfg, "actor")
        worker.init_model()
        batch = train_batch.select_idxs(list(range(ROWS)))
        batch.batch["rollout_log_probs"] = batch.batch["old_log_probs"]  # any engine's numbers: only compared
        if with_old:
            extra = worker.compute_log_prob(batch).batch
            extra_pass, entropys = extra["old_log_probs"], extra["entropys"]
            batch.batch["old_log_probs"] = extra_pass
        else:
            batch.pop(["old_log_probs"])
        keys = sorted(batch.batch)
        outputs.append(worker.update_actor(batch))
        assert sorted(batch.batch) == keys  # the update's row column is gone again
        metrics.append(outputs[-1].meta_info["metrics"])
        digests.append(worker.state_digest())
    assert "old_log_probs" not in outputs[0].batch  # it had them
    own = outputs[1].batch["old_log_probs"]
    assert own.shape == extra_pass.shape and not own[~scored].any()
    torch.testing.assert_close(own[scored], extra_pass[scored], atol=1e-6, rtol=0)
    mask = train_batch.batch["response_mask"].bool()
    # the extra pass's forward and the update's own agree to float32 rounding, not bit for bit: the gradients
    # (Adam's first moment after one step) agree to that rounding; Adam's first step moves a weight by
    # ~lr x sign(gradient), so where a gradient is ~0 the rounding can flip the step's sign (up to 6.7e-5 of the
    # lr=1e-3 step measured on an AMD EPYC box, 2026-11-27)
    for name, value in digests[0]["optimizer"].items():
        if name.endswith("exp_avg"):
            torch.testing.assert_close(digests[1]["optimizer"][name], value, atol=1e-9, rtol=1e-4, msg=name)
    for name, value in digests[0]["params"].items():
        torch.testing.assert_close(digests[1]["params"][name], value, atol=2e-4, rtol=0, msg=name)
    assert metrics[1]["actor/pg_clipfrac"] == 0 and metrics[1]["actor/ppo_kl"] == pytest.approx(0, abs=1e-7)
    assert metrics[1]["actor/pg_loss"] == pytest.approx(metrics[0]["actor/pg_loss"], rel=1e-5, abs=1e-7)
    # verl 0.9.1's actor/entropy is the old-log-prob pass's, aggregated by loss_agg_mode over the response mask (its
    # non-empty rows in the seq-mean modes); the update reports it when it skipped that pass, and (entropy_coeff !=
    # 0) its own entropy term as actor/entropy_loss, whose seq-mean counts every row (verl's engine)
    expected = ops.agg_loss(entropys, mask.float(), cfg.actor.loss_agg_mode).item()
    assert metrics[1]["actor/entropy"] == pytest.approx(expected, rel=1e-5)
    every_row = ops.agg_loss(entropys, mask.float(), cfg.actor.loss_agg_mode, global_batch_info={
        "batch_num_tokens": float(mask.sum()), "global_batch_size": ROWS, "dp_size": 1}).item()
    assert metrics[1]["actor/entropy_loss"] == pytest.approx(every_row, rel=1e-5)
    nonempty = int((mask.sum(-1) > 0).sum())
    assert nonempty < ROWS if agg.startswith("seq-mean") else agg == "token-mean"  # the two denominators differ
    off_policy = ActorRolloutRefWorker(make_config(*TRAIN).actor_rollout_ref, "actor")  # 2 mini-batches
    off_policy.init_model()
    with pytest.raises(KeyError, match="lacks old_log_probs, which only an on-policy update"):
        off_policy.update_actor(batch)


@pytest.mark.skipif(not cpu_has_bf16(),
                    reason="this CPU has no native bf16 (fsdp_config.dtype=bfloat16 computes in fp32)")
def test_bf16_mixed_precision_on_cpu(ray_session, train_batch, tiny_path):
    """fsdp_config.dtype=bfloat16 on a CPU with bf16 instructions: the forward runs in bf16 (log-probs near, not
    equal to, float64's), the master weights and the optimizer stay float32 and train."""
    cfg = make_config(*TRAIN, "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16").actor_rollout_ref
    wg = WorkerGroup(ResourcePool([2]), ActorRolloutRefWorker, cfg, "actor")
    try:
        wg.init_model()
        before = wg.state_digest()[0]
        logp = wg.compute_log_prob(train_batch).batch["old_log_probs"]
        metrics = wg.update_actor(train_batch).meta_info["metrics"]
        after = wg.state_digest()[0]
    finally:
        wg.kill()
    expected, _ = hf_response_logprobs(tiny_path, train_batch)
    mask = train_batch.batch["response_mask"].bool()
    errors = (logp[mask].double() - expected[mask]).abs()
    # measured (AMD EPYC avx512_bf16, 30 tokens): mean 8.1e-4, max 3.9e-3 (about one bf16 step, 2^-8, at |logp| ~ 1);
    # the bounds leave 2.5x for another CPU's bf16 kernels. Rounding must show: an fp32 forward gives < 1e-5.
    assert 1e-5 < errors.max().item() < 1e-2, errors
    assert errors.mean().item() < 2e-3, errors
    assert all(v.dtype == torch.float32 for v in after["params"].values())
    assert max((after["params"][k] - v).abs().max().item() for k, v in before["params"].items()) > 1e-4
    assert all(torch.isfinite(torch.tensor(v)).all() for v in metrics["actor/pg_loss"])
