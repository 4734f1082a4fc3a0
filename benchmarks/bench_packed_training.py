"""Packed (remove-padding) vs padded forward + backward of the policy on a long-tailed micro-batch, and the
CPU attention choices behind packed training.

1. test_packed_vs_padded_step: ResponseLogProbs (the actor's update forward, fused log-probs) + backward of the
   summed log-probs on one micro-batch of 64 sequences, fp32 and bf16 weights: long-tailed (log-normal prompts,
   median 74, max 384 tokens, geometric responses, mean ~16, cut at 32), packed vs padded to the micro-batch's
   longest row, target packed/padded <= the token ratio real/padded; and uniform (every row 74 + 16 tokens), target
   packed/padded <= 1.02.
2. test_varlen_attention: causal attention fwd + bwd over those sequences (8 heads of 64, 2 KV heads): pyrl's
   length buckets vs one SDPA call per sequence vs one call with a block-diagonal mask (the square of the total)
   vs the padded batch.
3. test_bucket_attention_cpu: one bucket (~1,536 tokens as b sequences of L) fwd + bwd, fp32 and bf16, pyrl's
   two-matmul path vs SDPA (with GQA): the crossover behind varlen_attention.CPU_MATMUL_ATTENTION_MAX_LEN.

The model is bench_e2e's ~24M-parameter Qwen2 (pyrl.models.BENCH_SPEC); smoke mode (benchmarks disabled, as CI
runs them) uses the tiny model and 8 sequences.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from pyrl.models import tiny_model_path, varlen_attention
from pyrl.models.tiny import BENCH_SPEC, TinyModelSpec
from pyrl.workers.batching import ModelInputs
from pyrl.workers.policy import ResponseLogProbs

CPU = torch.device("cpu")


def long_tailed_batch(rows: int, vocab: int, seed: int = 0):
    """Left-padded log-normal prompts and right-padded geometric responses, as a rollout returns them."""
    g = torch.Generator().manual_seed(seed)
    prompt = (torch.exp(torch.randn(rows, generator=g) * (math.log(384 / 74) / 2.4) + math.log(74))).round()
    prompt = prompt.clamp(12, 384).long()
    # geometric (mean ~16) by inverting its CDF with the seeded generator, so every call draws the same batch
    response = (torch.log(torch.rand(rows, generator=g)) / math.log(1 - 1 / 16)).floor().long().add(1).clamp(1, 32)
    prompt_width, response_width = int(prompt.max()), int(response.max())
    cols = torch.arange(prompt_width + response_width)
    mask = ((cols >= prompt_width - prompt[:, None]) & (cols < prompt_width + response[:, None])).long()
    ids = torch.randint(3, vocab, mask.shape, generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, response_width


def uniform_batch(rows: int, vocab: int, seed: int = 0, prompt: int = 74, response: int = 16):
    """Every row a `prompt`-token prompt and a `response`-token response: no padding at all."""
    g = torch.Generator().manual_seed(seed)
    width = prompt + response
    mask = torch.ones(rows, width, dtype=torch.long)
    return ({"input_ids": torch.randint(3, vocab, (rows, width), generator=g), "attention_mask": mask,
             "position_ids": torch.arange(width).expand(rows, width).clone()}, response)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def policy(benchmark_disabled, request):
    """The policy with its weights in fp32, or in bf16 (the compute dtype of pyrl's bf16 mixed precision)."""
    from transformers import AutoModelForCausalLM

    from pyrl.workers.precision import cpu_has_bf16

    if request.param == torch.bfloat16 and not cpu_has_bf16():
        pytest.skip("this CPU has no native bf16")
    spec = TinyModelSpec() if benchmark_disabled else BENCH_SPEC
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path(spec), dtype=request.param,
                                              attn_implementation=varlen_attention.register())
    return ResponseLogProbs(lm)


@pytest.fixture(scope="module")
def benchmark_disabled(request):
    return request.config.getoption("benchmark_disable")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("workload", ["long_tailed", "uniform"])
