"""pyrl/workers/optim.py's AdamW: torch's fused implementation where the parameters allow it. Its update is checked
against AdamW written out in float64 and against torch's per-tensor loop (verl 0.9.1's optimizer on CPU), and its
step against the loop's temporaries, measured as the process's peak resident memory in a fresh interpreter."""

import math
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from pyrl.workers.optim import build_optimizer, fused_adamw_supported, optimizer_step

LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01
CONFIG = SimpleNamespace(optimizer="AdamW", lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)


def adamw_float64(params, grads_per_step):
    """AdamW (decoupled weight decay, bias-corrected moments) by hand, in float64."""
    params = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        for p, g, m_i, v_i in zip(params, grads, m, v):
            g = g.double()
            p.mul_(1 - LR * WEIGHT_DECAY)
            m_i.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
            v_i.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            m_hat = m_i / (1 - BETAS[0] ** t)
            v_hat = v_i / (1 - BETAS[1] ** t)
            p.sub_(LR * m_hat / (v_hat.sqrt() + EPS))
    return params


def run_steps(optimizer_of, shapes, dtype, steps=12, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes] for _ in range(steps)]
    params = [torch.nn.Parameter(x.to(dtype).to(device)) for x in start]
    optimizer = optimizer_of(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(device, copy=True)
        optimizer.step()
    return optimizer, [p.detach().cpu() for p in params], adamw_float64([x.to(dtype) for x in start], grads)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes", [[(37, 5), (1,), (3, 1, 2)], [(1,)]], ids=["odd_sizes", "one_element"])
def test_fused_adamw_is_adamw(shapes, device):
    optimizer, fused, reference = run_steps(lambda ps: build_optimizer(ps, CONFIG), shapes, torch.float32,
                                            device=device)
    assert optimizer.param_groups[0]["fused"] is True
    _, loop, _ = run_steps(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                                                        foreach=False), shapes, torch.float32, device=device)
    for got, want, torch_loop in zip(fused, reference, loop):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got, torch_loop, rtol=1e-6, atol=1e-6)  # rounding only


def test_fused_adamw_in_bf16():
    optimizer, fused, reference = run_steps(lambda ps: build_optimizer(ps, CONFIG), [(64, 3)], torch.bfloat16)
    assert optimizer.param_groups[0]["fused"] is True
    torch.testing.assert_close(fused[0].double(), reference[0], rtol=2e-2, atol=2e-2)


def test_parameters_fused_adamw_does_not_take_get_torchs_choice():
    assert not fused_adamw_supported([torch.zeros(2, dtype=torch.int64)])
    assert not fused_adamw_supported([])
    assert fused_adamw_supported([torch.zeros(2), torch.zeros(3, dtype=torch.bfloat16)])


def test_a_gradient_norm_that_is_not_finite_skips_the_fused_step():
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model.parameters(), CONFIG)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.tensor([[float("nan"), 1.0, 2.0]])).sum().backward()
    assert math.isnan(optimizer_step(model, optimizer, grad_clip=1.0))
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


PEAK_OF_A_STEP = textwrap.dedent("""
    import sys, torch
    from types import SimpleNamespace
    from pyrl.workers.optim import build_optimizer
    def kib(key):
        return int(open('/proc/self/status').read().split(key + ':')[1].split()[0])
    param = torch.nn.Parameter(torch.randn(16, 2 ** 20))  # 64 MiB
    param.grad = torch.randn_like(param)
    config = SimpleNamespace(optimizer='AdamW', lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
    optimizer = (build_optimizer([param], config) if sys.argv[1] == 'pyrl'
                 else torch.optim.AdamW([param], lr=1e-3, foreach=False))
    optimizer.step()  # allocates the moments
    open('/proc/self/clear_refs', 'w').write('5')  # the peak starts again from here
    resident = kib('VmRSS')
    optimizer.step()
    print((kib('VmHWM') - resident) / 1024)
""")


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/PID/clear_refs")
def test_the_fused_step_makes_no_parameter_sized_temporaries():
    """torch's per-tensor AdamW (verl 0.9.1's on CPU) holds two temporaries the size of the parameter at once; the
    fused step none. Measured: the peak resident memory of a second step above what the process held before it."""
    def extra_mib(which):
        out = subprocess.run([sys.executable, "-c", PEAK_OF_A_STEP, which], capture_output=True, text=True,
                             check=True)
        return float(out.stdout.split()[-1])
    assert extra_mib("loop") > 100  # two 64 MiB temporaries: the measurement sees them
    assert extra_mib("pyrl") < 8


