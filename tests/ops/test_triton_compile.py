"""Every Triton kernel pyrl launches, compiled ahead of time for real GPUs (sm_80 and sm_90) on any machine,
this CPU one included: Triton compiles to PTX itself and ships ptxas. The interpreter tests of the ops
check the kernels' numbers; only this test checks that they compile for a GPU at all, and that no
variant spills registers.

The variants come from pyrl.ops.compile_report, which drives the public ops over their own tables (dtypes,
KL kinds, loss modes, estimators, ...) and realistic shapes, and records each kernel launch instead of
running it. No skip: without triton this module fails to import, and the test fails. Under the
interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets on CPU machines) the compiles run in a child
process (compile_report.compile_all), once per session.
"""

import re

import torch
import triton  # noqa: F401  - required: a missing Triton is a failure here, not a skip

from pyrl import ops
from pyrl.ops import compile_report
from pyrl.ops.codes import FLOAT_KIND

POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def _constexpr(variant, name):
    names = [param for param, _ in variant.signature]
    return next(value for path, value in variant.constexprs if names[path[0]] == name)


def _constexpr_values(kernel, name):
    return {_constexpr(v, name) for v in compile_report.variants() if v.kernel == kernel}


def test_every_kernel_is_launched_by_the_scenarios():
    found = compile_report.kernels()
    assert len(found) >= 8, sorted(found)
    unlaunched = compile_report.unlaunched_kernels()
    assert unlaunched == [], f"kernels in pyrl.kernels that no scenario in compile_report launches: {unlaunched}"


def test_variants_cover_the_ops_tables():
    # the tables hold pyrl._C's enum members; the kernels take their codes, int(member)
    assert _constexpr_values("kl_penalty._kl_fwd_kernel", "KIND") == set(map(int, ops.KL_KINDS.values()))
    assert _constexpr_values("kl_penalty._kl_bwd_kernel", "STRAIGHT_THROUGH") == {False, True}
    modes = {int(code) for code in ops.POLICY_LOSS_MODES.values() if code is not None}
    assert _constexpr_values("policy_loss._policy_loss_kernel", "MODE") == modes
    estimators = set(map(int, ops.GROUP_ESTIMATORS.values()))
    assert _constexpr_values("group_advantages._group_kernel", "ESTIMATOR") == estimators
    assert _constexpr_values("gae._gae_kernel", "PACKED") == {False, True}
    logprobs = [v for v in compile_report.variants() if v.kernel.startswith("logprobs.")]
    logit_types = {dict(v.signature)["logits_ptr"] for v in logprobs}
    assert logit_types == {POINTER_TYPES[t] for t in FLOAT_KIND}
    blocks = _constexpr_values("logprobs._logprobs_fwd_kernel", "BLOCK")
    assert 4096 in blocks and len(blocks) >= 2  # real vocabularies and the tiny test model's


def test_compiles_for_sm80_and_sm90_without_spills():
    rows = compile_report.compile_all()
    variants = compile_report.variants()
    assert len(rows) == len(variants) * 2 and {r.target for r in rows} == {"sm_80", "sm_90"}
    failures = [
        f"{r.kernel} [{r.variant}] {r.target}: "
        + (r.error or f"spills {r.spill_stores} B stored / {r.spill_loads} B loaded ({r.registers} registers)")
        for r in rows if r.error or r.spills
    ]
    assert not failures, f"{len(failures)} of {len(rows)} compiles failed or spilled:\n" + "\n".join(failures)
    assert all(r.registers > 0 for r in rows)


def test_spills_are_seen():
    """The check above can fail: a register cap (maxnreg) that forces spills is reported as spills."""
    variant = next(v for v in compile_report.variants()
                   if v.kernel == "logprobs._logprobs_fwd_kernel" and _constexpr(v, "BLOCK") == 4096)
    rows = compile_report.compile_all(match=re.escape(f"{variant.kernel} [{variant.label}]"), maxnreg=24)
    assert len(rows) == len(compile_report.TARGETS)
    for row in rows:
        assert row.error is None and row.spills and row.registers <= 24, row
