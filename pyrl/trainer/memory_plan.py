"""The memory plan: each phase's peak memory per rank, estimated before any worker starts, from the model's
config and the batch settings, checked against the device (trainer.memory_plan: check | warn | off).

One formula sheet. Every term is a tensor (or a set of tensors) the code allocates, counted in bytes from the
shapes the workers use; a term names the config key that shrinks it. Per rank, the processes that share its
device (the actor/rollout/reference process, the critic's, the reward model's) hold their resident state at once:
sharded master weights and AdamW's two moments (and, during an update only, the gradients: they are freed after
its last optimizer step), the reference's weights, the rollout engine's weights and KV cache. Phases run one at a
time, so a phase's peak is the resident set plus that phase's transient.

Token counts are the workers' (pyrl/workers/batching.py), at their worst: every sequence prompt_length +
response_length tokens long (L). A pass over R rows in micro-batches of m rows runs m x L tokens at once (packed,
or padded to L); with use_dynamic_bsz, max(max_token_len, L) tokens (the token budget; a longer row runs alone),
never more than the pass's rows. Log-probs (and values) are computed for the micro-batch's response tokens only:
tokens x response_length / L of them. use_prefix_grouper shares prompts and needs fewer: the plan stays an upper
bound there.

The capacity is taken where the worker processes will run: on a cluster the run joins (trainer.ray_address or
$RAY_ADDRESS), a small Ray task on each node the trainer's pool would take reports its GPU's memory or its available
RAM (Ray is joined for it, still before any worker starts); otherwise this machine's. A GPU holds one process; a
node's RAM is shared by the processes on it (on CPU the one-step-off rollout's beside the trainer's ranks). When the
capacity cannot be seen (GPU workers from a driver without one, no node to ask) the table is logged and one line
says the check is skipped. Without the hybrid engine the rollout's own processes are one more phase: the engine
alone.

What is not counted: the processes' own runtime (Python, torch, the libraries' code and caches: a few hundred MB
per process on CPU, the CUDA context on GPU), the driver, the batches themselves (ids and masks: a few bytes per
token), validation generation (val_batch_size), and the multi-turn agent loop's extra turns.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass, field

import torch

from pyrl.config import engine_max_model_len, recomputes, torch_dtype
from pyrl.models.gated_mlp import runs_gated
from pyrl.models.rms_norm import runs_fused_norm
from pyrl.models.varlen_attention import CPU_MATMUL_ATTENTION_MAX_LEN
from pyrl.ops.fused_linear_logprobs import default_chunk_size
from pyrl.trainer.run_plan import PASSES, ConfigValue
from pyrl.trainer.workers import start_ray
from pyrl.workers.batching import micro_batching
from pyrl.workers.fsdp import compute_dtype, offloads_params, shard_group_size, wraps_with_fsdp2
from pyrl.workers.lora import adapter_config, uses_lora
from pyrl.workers.precision import runnable_dtype
from pyrl.workers.rollout.vllm_engine import CPU_KV_CACHE_GIB

log = logging.getLogger("pyrl")

GiB = 1 << 30
MODES = ("check", "warn", "off")  # trainer.memory_plan
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the formulas read of a model: parameter counts (the whole model, one decoder layer, and the rest:
    embedding, final norm, head, what FSDP2's root holds) and the activation dimensions."""

    params: int
    layer_params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    trainable: int | None = None  # parameters that train (LoRA's adapters); None: all of them
    kind: str = "causal_lm"  # the head (from_hf_config's kind)
    gated_mlp: bool = False  # its MLPs are ones pyrl.models.gated_mlp runs (with model.use_fused_kernels)
    fused_norms: bool = False  # its norms are ones pyrl.models.rms_norm runs (with model.use_fused_kernels)

    @property
    def root_params(self) -> int:
        return self.params - self.layers * self.layer_params

    @property
    def trained_params(self) -> int:
        return self.params if self.trainable is None else self.trainable

    @property
    def head_trains(self) -> bool:
        return self.trainable is None  # LoRA leaves the output head frozen (pyrl.workers.lora refuses adapting it)

    @classmethod
    def from_hf_config(cls, hf_config, kind: str = "causal_lm", trust_remote_code: bool = False,
                       model_config=None) -> "ModelShape":
        """kind: causal_lm (actor, reference, rollout), token_classification (critic), sequence_classification
        (reward model), each with one label as the workers build them. Parameters are counted on a model built
        on the meta device (no memory, any architecture transformers knows); with `model_config`'s lora_rank > 0
        the trainable ones are the adapters (and the critic's head) PEFT adds there, as the workers add them."""
        import transformers  # lazy: transformers loads only to build a model on the meta device

        hf_config = copy.deepcopy(hf_config)
        if kind != "causal_lm":
            hf_config.num_labels = 1
        auto = {"causal_lm": transformers.AutoModelForCausalLM,
                "token_classification": transformers.AutoModelForTokenClassification,
                "sequence_classification": transformers.AutoModelForSequenceClassification}[kind]
        with torch.device("meta"):
            model = auto.from_config(hf_config, trust_remote_code=trust_remote_code)
        body = getattr(model, model.base_model_prefix)
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        params = sum(p.numel() for p in model.parameters())
        layer_params = sum(p.numel() for p in body.layers[0].parameters())
        gated = any(runs_gated(m) for m in body.layers[0].modules())  # before LoRA wraps the projections
        fused_norms = any(runs_fused_norm(m) for m in body.layers[0].modules())
        trainable = None
        if model_config is not None and uses_lora(model_config):  # no weights: adapters built from the config only
            from peft import get_peft_model  # lazy: peft loads only for LoRA

            get_peft_model(model, adapter_config(model_config, "CAUSAL_LM" if kind == "causal_lm" else "TOKEN_CLS"))
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return cls(params=params, layer_params=layer_params, layers=len(body.layers), trainable=trainable,
                   hidden=text.hidden_size, intermediate=text.intermediate_size, heads=heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   vocab=text.vocab_size, kind=kind, gated_mlp=gated, fused_norms=fused_norms)


@dataclass(frozen=True)
class MicroBatch:
    tokens: int  # tokens the model runs at once (T)
    scored: int  # response tokens scored (N): the logits' rows
    count: int = 1  # micro-batches in the pass, every row full length


