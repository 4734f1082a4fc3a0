"""perf.model_flops against a transcription of verl 0.9.1's FlopsCounter for Qwen2 (verl/utils/flops_counter.py,
_estimate_qwen2_flops), and the MFU ratio."""

from types import SimpleNamespace

import pytest
import torch

from pyrl.workers import perf


def verl091_qwen2_flops(config, tokens_sum, batch_seqlens):
    """verl 0.9.1's _estimate_qwen2_flops x delta_time x 1e12: the FLOPs themselves."""
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    q_size = config.num_attention_heads * head_dim
    k_size = v_size = config.num_key_value_heads * head_dim
    mlp_n = config.hidden_size * config.intermediate_size * 3
    attn_linear_n = config.hidden_size * (q_size + k_size + v_size + config.num_attention_heads * head_dim)
    dense_n = (mlp_n + attn_linear_n) * config.num_hidden_layers + config.vocab_size * config.hidden_size * 2
    seqlen_square_sum = sum(s * s for s in batch_seqlens)
    return (6 * dense_n * tokens_sum
            + 6 * seqlen_square_sum * head_dim * config.num_attention_heads * config.num_hidden_layers)


CONFIG = SimpleNamespace(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                         num_hidden_layers=3, intermediate_size=200, vocab_size=517)


@pytest.mark.parametrize("seqlens", [[1], [7, 30, 2], [128] * 4])
def test_model_flops_is_verls(seqlens):
    assert perf.model_flops(CONFIG, seqlens) == verl091_qwen2_flops(CONFIG, sum(seqlens), seqlens)
    assert perf.model_flops(CONFIG, seqlens, backward=False) == pytest.approx(
        verl091_qwen2_flops(CONFIG, sum(seqlens), seqlens) / 3)


def test_shared_prompt_tokens_count_once_in_the_dense_layers():
    """A prompt of 10 shared by 3 samples of 4 tokens: the dense layers ran 10 + 3 x 4 tokens, each sample's
    attention spans 14."""
    seqlens, tokens = [14, 14, 14], 10 + 3 * 4
    full = verl091_qwen2_flops(CONFIG, sum(seqlens), seqlens)
    dense_per_token = verl091_qwen2_flops(CONFIG, 1, [0])
    assert perf.model_flops(CONFIG, seqlens, tokens=tokens) == full - (sum(seqlens) - tokens) * dense_per_token


def test_mfu_is_flops_over_time_over_peak(monkeypatch):
    monkeypatch.setattr(perf, "peak_flops", lambda device, dtype: 2e9)
    got = perf.mfu(CONFIG, [7, 30], 0.5, torch.device("cpu"), torch.float32)
    assert got == pytest.approx(perf.model_flops(CONFIG, [7, 30]) / 0.5 / 2e9)
    assert perf.model_flops(CONFIG, [], tokens=0) == 0


def test_cpu_peak_is_the_best_matmul_size_measured_once_per_machine(monkeypatch, tmp_path):
    """The CPU peak is the better of the 1024^3 and 2048^3 matmul rates (AMX bf16 reaches its rate only on the
    larger), measured on the first call and read from PYRL_CACHE_DIR after; an entry of the former 1024-only
    benchmark (no peak-v2 in its key) is not reused."""
    monkeypatch.setenv("PYRL_CACHE_DIR", str(tmp_path))
    cores = perf.os.cpu_count() or 1
    stale = f"cpu:{perf._cpu_model()}:{cores}:bfloat16"
    (tmp_path / "peak_flops.json").write_text(perf.json.dumps({stale: 1.0}))
    calls = []

    def rate(device, dtype, threads=None, size=1024, seconds=0.5):
        calls.append((dtype, threads, size))
        return {1024: 3e9, 2048: 5e9}[size]

    monkeypatch.setattr(perf, "matmul_rate", rate)
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert perf.peak_flops(torch.device("cpu"), torch.bfloat16) == 5e9
    assert calls == [(torch.bfloat16, cores, 1024), (torch.bfloat16, cores, 2048)]
    assert perf.peak_flops(torch.device("cpu"), torch.bfloat16) == 5e9 and len(calls) == 2  # cached
    assert perf.json.loads((tmp_path / "peak_flops.json").read_text())[stale] == 1.0  # left as it was