def test_packed_vs_padded_step(benchmark, policy, benchmark_disabled, packed, workload):
    make = long_tailed_batch if workload == "long_tailed" else uniform_batch
    tensors, response_width = make(8 if benchmark_disabled else 64, policy.lm.config.vocab_size)
    inputs = ModelInputs.responses(tensors, response_width, packed, CPU)

    def step():
        policy.zero_grad(set_to_none=True)
        policy(inputs).sum().backward()

    benchmark.group = f"policy fwd+bwd, {workload} micro-batch, {str(policy.lm.dtype).split('.')[-1]}"
    benchmark.pedantic(step, rounds=1 if benchmark_disabled else 5, warmup_rounds=0 if benchmark_disabled else 1)
    real, padded = int(tensors["attention_mask"].sum()), tensors["attention_mask"].numel()
    benchmark.extra_info.update({"tokens_run": inputs.num_tokens, "real_tokens": real, "padded_tokens": padded,
                                 "real_over_padded": real / padded})
    assert inputs.num_tokens == (real if packed else padded)


def _attention_inputs(lengths, heads=8, kv_heads=2, head_dim=64):
    total = int(lengths.sum())
    q = torch.randn(1, heads, total, head_dim, requires_grad=True)
    k = torch.randn(1, kv_heads, total, head_dim, requires_grad=True)
    v = torch.randn(1, kv_heads, total, head_dim, requires_grad=True)
    return q, k, v


class _Module:  # what transformers passes as `module`
    num_key_value_groups = 4


@pytest.mark.parametrize("method", ["buckets", "per_sequence", "block_diagonal", "padded"])
def test_varlen_attention(benchmark, benchmark_disabled, method):
    tensors, _ = long_tailed_batch(8 if benchmark_disabled else 64, 300)
    lengths = tensors["attention_mask"].sum(-1)
    q, k, v = _attention_inputs(lengths)
    groups = q.shape[1] // k.shape[1]
    cu = [0] + lengths.cumsum(0).tolist()
    if method == "buckets":
        attention = varlen_attention.VarlenAttention.from_lengths(lengths, CPU)

        def run():
            varlen_attention.varlen_attention_forward(_Module, q, k, v, None,
                                                      **attention.as_kwargs())[0].sum().backward()
    elif method == "per_sequence":
        def run():
            outs = [F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e].repeat_interleave(groups, 1),
                                                   v[:, :, s:e].repeat_interleave(groups, 1), is_causal=True)
                    for s, e in zip(cu[:-1], cu[1:])]
            torch.cat(outs, 2).sum().backward()
    elif method == "block_diagonal":
        segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        mask = (segment[:, None] == segment[None, :]) & torch.ones(len(segment), len(segment), dtype=torch.bool).tril()

        def run():
            F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                           attn_mask=mask).sum().backward()
    else:
        width = int(lengths.max())
        qp = torch.randn(len(lengths), q.shape[1], width, q.shape[-1], requires_grad=True)
        kp = torch.randn(len(lengths), q.shape[1], width, q.shape[-1], requires_grad=True)

        def run():
            F.scaled_dot_product_attention(qp, kp, kp, is_causal=True).sum().backward()

    benchmark.group = "causal attention fwd+bwd, long-tailed sequences"
    benchmark.pedantic(run, rounds=1 if benchmark_disabled else 3, warmup_rounds=0 if benchmark_disabled else 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("length", [48, 128, 256])
@pytest.mark.parametrize("method", ["matmul", "sdpa"])
def test_bucket_attention_cpu(benchmark, benchmark_disabled, method, length, dtype):
    rows = max(1, (64 if benchmark_disabled else 1536) // length)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, 8, length, 64, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(rows, 2, length, 64, generator=g).to(dtype).requires_grad_() for _ in range(2))

    def run():
        if method == "matmul":
            out = varlen_attention.matmul_attention(q, k, v, 0.125)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
        out.float().sum().backward()

    benchmark.group = f"one attention bucket fwd+bwd, {rows} x {length} tokens, {str(dtype).removeprefix('torch.')}"
    benchmark.pedantic(run, rounds=1 if benchmark_disabled else 5, warmup_rounds=0 if benchmark_disabled else 2)