def micro_batch(rows: int, micro_batch_size, use_dynamic_bsz: bool, max_token_len: int, prompt_length: int,
                response_length: int, group: int = 1) -> MicroBatch:
    """The largest micro-batch of a pass over `rows` rows of one rank (batching.micro_batch_indices), and how many
    the pass runs when every row is full length (a token budget then holds budget // length rows, at least one)."""
    length = prompt_length + response_length
    if use_dynamic_bsz:
        # at least one whole group of `group` rows (samples sharing a prompt run together; counted at full length)
        tokens = min(rows * length, max(int(max_token_len), group * length))
        rows_per_micro = max(group, int(max_token_len) // length)
    else:
        rows_per_micro = micro_batch_size or rows
        tokens = min(rows_per_micro, rows) * length
    return MicroBatch(tokens, tokens * response_length // length, max(1, math.ceil(rows / max(1, rows_per_micro))))


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    knobs: str = ""  # the config keys that shrink it


@dataclass
class Phase:
    name: str
    resident: list  # [Term]: what every co-located process holds during this phase
    transient: list  # [Term]: what this phase allocates on top
    skipped: str = ""  # why the phase does not run (shown, not counted)

    @property
    def peak(self) -> int:
        return sum(t.bytes for t in self.resident + self.transient)


@dataclass
class MemoryPlan:
    phases: list
    capacity: int | None  # bytes per process; None: not visible from the driver (nothing is checked)
    capacity_note: str = ""
    notes: list = field(default_factory=list)

    def running(self) -> list:
        return [p for p in self.phases if not p.skipped]

    def over(self) -> list:
        return [] if self.capacity is None else [p for p in self.running() if p.peak > self.capacity]

    def table(self) -> str:
        width = max(len(p.name) for p in self.phases)
        lines = [f"memory plan per process ({self.capacity_note}): phase, resident + transient = peak GiB"]
        for p in self.phases:
            if p.skipped:
                lines.append(f"  {p.name:<{width}}  skipped ({p.skipped})")
                continue
            resident, transient = sum(t.bytes for t in p.resident), sum(t.bytes for t in p.transient)
            lines.append(f"  {p.name:<{width}}  {resident / GiB:8.3f} + {transient / GiB:8.3f} = {p.peak / GiB:8.3f}"
                         f"{'  OVER' if p in self.over() else ''}")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])

    def error(self) -> str:
        """One message for the phases that do not fit, each with its largest terms and their knobs."""
        parts = []
        for p in self.over():
            terms = sorted((t for t in p.resident + p.transient if t.bytes), key=lambda t: -t.bytes)[:4]
            detail = "; ".join(f"{t.name} {t.bytes / GiB:.2f} GiB" + (f" ({t.knobs})" if t.knobs else "")
                               for t in terms)
            parts.append(f"{p.name} needs ~{p.peak / GiB:.2f} GiB per process: {detail}")
        return (f"the memory plan does not fit {self.capacity / GiB:.2f} GiB per process ({self.capacity_note}): "
                + " | ".join(parts) + ". Turn the knobs named, add ranks (trainer.n_gpus_per_node / trainer.nnodes / "
                "trainer.n_cpu_workers_per_node), or set trainer.memory_plan=warn to run anyway")


# ---- the formula sheet ----

def norm_bytes_per_hidden(dtype_bytes: int, fused: bool = False) -> int:
    """Bytes per token and hidden unit that one RMSNorm keeps for backward: float32 compute keeps its input, the
    normalized values and the output (3 x 4); reduced precision keeps the float32 upcast, the normalized values cast
    back and the output (4 + 2 + 2). pyrl.models.rms_norm (fused) keeps its input and the output (2 x dtype)."""
    if fused:
        return 2 * dtype_bytes
    return 12 if dtype_bytes == 4 else 4 + 2 * dtype_bytes


