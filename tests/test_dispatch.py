import pytest
import torch

from pyrl.ops import kl_penalty, logprobs_from_logits


def test_unknown_backend(monkeypatch):
    monkeypatch.setenv("PYRL_OPS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="PYRL_OPS_BACKEND='cuda': expected one of triton, cpp, torch"):
        kl_penalty(torch.randn(3), torch.randn(3), "k1")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("PYRL_OPS_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        kl_penalty(torch.randn(3), torch.randn(3), "k1")


def test_default_backend_on_cpu_is_cpp(monkeypatch):
    monkeypatch.delenv("PYRL_OPS_BACKEND", raising=False)
    from pyrl.ops._dispatch import choose_backend

    assert choose_backend(torch.zeros(1)) == "cpp"


def test_backends_agree(monkeypatch):
    logits, labels = torch.randn(5, 300), torch.randint(0, 300, (5,))
    results = {}
    for name in ("cpp", "torch", "triton"):
        monkeypatch.setenv("PYRL_OPS_BACKEND", name)
        results[name] = logprobs_from_logits(logits, labels)
    torch.testing.assert_close(results["cpp"], results["torch"])
    torch.testing.assert_close(results["triton"], results["torch"])


def test_cpp_core_checks_its_buffers():
    """pyrl._C rejects wrong buffers itself, naming the argument, before touching memory."""
    from pyrl import _C

    a = torch.zeros(4).numpy()
    k1, f32 = _C.KLKind.k1, _C.FloatKind.float32
    with pytest.raises(ValueError, match="ref_logp: expected 4 elements, got 3"):
        _C.kl_forward(a, torch.zeros(3).numpy(), k1, torch.zeros(4).numpy())
    with pytest.raises(TypeError, match="ref_logp: expected a float32 buffer"):
        _C.kl_forward(a, torch.zeros(4, dtype=torch.float64).numpy(), k1, torch.zeros(4).numpy())
    with pytest.raises(ValueError, match="kind: unknown KL estimator code 7"):  # an enum made from any int
        _C.kl_forward(a, a, _C.KLKind(7), torch.zeros(4).numpy())
    with pytest.raises(TypeError, match="incompatible function arguments"):  # codes travel as the enum, not ints
        _C.kl_forward(a, a, 3, torch.zeros(4).numpy())
    logits = torch.zeros(2, 5).numpy()
    with pytest.raises(ValueError, match=r"labels: entry 1 is 9, outside \[0, 5\)"):
        _C.logprobs_forward(logits, f32, torch.tensor([0, 9]).numpy(), 1.0,
                            torch.zeros(2).numpy(), torch.zeros(2).numpy(), None)
    with pytest.raises(ValueError, match="logits: expected 2 dims"):
        _C.logprobs_forward(torch.zeros(10).numpy(), f32, None, 1.0, None, torch.zeros(10).numpy(), None)
    with pytest.raises(ValueError, match="cu_seqlens: last entry 3 != number of tokens 4"):
        _C.gae(a, a, None, torch.tensor([0, 3]).numpy(), 1, 0, 1.0, 1.0, True,
               torch.zeros(4).numpy(), torch.zeros(4).numpy())
    with pytest.raises(ValueError, match="advantages: must be contiguous"):
        _C.gae(a, a, None, None, 2, 2, 1.0, 1.0, False, torch.zeros(2, 2).t().numpy(), torch.zeros(4).numpy())
