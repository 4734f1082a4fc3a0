"""The mode codes the C++ core and the Triton kernels share, written down once: the C++ enums of
csrc/include/pyrl (FloatKind, KLKind, GroupEstimator, PolicyLossMode), which pyrl._C exports as pybind11 enums
under the names pyrl.ops uses. Python's tables are built from their members, the cpp backend passes the members
themselves, and the Triton kernels compare their `tl.constexpr` mode with named constants made from the same
members (`int(member)`), so no integer is kept in sync by hand."""

from __future__ import annotations

import torch

from pyrl import _C

FloatKind, KLKind, GroupEstimator, PolicyLossMode = _C.FloatKind, _C.KLKind, _C.GroupEstimator, _C.PolicyLossMode

# torch dtype -> the logits kernels' format
FLOAT_KIND = {getattr(torch, name): kind for name, kind in FloatKind.__members__.items()}
# kl_penalty's names (verl's aliases included) -> the estimator
KL_KINDS = {**KLKind.__members__, "kl": KLKind.k1, "mse": KLKind.k2, "low_var_kl": KLKind.k3}
GROUP_ESTIMATORS = dict(GroupEstimator.__members__)
POLICY_LOSS_MODES = dict(PolicyLossMode.__members__)