def layer_saved_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, matmul_attention_len: int = 0,
                      gated_mlp: bool = False, fused_norms: bool = False, attention_copy: bool = True) -> int:
    """A decoder layer's activations kept for backward: two RMSNorms, q/k/v after rotary (k, v at the KV heads'
    width), the attention output and, with attention_copy, a copy of it that o_proj keeps (pyrl's packed
    attention re-packs its length buckets' outputs; padded SDPA's math path is transposed back by a copy; CUDA's
    varlen kernel lays its output out as o_proj reads it, and so do equal-length rows, which the plan's
    worst case of full rows makes an overestimate by one [T, q] per layer on CPU), and the MLP's gate, its
    activation, up and their product (SwiGLU: 4 x intermediate; gated_mlp, pyrl.models.gated_mlp: the gate and up
    only; fused_norms: pyrl.models.rms_norm's norms).
    matmul_attention_len > 0: the CPU matmul attention for short bf16 sequences of that length also keeps float32
    q, k, v and the [heads, L, L] probabilities."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    mlp = (2 if gated_mlp else 4) * shape.intermediate
    saved = tokens * (2 * norm_bytes_per_hidden(dtype_bytes, fused_norms) * shape.hidden
                      + dtype_bytes * ((3 if attention_copy else 2) * q + 2 * kv + mlp))
    if matmul_attention_len:
        saved += tokens * 4 * (q + 2 * kv + shape.heads * matmul_attention_len)
    return saved


def layer_forward_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, matmul_attention_len: int = 0,
                        lora: bool = False) -> int:
    """A decoder layer's peak without autograd: the MLP's gate, up and activation at once (3 x intermediate) and its
    output, beside the embeddings (transformers keeps them through the forward), the residual stream and its sum
    and the normed input (5 x hidden), and the rotary cos and sin (2 x head_dim); float32 upcasts of the norm in
    reduced precision; the matmul attention's float32 scores and probabilities. With LoRA a projection's output is
    its base's plus the adapter's, a sum made beside both (one more [T, intermediate]). (Traced on CPU in float32,
    with no KV cache: ModelInputs.hidden_states asks for none.)"""
    peak = tokens * dtype_bytes * (5 * shape.hidden + (3 + lora) * shape.intermediate + 2 * shape.head_dim)
    if dtype_bytes < 4:
        peak += tokens * 4 * 2 * shape.hidden
    if matmul_attention_len:
        peak += tokens * 4 * 2 * shape.heads * matmul_attention_len
    return peak


def backward_workspace_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, gated_mlp: bool = False) -> int:
    """The gradients in flight inside one layer's backward: two [T, intermediate] (three in pyrl.models.gated_mlp's
    backward: the product's gradient, the up projection's and the recomputed product) and two [T, hidden]."""
    return tokens * dtype_bytes * ((3 if gated_mlp else 2) * shape.intermediate + 2 * shape.hidden)


def fused_chunk_rows(shape: ModelShape, scored: int, on_cuda: bool = False) -> int:
    return default_chunk_size(scored, shape.vocab, shape.hidden, on_cuda)


def logits_forward_bytes(shape: ModelShape, scored: int, dtype_bytes: int, fused: bool, on_cuda: bool = False) -> int:
    """The log-prob head without autograd: the scored hidden states and either the [N, vocab] logits
    (pyrl.ops.logprobs_from_logits makes no float32 copy) or, fused, one [chunk, vocab] block (every chunk's logits
    are written into it)."""
    blocks = fused_chunk_rows(shape, scored, on_cuda) if fused else scored
    return scored * shape.hidden * dtype_bytes + blocks * shape.vocab * dtype_bytes


def logits_update_bytes(shape: ModelShape, scored: int, dtype_bytes: int, fused: bool, on_cuda: bool = False,
                        grads_held: bool = False) -> int:
    """The log-prob head's backward: the scored hidden states and their gradient, plus unfused the [N, vocab]
    logits kept for backward and their gradient, or fused one [chunk, vocab] block (each chunk's logits, turned into
    their gradient in place) and, when the head trains (not with LoRA, which never adapts it), the float32 [vocab,
    hidden] weight gradient, made at the start of the backward (a float32 head's .grad, which the later gradients
    join; in a 16-bit dtype a float32 buffer and its cast, which autograd adds). grads_held: the .grad is already
    there (a later micro-batch; counted with the gradients): a float32 head adds into it in place, a 16-bit one
    still makes the buffer and its cast (pyrl.ops.fused_linear_logprobs.float32_grad_to_add_into)."""
    states = 2 * scored * shape.hidden * dtype_bytes
    if not fused:
        return states + 2 * scored * shape.vocab * dtype_bytes
    in_place = grads_held and dtype_bytes == 4
    weight_grad = (shape.vocab * shape.hidden * ((0 if in_place else 4) + (dtype_bytes if dtype_bytes < 4 else 0))
                   * shape.head_trains)
    return states + fused_chunk_rows(shape, scored, on_cuda) * shape.vocab * dtype_bytes + weight_grad


def element_bytes(dtype) -> int:
    return DTYPE_BYTES[str(dtype).removeprefix("torch.")]


def kv_cache_bytes(shape: ModelShape, tokens: int, dtype_bytes: int) -> int:
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * dtype_bytes * tokens


@dataclass(frozen=True)
class Precision:
    """Bytes per element: master weights (and gradients, AdamW's moments), forward/backward compute; fsdp2: whether
    FSDP2 wraps the model (fsdp.wraps_with_fsdp2), else it is a plain module, which gathers nothing; casts: a plain
    module computing in another dtype than its masters', by casting its weights for each forward
    (fsdp.cast_per_forward)."""

    master: int
    compute: int
    fsdp2: bool = False

    @property
    def casts(self) -> bool:
        return not self.fsdp2 and self.compute != self.master


def fsdp_precision(fsdp_config, setting: Setting) -> Precision:
    master = torch_dtype(fsdp_config.model_dtype, "fsdp_config.model_dtype")
    if not setting.distributed:  # fsdp_wrap: one process without a process group computes in master, unwrapped
        return Precision(element_bytes(master), element_bytes(master))
    compute = compute_dtype(fsdp_config, torch.device(setting.device))
    offloads = offloads_params(fsdp_config, setting.device)
    return Precision(element_bytes(master), element_bytes(compute),
                     wraps_with_fsdp2(setting.world, compute != master, offloads, setting.device))


@dataclass(frozen=True)
class Setting:
    """Where the ranks run: the device type, data-parallel world size, whether FSDP2 is on (a process group)."""

    device: str  # "cuda" | "cpu"
    world: int
    distributed: bool = True


def sharded_state(shape: ModelShape, precision: Precision, shards: int, world: int, trains: bool, offloaded: bool,
                  key: str, name: str) -> list:
    """Master weights (and gradients, AdamW's two moments for a trained model), sharded over `shards` ranks (all,
    or fsdp_size's groups); nothing on the device with param_offload on CUDA (FSDP2's CPUOffloadPolicy keeps them
    in host memory)."""
    if offloaded:
        return []
    shard = math.ceil(shape.params / shards) * precision.master
    spread = f"a larger {key}.fsdp_size" if shards < world else "more ranks"
    knob = f"{key}.param_offload=true (CUDA), or {spread}"
    terms = [Term(f"{name} weights", shard, knob)]
    if trains:  # for the trained parameters only (LoRA: the adapters)
        trained = math.ceil(shape.trained_params / shards) * precision.master
        terms += [Term(f"{name} gradients", trained, knob),
                  Term(f"{name} AdamW moments", 2 * trained, f"{key}.optimizer_offload=true (CUDA), or {spread}")]
    return terms


def gathered_bytes(shape: ModelShape, precision: Precision, backward: bool, checkpointing: bool = True) -> int:
    """FSDP2's unsharded parameters in compute dtype: the root (embedding, final norm, head: kept gathered
    through the forward and backward) and two decoder layers (the one running and the one prefetched); in
    backward also their unsharded gradients. A plain module casting its weights per forward (precision.casts: one
    rank with mixed precision on a CPU) holds the root's copies and the running layer's, and in backward their
    gradients in compute dtype; in an update without gradient checkpointing autograd keeps every layer's copy for
    its backward. A plain module in its master dtype (a single process without a process group, or one rank
    without mixed precision) gathers nothing."""
    if precision.fsdp2:
        params = shape.root_params + 2 * shape.layer_params
        return params * precision.compute * (2 if backward else 1)
    if not precision.casts:
        return 0
    running = shape.root_params + shape.layer_params
    if not backward:
        return running * precision.compute
    return ((running if checkpointing else shape.params) + running) * precision.compute


def forward_pass(shape: ModelShape, precision: Precision, setting: Setting, mb: MicroBatch, length: int,
                 head: str, fused: bool, prefix: str, lora: bool = False) -> list:
    """A forward without autograd (old-log-prob, reference, values, reward scores): the layer peak or the head,
    whichever is larger (the hidden states between layers are one [T, hidden] tensor), plus gathered weights.
    head: "logits" (the vocabulary), "value" (one number per token)."""
    attn = matmul_attention_len(setting, precision, length)
    layer = layer_forward_bytes(shape, mb.tokens, precision.compute, attn, lora)
    micro = f"{prefix} micro-batch size or token budget"
    if head == "logits":
        head_bytes = logits_forward_bytes(shape, mb.scored, precision.compute, fused, setting.device == "cuda")
        head_term = Term("logits", head_bytes, ", ".join(
            k for k in ("" if fused else "actor_rollout_ref.model.use_fused_kernels=true", micro) if k))
    else:
        head_term = Term("head", mb.scored * shape.hidden * precision.compute, micro)
    largest = head_term if head_term.bytes > layer else Term("activations", layer, micro)
    return [largest, Term("gathered weights", gathered_bytes(shape, precision, backward=False))]


def update_pass(shape: ModelShape, precision: Precision, setting: Setting, mb: MicroBatch, length: int,
                head: str, fused: bool, checkpointing: bool, prefix: str, model_key: str, shards: int,
                gated_mlp: bool = False, fused_norms: bool = False, attention_copy: bool = True,
                grads_offloaded: bool = False) -> list:
    """A micro-batch's forward and backward. Kept through the backward: every layer's saved activations (with gradient
    checkpointing only each layer's input) and the final norm's. On top, the larger of the head's backward (which
    runs first) and one layer's backward (its activations recomputed with checkpointing, and the gradients in
    flight). Unfused in one process the head's weight gradient lands beside the logits' gradient once the logits are
    released (it counts where it is larger than they); distributed, FSDP2's gathered weights and unsharded
    gradients. The optimizer step runs after the activations are freed, and adds nothing: torch's fused AdamW
    (pyrl/workers/optim.py) makes no temporaries. The gradients are not resident when the update starts (the last
    update freed them after its step); they return during the backward (the peak may come late, when they are nearly
    all back). A mini-batch's first micro-batch starts without gradients (run_update sets them to None before it);
    with more than one micro-batch the later ones run their whole forward and backward beside all of them.
    grads_offloaded (param_offload on CUDA): FSDP2 keeps the sharded gradients in host memory, none on the device."""
    attn = matmul_attention_len(setting, precision, length)
    per_layer = layer_saved_bytes(shape, mb.tokens, precision.compute, attn, gated_mlp, fused_norms, attention_copy)
    # the final norm's output is not kept: the head keeps its scored rows, gathered (counted in the head's term)
    final_norm = mb.tokens * (norm_bytes_per_hidden(precision.compute, fused_norms) - precision.compute) * shape.hidden
    micro = f"{prefix} micro-batch size or token budget"
    workspace = backward_workspace_bytes(shape, mb.tokens, precision.compute, gated_mlp)
    if checkpointing:
        kept = Term("activations (layer inputs, checkpointed)",
                    shape.layers * mb.tokens * shape.hidden * precision.compute + final_norm, micro)
        layer = Term("layer backward (recomputed layer + gradients)", per_layer + workspace, micro)
    else:
        kept = Term("activations", shape.layers * per_layer + final_norm,
                    f"{model_key}.enable_gradient_checkpointing=true, {micro}")
        layer = Term("layer backward (gradients)", workspace, micro)
    head_grad = 0
    grads = 0 if grads_offloaded else math.ceil(shape.trained_params / shards) * precision.master
    held = mb.count > 1  # the second micro-batch onwards: the first one's gradients are held throughout
    if head == "logits":
        head_bytes = logits_update_bytes(shape, mb.scored, precision.compute, fused, setting.device == "cuda",
                                         grads_held=held and not precision.fsdp2)
        head_term = Term("logits", head_bytes,
                         micro if fused else f"{model_key}.use_fused_kernels=true, {micro}")
        if not fused and not precision.fsdp2 and shape.head_trains:  # after the logits are released
            head_grad = max(0, shape.vocab * shape.hidden * precision.master
                            - mb.scored * shape.vocab * precision.compute)
    else:
        head_term = Term("head", 2 * mb.scored * shape.hidden * precision.compute, micro)
    backward = max(head_term, layer, key=lambda t: t.bytes)
    early = kept.bytes + backward.bytes + head_grad
    if held:
        gradients = Term("gradients, held from the second micro-batch", grads,
                         f"fewer micro-batches ({micro}), or fsdp_config.param_offload=true (CUDA), or more ranks")
    else:
        # late in the backward the gradients are back (all but the first layer's and the embedding's, which come
        # last) beside the first layer's backward: with small activations (checkpointing) that is the peak
        last = (shape.layer_params + shape.vocab * shape.hidden) * precision.master // shards
        late = max(grads, grads - min(grads, last) + layer.bytes)
        gradients = Term("gradients, late in the backward", max(0, late - early),
                         "fsdp_config.param_offload=true (CUDA), or more ranks")
    return [kept, backward, Term("head weight gradient", head_grad), gradients,
            Term("gathered weights and gradients", gathered_bytes(shape, precision, backward=True,
                                                                  checkpointing=checkpointing))]


def matmul_attention_len(setting: Setting, precision: Precision, length: int) -> int:
    on = setting.device == "cpu" and precision.compute < 4 and length <= CPU_MATMUL_ATTENTION_MAX_LEN
    return length if on else 0


# ---- the plan of a run ----

def engine_weights(shape: ModelShape, dtype: int, rollout, key: str, label: str) -> Term:
    """A rollout engine's weights in one process: with tensor parallelism each rank (worker) holds its share."""
    tp = rollout.tensor_model_parallel_size
    if tp > 1:
        return Term(f"{label} (one tensor-parallel shard)", shape.params * dtype // tp,
                    f"{key}.dtype, {key}.tensor_model_parallel_size")
    return Term(label, shape.params * dtype, f"{key}.dtype")


