"""pyrl.models.varlen_attention: packed causal attention, each sequence attending to its own tokens only, against
a float64 per-sequence reference (values and gradients), on both CPU paths (plain matmuls for short bf16 buckets,
SDPA for long ones and fp32) and on CUDA (marked gpu), GQA and plain heads, equal and mixed lengths (1 and 0 included),
fp32 and bf16."""

import pytest
import torch

from pyrl.models import varlen_attention
from pyrl.models.varlen_attention import CPU_MATMUL_ATTENTION_MAX_LEN, VarlenAttention

CPU = torch.device("cpu")
# the CUDA rows run SDPA's CUDA kernels on the buckets in fp32, one flash-attention varlen call in bf16 (flash-attn's
# where installed, else torch's varlen_attn)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="needs CUDA")])]
LONG = CPU_MATMUL_ATTENTION_MAX_LEN + 9  # a bucket past the matmul path's limit


class _Module:  # what transformers passes as `module`
    pass


def reference(q, k, v, lengths, scaling):
    """float64, one sequence at a time, the causal mask written out: q [T, H, D], k/v [T, H_kv, D] -> [T, H, D]."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    outs, start = [], 0
    for n in lengths.tolist():
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        scores = qs @ ks.transpose(-1, -2) * scaling
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        outs.append((torch.softmax(scores, -1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


def packed_inputs(lengths, heads, kv_heads, dtype, dim=16, seed=0, device=CPU):
    g = torch.Generator().manual_seed(seed)
    total = int(sum(lengths))
    q, k, v = (torch.randn(total, h, dim, generator=g).to(device=device, dtype=dtype).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    return q, k, v


LENGTHS = {"mixed": [5, 1, 40, 0, 31, 39, 12, 3], "equal": [7, 7, 7], "one": [1], "long+short": [LONG, 4, LONG - 30, 2]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("device", DEVICES)
def test_packed_attention_matches_per_sequence_float64(lengths, heads, kv_heads, dtype, device):
    lengths = torch.tensor(LENGTHS[lengths])
    q, k, v = packed_inputs(lengths, heads, kv_heads, dtype, device=torch.device(device))
    scaling = 0.3
    attention = VarlenAttention.from_lengths(lengths, torch.device(device))
    out, _ = varlen_attention.varlen_attention_forward(
        _Module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, scaling=scaling,
        **attention.as_kwargs())
    out = out[0]
    assert out.shape == q.shape and out.dtype == dtype
    ref = reference(q, k, v, lengths, scaling)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    if dtype == torch.float32 and device == "cuda":  # SDPA's CUDA kernels sum in another order
        tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.double(), ref, **tol)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out.device)
    grads = torch.autograd.grad((out.double() * weight).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, ref_grads):
        want = want.double()
        if dtype == torch.bfloat16:  # a sum of many bf16-rounded terms: the error scales with the gradient's size
            # (a floor of 1e-5: a lone token's dq is exactly 0, and CUDA's SDPA gives it ~1e-7)
            tol = dict(atol=max(2e-2 * float(want.abs().max()), 1e-5), rtol=2e-2)
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_shared_prefixes_match_each_sample_run_alone_in_float64(device, dtype):
    """Prompts held once for their samples (from_shared_prefixes, actor.use_prefix_grouper): every sample's outputs,
    and the prompt's (given by its first sample), equal each sample run alone as prompt + own tokens in float64;
    the prompt's key and value gradients are the sum over its samples. Prompts of 6 (3 samples of 4, 1 and 9 tokens)
    and 1 (2 samples of 2 and 5), so the sequences fall into more than one bucket."""
    device = torch.device(device)
    prompts, samples = [6, 1], [[4, 1, 9], [2, 5]]
    tokens, lengths, owned_from, at, alone = [], [], [], 0, []  # alone: each sample's row tokens, in order
    for prompt, own in zip(prompts, samples):
        prompt_tokens = torch.arange(at, at + prompt)
        at += prompt
        for i, n in enumerate(own):
            mine = torch.arange(at, at + n)
            at += n
            tokens.append(torch.cat([prompt_tokens, mine]))
            lengths.append(prompt + n)
            owned_from.append(0 if i == 0 else prompt)
            alone.append(tokens[-1])
    attention = VarlenAttention.from_shared_prefixes(torch.cat(tokens), torch.tensor(lengths),
                                                     torch.tensor(owned_from), device)
    assert len(attention.buckets) > 1
    q, k, v = packed_inputs([at], 8, 2, dtype, device=device)
    out, _ = varlen_attention.varlen_attention_forward(
        _Module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, scaling=0.3,
        **attention.as_kwargs())
    out = out[0]
    # the reference: each sample's sequence gathered from the row and run alone; the row's token t is given by the
    # first sequence holding it
    index = torch.cat(alone).to(device)
    ref_all = reference(q[index], k[index], v[index], torch.tensor(lengths), 0.3)
    first = {}
    for position, token in enumerate(index.tolist()):
        first.setdefault(token, position)
    ref = ref_all[torch.tensor([first[t] for t in range(at)], device=device)]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
    grads = torch.autograd.grad((out.double() * weight).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, ref_grads):
        want = want.double()
        if dtype == torch.bfloat16:
            tol = dict(atol=max(2e-2 * float(want.abs().max()), 1e-5), rtol=2e-2)
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("length", [1, 37, CPU_MATMUL_ATTENTION_MAX_LEN])
@pytest.mark.parametrize("heads", [8, 2])
def test_matmul_attention_equals_sdpa(length, heads):
    """The two CPU paths compute the same function (float64 inputs; the matmul path computes in float32)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, heads, length, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, length, 16, generator=g, dtype=torch.float64) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(heads // 2, 1),
                                                            v.repeat_interleave(heads // 2, 1),
                                                            is_causal=True, scale=0.25)
    torch.testing.assert_close(varlen_attention.matmul_attention(q, k, v, 0.25), sdpa, atol=1e-5, rtol=1e-5)


def test_buckets_cover_every_token_once():
    lengths = torch.tensor([5, 0, 40, 31, 1, 39, 30, 12])
    attention = VarlenAttention.from_lengths(lengths, CPU)
    seen = torch.cat([bucket.gather.reshape(-1)[bucket.given] for bucket in attention.buckets])
    assert sorted(seen.tolist()) == list(range(int(lengths.sum())))
    assert torch.equal(seen[attention.inverse], torch.arange(int(lengths.sum())))
    for bucket in attention.buckets:
        real = torch.bincount(bucket.given // bucket.gather.shape[1], minlength=bucket.gather.shape[0])
        assert real.min() >= varlen_attention.BUCKET_RATIO * real.max()
    assert VarlenAttention.from_lengths(torch.tensor([6, 6]), CPU).inverse is None  # equal lengths: no gather


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_no_tokens(device, dtype):
    """A rank's empty micro-batch (FSDP runs one where another rank has more): an empty output, on every path."""
    attention = VarlenAttention.from_lengths(torch.tensor([0, 0]), torch.device(device))
    q = torch.zeros(1, 2, 0, 8, device=device, dtype=dtype)
    out, _ = varlen_attention.varlen_attention_forward(_Module, q, q, q, None, **attention.as_kwargs())
    assert out.shape == (1, 0, 2, 8) and out.dtype == dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_cuda_bf16_runs_one_varlen_call_equal_to_the_buckets(heads, kv_heads, monkeypatch):
    """bf16 on CUDA takes a flash-attention varlen kernel (torch's where flash-attn is absent), not the per-bucket
    SDPA calls, and gives what the bucket path gives (values and gradients, within bf16's rounding)."""
    cuda = torch.device("cuda")
    lengths = torch.tensor([LONG, 5, 1, 0, 40, 39, 3])
    calls = []
    real = varlen_attention.torch_varlen_attention
    monkeypatch.setattr(varlen_attention, "torch_varlen_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    attention = VarlenAttention.from_lengths(lengths, cuda)
    outs = {}
    for use in (True, False):
        monkeypatch.setattr(varlen_attention, "USE_TORCH_VARLEN", use)
        q, k, v = packed_inputs(lengths, heads, kv_heads, torch.bfloat16, dim=64, seed=3, device=cuda)
        out, _ = varlen_attention.varlen_attention_forward(
            _Module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, scaling=0.2,
            **attention.as_kwargs())
        weight = torch.randn(out[0].shape, generator=torch.Generator().manual_seed(4)).to(cuda)
        outs[use] = (out[0].float(), *torch.autograd.grad((out[0].float() * weight).sum(), (q, k, v)))
    assert varlen_attention._flash_varlen() is not None or calls == [(int(lengths.sum()), heads, 64)]
    for name, got, want in zip(["out", "dq", "dk", "dv"], outs[True], outs[False]):
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2 * float(want.abs().max()), rtol=3e-2,
                                   msg=lambda m: f"{name}: {m}")