def test_a_checkpoint_of_the_loop_adamw_resumes_into_the_fused_one(tmp_path):
    """Checkpoints written before pyrl took the fused AdamW hold `fused: None` in their param groups, which loading
    would adopt: load_checkpoint sets the fused step back, and the resumed steps are the saved optimizer's own."""
    from pyrl.workers.checkpoint import load_checkpoint, save_checkpoint

    def model_and_optimizer(fused):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3)
        optimizer = (build_optimizer(model.parameters(), CONFIG) if fused else
                     torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY))
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def step(model, optimizer, seed):
        gen = torch.Generator().manual_seed(seed)
        model(torch.randn(4, 5, generator=gen)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    old, old_optimizer, old_schedule = model_and_optimizer(fused=False)
    for seed in range(3):
        step(old, old_optimizer, seed)
    save_checkpoint(str(tmp_path / "ckpt"), old, old_optimizer, old_schedule, rank=0)
    new, new_optimizer, new_schedule = model_and_optimizer(fused=True)
    load_checkpoint(str(tmp_path / "ckpt"), new, new_optimizer, new_schedule, rank=0)
    assert new_optimizer.param_groups[0]["fused"] is True
    for seed in range(3, 6):
        step(old, old_optimizer, seed)
        step(new, new_optimizer, seed)
    for got, want in zip(new.parameters(), old.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def verl091_lr_factor(step: int, kind: str, total: int, warmup_steps: int, warmup_ratio: float, min_ratio: float,
                      cycles: float) -> float:
    """verl 0.9.1's schedules, transcribed: the FSDP engine's warmup choice (engine/fsdp/transformer_impl.py:
    lr_warmup_steps <= 0 takes the ratio), get_constant_schedule_with_warmup and get_cosine_schedule_with_warmup
    (utils/torch_functional.py, init_lr_ratio 0, zero-indexed steps)."""
    warmup = warmup_steps if warmup_steps > 0 else int(warmup_ratio * total)
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    x = math.cos(math.pi * cycles * 2.0 * progress)
    return max(min_ratio, x * (1 - min_ratio) * 0.5 + (1 + min_ratio) * 0.5)


@pytest.mark.parametrize("kind, warmup_steps, warmup_ratio, min_ratio, cycles", [
    ("constant", -1, 0.0, 0.0, 0.5), ("constant", 3, 0.0, 0.0, 0.5), ("constant", 0, 0.25, 0.0, 0.5),
    ("cosine", -1, 0.1, 0.1, 0.5), ("cosine", 0, 0.3, 0.0, 0.5), ("cosine", 4, 0.9, 0.2, 1.0),
    ("cosine", 1, 0.0, 1.0, 0.5)])
def test_the_lr_schedule_is_verls(kind, warmup_steps, warmup_ratio, min_ratio, cycles):
    """Each step's LR factor over a 20-step run, warmup by steps or (at lr_warmup_steps <= 0, as verl: 0 too) by
    the ratio."""
    from pyrl.workers.optim import build_lr_scheduler

    total = 20
    config = SimpleNamespace(total_training_steps=total, lr_warmup_steps=warmup_steps,
                             lr_warmup_steps_ratio=warmup_ratio, lr_scheduler_type=kind, min_lr_ratio=min_ratio,
                             num_cycles=cycles)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler(optimizer, config)
    got = []
    for _ in range(total + 1):
        got.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    expected = [verl091_lr_factor(step, kind, total, warmup_steps, warmup_ratio, min_ratio, cycles)
                for step in range(total + 1)]
    assert got == pytest.approx(expected, abs=1e-12)