def vllm_terms(rollout, key: str, prefix: str, weights: Term, setting: Setting,
               capacity: int | None) -> tuple[list, list]:
    """(resident, transient while it serves) of a vLLM engine: on CUDA it takes gpu_memory_utilization of the
    device (nothing counted when its size is unknown), all of it freed asleep (free_cache_engine); on CPU its weights,
    which stay, and its KV cache, freed asleep (VLLMEngine.sleep)."""
    if setting.device == "cuda":
        engine = Term(f"{prefix}vLLM (gpu_memory_utilization x device)",
                      int(rollout.gpu_memory_utilization * (capacity or 0)), f"{key}.gpu_memory_utilization")
        return ([], [engine]) if rollout.free_cache_engine else ([engine], [])
    kv = Term(f"{prefix}vLLM KV cache (VLLM_CPU_KVCACHE_SPACE)",
              int(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or CPU_KV_CACHE_GIB) * GiB,
              "the VLLM_CPU_KVCACHE_SPACE environment variable (GiB)")
    return ([weights], [kv]) if rollout.free_cache_engine else ([weights, kv], [])


def engine_terms(config, shape: ModelShape, setting: Setting, capacity: int | None, rows: int) -> tuple[list, list]:
    """(resident, rollout-phase transient) of the rollout engine in one process generating for `rows` prompts."""
    rollout = config.actor_rollout_ref.rollout
    key = "actor_rollout_ref.rollout"
    dtype = element_bytes(runnable_dtype(rollout.dtype, f"{key}.dtype", torch.device(setting.device)))
    length = rollout.prompt_length + rollout.response_length
    weights = engine_weights(shape, dtype, rollout, key, "rollout engine weights")
    if rollout.name == "vllm":
        return vllm_terms(rollout, key, "", weights, setting, capacity)
    # hf: generate's KV cache for every row at full length (grown by concatenation: one layer's copy on top),
    # the prefill's forward over every prompt, float32 scores of each step kept for the log-probs (stacked and
    # log-softmaxed at the end: three copies)
    samples = rows * rollout.n
    kv = kv_cache_bytes(shape, samples * length, dtype)
    prefill = layer_forward_bytes(shape, samples * rollout.prompt_length, dtype)
    scores = 3 * samples * rollout.response_length * shape.vocab * 4 if rollout.calculate_log_probs else 0
    rows_knob = "data.train_batch_size, rollout.n, or more ranks"
    return [weights], [Term("hf generate KV cache", kv + kv // shape.layers, f"{rows_knob}, {key}.name=vllm"),
                       Term("hf generate prefill", prefill, rows_knob),
                       Term("hf generate scores (calculate_log_probs)", scores,
                            f"{key}.calculate_log_probs=false or {key}.name=vllm")]


def hf_engine_uses_actor_weights(config, actor: RoleState, setting: Setting) -> bool:
    """Whether the actor's workers' hf engine generates with the actor's own tensors (no copy of its own; the
    actor's test, ActorRolloutRefWorker._engine_can_use_actor_weights, on the config): the actor's weights whole on
    one rank, in the engine's dtype, on its device, no LoRA, no rollout tensor parallelism."""
    arr = config.actor_rollout_ref
    device = torch.device(setting.device)
    fsdp = arr.actor.fsdp_config
    return (arr.rollout.name == "hf" and arr.rollout.tensor_model_parallel_size == 1 and actor.shards == 1
            and not uses_lora(arr.model) and not offloads_params(fsdp, setting.device)
            and runnable_dtype(arr.rollout.dtype, "actor_rollout_ref.rollout.dtype", device)
            == torch_dtype(fsdp.model_dtype, "actor_rollout_ref.actor.fsdp_config.model_dtype"))


def served_reward_model_terms(config, shape: ModelShape, setting: Setting, capacity: int | None) -> tuple[list, list]:
    """(resident, reward-step transient) of a served reward model's engine in one process (pyrl.workers.
    reward_server; with tensor parallelism, one of a replica's vLLM workers): vLLM as any engine (vllm_terms); the hf
    engine keeps its weights and builds a KV cache for the requests it batches (at most rollout.max_num_seqs: an
    async reward function sends a batch's calls at once)."""
    rollout = config.reward.reward_model.rollout
    key = "reward.reward_model.rollout"
    dtype = element_bytes(runnable_dtype(rollout.dtype, f"{key}.dtype", torch.device(setting.device)))
    length = engine_max_model_len(rollout)
    weights = engine_weights(shape, dtype, rollout, key, "reward model weights (served)")
    if rollout.name == "vllm":
        return vllm_terms(rollout, key, "reward model ", weights, setting, capacity)
    in_flight = rollout.max_num_seqs
    if shape.kind == "sequence_classification":  # one request's forward at a time
        return [weights], [Term("reward model forward (one request)", layer_forward_bytes(shape, length, dtype),
                                f"{key}.prompt_length + response_length")]
    return [weights], [Term("reward model hf generate KV cache (requests batched)",
                            kv_cache_bytes(shape, in_flight * length, dtype),
                            f"{key}.max_num_seqs, {key}.response_length, {key}.name=vllm")]


LABELS = {"actor": "actor", "ref": "reference", "critic": "critic", "reward_model": "reward model"}  # in the table


@dataclass(frozen=True)
class RoleState:
    """What a role holds on a rank: `state` while it trains, `idle` between its updates (no gradients: the update
    frees them after its last step; optimizer_offload moves AdamW's moments off the device too)."""
    precision: Precision
    shards: int
    state: list
    idle: list
    offloaded: bool = False  # param_offload on CUDA: weights, gradients and moments in host memory


def role_state(config, role, shape: ModelShape, setting: Setting) -> RoleState:
    fsdp = ConfigValue(role.fsdp).read(config)
    precision = fsdp_precision(fsdp, setting)
    shards = shard_group_size(fsdp.fsdp_size, setting.world)
    on_cuda = setting.device == "cuda"
    if not role.owns_weights:  # another role's weights, counted there
        return RoleState(precision, shards, [], [])
    params_offloaded = offloads_params(fsdp, setting.device)
    state = sharded_state(shape, precision, shards, setting.world, role.trains, params_offloaded,
                          role.fsdp, LABELS.get(role.name, role.name.replace("_", " ")))
    moments_offloaded = role.trains and fsdp.optimizer_offload and on_cuda and not params_offloaded
    idle = [t for t in state if "gradients" not in t.name and not (moments_offloaded and "moments" in t.name)]
    return RoleState(precision, shards, state, idle, params_offloaded)


@dataclass(frozen=True)
class TeacherPass:
    name: str  # its distillation.teacher_models entry
    shape: ModelShape
    precision: Precision
    budget: int  # tokens per micro-batch (inference.max_num_batched_tokens)
    knob: str


@dataclass
class TeacherState:
    """On-policy distillation's teachers (pyrl.algos.distillation) in the actor's workers: frozen weights sharded
    under ref.fsdp_config (computing in each teacher's inference.dtype), every teacher's held at once, and their
    scoring passes, one after another (logits whole: their top-k, or the sampled token's log-prob)."""
    idle: list
    passes: list = field(default_factory=list)  # [TeacherPass]
    topk: bool = False

    def phases(self, idle: list, setting: Setting, length: int, rollout, rows: int) -> list[Phase]:
        """A phase per teacher (each counted over all `rows`: with several teachers a bound on its share)."""
        out = []
        for t in self.passes:
            mb = micro_batch(rows, None, True, t.budget, rollout.prompt_length, rollout.response_length)
            out.append(Phase("teacher" if len(self.passes) == 1 else f"teacher ({t.name})", idle,
                             forward_pass(t.shape, t.precision, setting, mb, length, "logits", False, t.knob)))
        return out


def teacher_state(config, run, shapes: dict, setting: Setting) -> TeacherState:
    """shapes: each teacher's under "teacher/<its entry name>". In a pool of their own the teachers hold nothing in
    the trainer's ranks (teacher_server_phases)."""
    if not run.runs("teacher"):
        return TeacherState([])
    from pyrl.algos.distillation import teacher_fsdp_config, teachers_of, uses_topk  # lazy: they load the ops

    if run.teacher_pool is not None:
        return TeacherState([], [], uses_topk(config.distillation.distillation_loss))
    teachers = teachers_of(config.distillation)
    idle, passes = [], []
    for name, model in teachers:
        fsdp = teacher_fsdp_config(config.actor_rollout_ref.ref.fsdp_config, model)
        precision = fsdp_precision(fsdp, setting)
        shape = shapes[f"teacher/{name}"]
        idle += sharded_state(shape, precision, shard_group_size(fsdp.fsdp_size, setting.world), setting.world, False,
                              offloads_params(fsdp, setting.device), "actor_rollout_ref.ref.fsdp_config",
                              "teacher" if len(teachers) == 1 else f"teacher ({name})")
        passes.append(TeacherPass(name, shape, precision, model.inference.max_num_batched_tokens,
                                  f"distillation.teacher_models.{name}.inference.max_num_batched_tokens"))
    return TeacherState(idle, passes, uses_topk(config.distillation.distillation_loss))


def teacher_server_phases(config, run, shapes: dict, setting: Setting, capacity: int | None) -> list[Phase]:
    """A phase per teacher served from the teachers' own pool (pyrl.workers.teacher_server), one replica's process:
    vLLM as any engine (vllm_terms); the hf engine its weights and a forward over inference.max_num_batched_tokens
    tokens (logits whole)."""
    from pyrl.algos.distillation import teachers_of  # lazy: the algorithms load the ops

    rollout = config.actor_rollout_ref.rollout
    length = rollout.prompt_length + rollout.response_length
    teachers = teachers_of(config.distillation)
    phases = []
    for name, teacher in teachers:
        inference, key = teacher.inference, f"distillation.teacher_models.{name}.inference"
        shape = shapes[f"teacher/{name}"]
        dtype = element_bytes(runnable_dtype(inference.dtype, f"{key}.dtype", torch.device(setting.device)))
        weights = engine_weights(shape, dtype, inference, key, "teacher weights (served)")
        if inference.name == "vllm":
            resident, transient = vllm_terms(inference, key, "teacher ", weights, setting, capacity)
        else:
            mb = micro_batch(run.rows_per_step, None, True, inference.max_num_batched_tokens, rollout.prompt_length,
                             rollout.response_length)
            resident, transient = [weights], forward_pass(shape, Precision(dtype, dtype), Setting(setting.device, 1,
                                                                                               False),
                                                          mb, length, "logits", False,
                                                          f"{key}.max_num_batched_tokens")
        phases.append(Phase("teacher server (its own pool)" + (f", {name}" if len(teachers) > 1 else ""), resident,
                            transient))
    return phases


def plan(config, run, shapes: dict, capacity: int | None, capacity_note: str = "",
         distributed: bool = True) -> MemoryPlan:
    """The phases of a PPO step on one rank of the run `run` (its RunPlan): a phase per micro-batched pass of its
    roles, in the step's order, and the one-step-off rollout's own processes (actor_rollout_ref.hybrid_engine=false)
    as one more phase (a rollout worker holds the engine alone). shapes: ModelShape by the role whose model it is
    (Role.model_of: "actor", and "critic" / "reward_model" when they run; "teacher/<entry>" per teacher).
    distributed=False: one process without a process group (FSDP2 gathers nothing)."""
    arr = config.actor_rollout_ref
    rollout = arr.rollout
    setting = Setting(run.trainer_pool.device, run.world_size, distributed)
    length = rollout.prompt_length + rollout.response_length
    on_cuda = setting.device == "cuda"
    roles = [r for r in run.roles if r.fsdp is not None]  # the rollout's engine is counted apart
    states = {r.name: role_state(config, r, shapes[r.model_of or r.name], setting) for r in roles}
    notes = []
    if capacity is None and rollout.name == "vllm" and on_cuda:
        notes.append("vLLM's gpu_memory_utilization x the device is not counted: the device's size is unknown")
    if run.rollout_pool is None:  # the hybrid engine: each rank's
        engine_resident, engine_rollout = engine_terms(config, shapes["actor"], setting, capacity,
                                                       run.prompts_per_rank)
        if hf_engine_uses_actor_weights(config, states["actor"], setting):
            engine_resident = []  # the engine's parameters are the actor's own tensors
    else:  # the rollout's own workers (one-step-off): their engine is not in these ranks, see the last phase
        engine_resident, engine_rollout = [], []
    teacher = teacher_state(config, run, shapes, setting)
    served = next((r for r in run.roles if r.kind == "served"), None)
    rm_resident, rm_reward = (served_reward_model_terms(config, shapes["reward_model"], setting, capacity)
                              if served else ([], []))
    if served and run.reward_model_pool is not None:  # in processes of its own pool: the last phase
        rm_resident = []
    idle = [t for s in states.values() for t in s.idle] + teacher.idle + engine_resident + rm_resident
    # loading: each model is built whole in float32 (from_pretrained), moved to the device, then sharded
    load = shapes["actor"].params * max(4, states["actor"].precision.master)
    phases = [Phase("load (whole model before sharding)", [], [Term("one whole model in float32", load,
                                                                     "a device with more memory")]),
              Phase("rollout", idle, engine_rollout)]
    if served and run.reward_model_pool is None:  # colocated: awake during the reward step
        phases.append(Phase("reward (served reward model)", idle, rm_reward))
    why = dict(run.why)
    passes = sorted(((r, m) for r in roles for m in r.micro), key=lambda rm: PASSES.index(rm[1].step_pass))
    teacher_pending = run.runs("teacher")  # its phase in the step's order (the update pass always follows it)
    for role, micro in passes:
        if teacher_pending and PASSES.index(micro.step_pass) > PASSES.index("teacher"):
            phases += teacher.phases(idle, setting, length, rollout, run.rows_per_rank)
            teacher_pending = False
        shape, state = shapes[role.model_of or role.name], states[role.name]
        head = "logits" if role.kind == "causal_lm" else "value"
        role_model = ConfigValue(role.model_section).read(config)
        # forward_kl_topk distillation: the student's update takes the logits whole (their top-k log-probs)
        fused = head == "logits" and role_model.use_fused_kernels and not (role.name == "actor" and teacher.topk)
        # a token budget runs a prompt's n samples together where they share it (a group over the budget alone)
        group = rollout.n if role_model.use_remove_padding and role.name in ("actor", "ref") and \
            arr.actor.use_prefix_grouper else 1
        mb = micro_batch(micro.rows, *micro_batching(micro.size, micro.dynamic, micro.budget, setting.device == "cpu",
                                                     micro.recut), rollout.prompt_length, rollout.response_length,
                         group)
        if not micro.trains:
            skipped = "" if run.runs(micro.step_pass) else why[micro.step_pass].removeprefix("skipped: ")
            adapted = role.name != "ref" and uses_lora(role_model)  # the reference runs with the adapters off
            phases.append(Phase(micro.phase, idle, forward_pass(shape, state.precision, setting, mb, length, head,
                                                                fused, micro.knob, adapted), skipped))
            continue
        # while a role trains it holds its whole state but the gradients (they come back during the backward,
        # update_pass counts them); the others idle
        during = [t for name, s in states.items() for t in
                  ([t for t in s.state if "gradients" not in t.name] if name == role.name else s.idle)]
        # model.use_fused_kernels patches a causal LM's gated MLPs and RMSNorms (pyrl.workers.models.load_policy);
        # LoRA's wrapped projections turn the MLPs back (counted as unpatched: the larger)
        gated = (head == "logits" and shape.gated_mlp and role_model.use_fused_kernels
                 and not uses_lora(role_model))
        fused_norms = head == "logits" and shape.fused_norms and role_model.use_fused_kernels
        # packed bf16/fp16 attention on CUDA is one varlen kernel per layer (pyrl.models.varlen_attention)
        varlen = setting.device == "cuda" and state.precision.compute < 4 and role_model.use_remove_padding
        phases.append(Phase(micro.phase, during + teacher.idle + engine_resident + rm_resident, update_pass(
            shape, state.precision, setting, mb, length, head, fused, recomputes(role_model), micro.knob,
            role.model_section, state.shards, gated, fused_norms, attention_copy=not varlen,
            grads_offloaded=state.offloaded)))
    if run.rollout_pool is not None:  # a process of its own, running beside the ranks (on CPU on the same nodes' RAM)
        phases.append(Phase("rollout worker (one-step-off)", *engine_terms(
            config, shapes["actor"], setting, capacity, run.prompts_per_rollout_process)))
    if served and run.reward_model_pool is not None:
        phases.append(Phase("reward model server (its own pool)", *served_reward_model_terms(
            config, shapes["reward_model"], setting, capacity)))
    if run.runs("teacher") and run.teacher_pool is not None:
        phases += teacher_server_phases(config, run, shapes, setting, capacity)
    if arr.actor.use_prefix_grouper:
        notes.append("actor.use_prefix_grouper shares prompts: fewer tokens than counted")
    return MemoryPlan(phases, capacity, capacity_note, notes)


# ---- the driver's check ----

PROBE_TIMEOUT_S = 60.0  # a cluster node's probe task (it waits for a free GPU)


def device_memory(device: str) -> tuple[int, str] | None:
    """(bytes, what they are) on the machine this runs on: the first GPU's memory, or the RAM available now; None
    for "cuda" where torch sees no GPU. Runs in the driver, or in a Ray task on a cluster node (cluster_capacity)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, props.name
    import psutil  # lazy: psutil is needed only for a CPU capacity

    return psutil.virtual_memory().available, "CPU RAM available"


@dataclass(frozen=True)
class Capacity:
    bytes: int | None  # per process; None: not visible from the driver (the plan is logged, not checked)
    note: str


def capacity_of(found: tuple[int, str], device: str, per_node: int, where: str) -> Capacity:
    """A GPU holds one process; a node's available RAM is shared by its processes."""
    total, name = found
    if device == "cuda":
        return Capacity(total, f"{name}, {total / GiB:.1f} GiB{where}")
    return Capacity(total // per_node, f"{name} {total / GiB:.1f} GiB{where} / {per_node} process(es) per node")


def cluster_capacity(config, run, device: str, per_node: int) -> Capacity:
    """Joins the run's cluster (build_workers finds it joined) and asks the nodes the trainer's pool would take now
    (choose_nodes over their free resources), each with a small Ray task pinned to it (holding a GPU for GPU
    workers): the smallest capacity over them. None when no node can be chosen or a probe does not answer."""
    # lazy: Ray loads only to ask a cluster's nodes
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pyrl.controller.worker_group import PlacementError, alive_nodes, choose_nodes

    start_ray(config)
    gpus = 1 if device == "cuda" else 0
    try:
        nodes = choose_nodes(alive_nodes(), [per_node] * run.trainer_pool.nnodes, 1, gpus,
                             first=ray.get_runtime_context().get_node_id())
    except PlacementError as e:
        return Capacity(None, f"no node of the cluster to ask: {e}")
    probe = ray.remote(device_memory)
    refs = [probe.options(num_cpus=0, num_gpus=gpus,
                          scheduling_strategy=NodeAffinitySchedulingStrategy(node.id, soft=False)).remote(device)
            for node in nodes]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=PROBE_TIMEOUT_S)
    for ref in pending:
        ray.cancel(ref, force=True)
    if pending:
        return Capacity(None, f"the probe of the cluster's nodes did not answer within {PROBE_TIMEOUT_S:.0f} s")
    found = ray.get(refs)
    if any(f is None for f in found):
        return Capacity(None, "the torch on a chosen node sees no GPU")
    smallest = min(range(len(nodes)), key=lambda i: capacity_of(found[i], device, per_node, "").bytes)
    where = (f" on node {nodes[smallest].id[:8]} ({nodes[smallest].ip}), the smallest of {len(nodes)} probed"
             if len(nodes) > 1 else f" on node {nodes[smallest].id[:8]} ({nodes[smallest].ip}), probed")
    return capacity_of(found[smallest], device, per_node, where)


def run_capacity(config, run) -> Capacity:
    """Bytes one worker process may use where the processes of `run` (its RunPlan) will run: on the nodes of the
    cluster the run joins (trainer.ray_address or $RAY_ADDRESS, Ray's own switch), asked there; otherwise this
    machine's (a private local Ray), unless it has no GPU for GPU workers."""
    device, per_node = run.trainer_pool.device, run.processes_per_node
    if config.trainer.ray_address or os.environ.get("RAY_ADDRESS"):
        return cluster_capacity(config, run, device, per_node)
    found = device_memory(device)
    if found is None:
        return Capacity(None, "GPU workers, but torch in the driver sees no GPU")
    return capacity_of(found, device, per_node, "")


def memory_plan_of(config, run, capacity: Capacity | None = None) -> MemoryPlan:
    """The memory plan of the run `config` (resolved: model paths local) with RunPlan `run`, on the devices the
    workers will get (their `capacity` when it was asked already)."""
    from transformers import AutoConfig  # lazy: transformers loads only to read the models' configs

    shapes = {}
    for role in run.model_roles():
        model = ConfigValue(role.model_section).read(config)
        hf = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code,
                                        **dict(model.override_config))
        kind = role.kind
        if kind == "served":  # a classifier or a generative judge, as its checkpoint says (pyrl.workers.reward_server)
            kind = "sequence_classification" if any(a.endswith("ForSequenceClassification")
                                                    for a in hf.architectures or []) else "causal_lm"
        lora_from = model if kind != "sequence_classification" and role.kind != "served" else None
        shapes[role.model_of or role.name] = ModelShape.from_hf_config(hf, kind, model.trust_remote_code, lora_from)
    if run.runs("teacher"):  # on-policy distillation's teacher, in the actor's workers
        from pyrl.algos.distillation import teachers_of  # lazy: the algorithms load the ops

        trust = config.actor_rollout_ref.model.trust_remote_code
        for name, teacher in teachers_of(config.distillation):
            hf = AutoConfig.from_pretrained(teacher.model_path, trust_remote_code=trust)
            shapes[f"teacher/{name}"] = ModelShape.from_hf_config(hf, "causal_lm", trust)
    capacity = capacity or run_capacity(config, run)
    return plan(config, run, shapes, capacity.bytes, capacity.note)


def check_memory_plan(config, run) -> MemoryPlan | None:
    """trainer.memory_plan: check (log the table; stop when a phase does not fit, naming its knobs), warn (log
    and go on), off (nothing), for the run's RunPlan `run`. First resolve_gradient_checkpointing."""
    mode = config.trainer.memory_plan
    if mode not in MODES:
        raise ValueError(f"trainer.memory_plan={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off":
        resolve_gradient_checkpointing(config, run, None)
        log.info("trainer.memory_plan=off: the memory plan is not checked")
        return None
    capacity = run_capacity(config, run)
    resolve_gradient_checkpointing(config, run, capacity)
    result = memory_plan_of(config, run, capacity)
    log.info("%s", result.table())
    if result.capacity is None:
        log.warning("memory plan: the fit check is skipped, the workers' memory is not visible from the driver (%s)",
                    result.capacity_note)
    elif result.over():
        if mode == "check":
            raise MemoryError(result.error())
        log.warning("trainer.memory_plan=warn: %s", result.error())
    return result


CHECKPOINTING_HEADROOM = 0.5  # recompute unless every phase fits in this share of the memory per process without


def resolve_gradient_checkpointing(config, run, capacity: Capacity | None) -> None:
    """model.enable_gradient_checkpointing left null (pyrl's default for the actor and critic; verl 0.9.1's is true):
    off where the plan without it keeps every phase within CHECKPOINTING_HEADROOM of `capacity` (the plan is an
    upper bound and leaves out each process's runtime; recomputing every layer's forward in the backward costs about
    a third more update time and changes no number), on otherwise and where the capacity is unknown (None: the plan
    is off or cannot see the devices). An explicit true or false is kept. One log line says what was chosen."""
    models = [(key, model) for key, model in (("actor_rollout_ref.model", config.actor_rollout_ref.model),
                                              ("critic.model", config.critic.model))
              if model.enable_gradient_checkpointing is None]
    if not models:
        return
    if capacity is None or capacity.bytes is None:
        recompute, why = True, "the memory per process is not known"
    else:
        for _, model in models:
            model.enable_gradient_checkpointing = False
        peak = max(phase.peak for phase in memory_plan_of(config, run, capacity).running())
        recompute = peak > CHECKPOINTING_HEADROOM * capacity.bytes
        why = (f"the memory plan's largest phase without it, {peak / GiB:.2f} GiB, is "
               f"{'over' if recompute else 'within'} {CHECKPOINTING_HEADROOM:.0%} of {capacity.bytes / GiB:.2f} GiB "
               "per process")
    for _, model in models:
        model.enable_gradient_checkpointing = recompute
    log.info("gradient checkpointing %s (%s: null, pyrl's default; verl 0.9.1's is true): %s; set it true or false to "
             "choose", "on" if recompute else "off",
             ", ".join(f"{key}.enable_gradient_checkpointing" for key, _ in models), why)
