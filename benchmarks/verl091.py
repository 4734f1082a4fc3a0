"""verl 0.9.1's own implementations of the ops pyrl benchmarks against, transcribed (benchmark-only code; verl
itself is not a dependency). Source: the verl==0.9.1 wheel from PyPI; each function names its file and function.
Only what the benchmarks call is kept; docstrings and comments are shortened, the arithmetic is verl's, step for
step.

Log-probs. verl's `logprobs_from_logits` dispatches: flash-attn's Triton cross entropy when flash-attn is importable
(and VERL_DISABLE_FLASH_ATTN_CE != "1"), else torch_npu's on Ascend, else `logprobs_from_logits_v2`. On a CPU (no
flash-attn, no NPU) it therefore runs `logprobs_from_logits_v2`, a loop over rows whose extra memory is about one
row. The flash-attn path is `benchmarks/peers.py` (CUDA only). `logprobs_from_logits_naive` (log_softmax + gather,
a [N, V] temporary in the logits' dtype) exists in verl but its dispatcher never picks it.

Group advantages. `compute_grpo_outcome_advantage` ("grpo") is a Python loop over samples;
`compute_grpo_vectorized_outcome_advantage` ("grpo_vectorized") uses `groupwise.group_mean_std` (index_add_ segment
sums, float32). Both give a singleton group mean 0 and std 1 and divide by (std + epsilon): the vectorized one calls
group_mean_std with eps=0.0, so its variance floor (clamp(var, min=eps)) is clamp(var, min=0), a no-op; the two
estimators differ only in float rounding and in dtype (the loop computes in the rewards' dtype, the vectorized one
in float32).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------------------
# verl/utils/torch_functional.py
# ---------------------------------------------------------------------------------------------------------------


def gather_from_labels(data, label):
    """verl 0.9.1 verl/utils/torch_functional.py: gather_from_labels."""
    output = torch.gather(data, -1, label.unsqueeze(-1)).squeeze(-1)
    return output


def logprobs_from_logits_naive(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """verl 0.9.1 verl/utils/torch_functional.py: logprobs_from_logits_naive (log_softmax + gather)."""
    logp = F.log_softmax(logits, dim=-1)
    logpy = gather_from_labels(logp, labels)
    return logpy


def logprobs_from_logits_v2(logits: torch.FloatTensor, labels: torch.Tensor) -> torch.Tensor:
    """verl 0.9.1 verl/utils/torch_functional.py: logprobs_from_logits_v2 (row loop)."""
    if logits.dtype in [torch.float32, torch.float64]:
        logits_labels = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        # loop to reduce peak mem consumption
        logsumexp_values = torch.stack([torch.logsumexp(logit, dim=-1) for logit in logits])
        logprobs_labels = logits_labels - logsumexp_values  # log_softmax(x_i) = x_i - logsumexp(x)
    else:
        # logsumexp approach is unstable with bfloat16, fall back to slightly less efficent approach
        logprobs_labels = []
        for row_logits, row_labels in zip(logits, labels, strict=True):  # loop to reduce peak mem consumption
            row_logprobs = F.log_softmax(row_logits, dim=-1)
            row_logprobs_labels = row_logprobs.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1)
            logprobs_labels.append(row_logprobs_labels)
        logprobs_labels = torch.stack(logprobs_labels)
    return logprobs_labels


def logprobs_from_logits(logits, labels, inplace_backward=True):
    """verl 0.9.1 verl/utils/torch_functional.py: logprobs_from_logits, as it runs without flash-attn and without
    torch_npu (a CPU): the `else` branch, logprobs_from_logits_v2."""
    return logprobs_from_logits_v2(logits, labels)


# ---------------------------------------------------------------------------------------------------------------
# verl/utils/groupwise.py
# ---------------------------------------------------------------------------------------------------------------


def as_torch_index(index, device=None) -> torch.Tensor:
    """verl 0.9.1 verl/utils/groupwise.py: as_torch_index (labels -> long ids 0..G-1); `device` given explicitly
    (its _resolve_device returns an explicit device as is)."""
    target = torch.device(device) if device is not None else torch.device("cpu")
    if isinstance(index, torch.Tensor):
        t = index.reshape(-1)
        if t.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool):
            return t.to(device=target, dtype=torch.long)
        if t.dtype in (torch.float16, torch.float32, torch.float64, torch.bfloat16):
            t64 = t.to(dtype=torch.float64)
            rounded = torch.round(t64)
            if torch.allclose(t64, rounded, rtol=0.0, atol=1e-6):
                return rounded.to(device=target, dtype=torch.long)
            arr = np.array([str(x.item()) for x in t], dtype=object)
        else:
            arr = np.array([str(x.item()) if hasattr(x, "item") else str(x) for x in t], dtype=object)
    else:
        try:  # _to_1d_numpy_object_array
            arr = np.asarray(index)
        except Exception:
            try:
                arr = np.array(list(index), dtype=object)
            except Exception:
                arr = np.array([index], dtype=object)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if arr.dtype != object and np.issubdtype(arr.dtype, np.integer):
            return torch.from_numpy(arr.astype(np.int64, copy=False)).to(device=target)
        if arr.dtype != object and np.issubdtype(arr.dtype, np.floating):
            arr64 = arr.astype(np.float64, copy=False)
            rounded = np.rint(arr64)
            if np.allclose(arr64, rounded, rtol=0.0, atol=1e-6):
                return torch.from_numpy(rounded.astype(np.int64)).to(device=target)
        try:
            coerced = arr.astype(np.int64)
            return torch.from_numpy(coerced).to(device=target)
        except Exception:
            pass
        if arr.dtype != object:
            arr = arr.astype(object)
    try:
        _, inv = np.unique(arr, return_inverse=True)
    except Exception:
        sarr = np.array([str(x) for x in arr], dtype=object)
        _, inv = np.unique(sarr, return_inverse=True)
    inv = inv.astype(np.int64, copy=False)
    return torch.from_numpy(inv).to(device=target)


@torch.no_grad()
def group_mean_std(scores, gidx, eps=1e-6, device=None):
    """verl 0.9.1 verl/utils/groupwise.py: group_mean_std. mean_g = sum / count, std_g = sqrt(max(var_g, eps)) with
    Bessel's correction (denominator max(count - 1, 1)), float32; singleton groups mean 0, std 1."""
    target = torch.device(device) if device is not None else scores.device
    scores = scores.reshape(-1).to(device=target, dtype=torch.float32)
    gidx = gidx.reshape(-1).to(device=target, dtype=torch.long)
    if scores.numel() != gidx.numel():
        raise ValueError(f"scores and gidx length mismatch: {scores.numel()} vs {gidx.numel()}")
    G = int(torch.max(gidx).item()) + 1 if gidx.numel() > 0 else 0
    if G == 0:
        empty = torch.empty(0, device=target, dtype=torch.float32)
        return empty, empty, empty
    ones = torch.ones_like(scores, dtype=torch.float32)
    count = torch.zeros(G, device=target, dtype=torch.float32).index_add_(0, gidx, ones)
    s1 = torch.zeros(G, device=target, dtype=torch.float32).index_add_(0, gidx, scores)
    mean = s1 / count.clamp_min(1.0)
    centered = scores - mean[gidx]
    var_num = torch.zeros(G, device=target, dtype=torch.float32).index_add_(0, gidx, centered * centered)
    denom = (count - 1.0).clamp_min(1.0)
    var = var_num / denom
    std = torch.sqrt(torch.clamp(var, min=eps))
    single = count <= 1.0
    if torch.any(single):
        mean = mean.clone()
        std = std.clone()
        mean[single] = 0.0
        std[single] = 1.0
    return mean, std, count


# ---------------------------------------------------------------------------------------------------------------
# verl/trainer/ppo/core_algos.py
# ---------------------------------------------------------------------------------------------------------------


def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, config=None):
    """verl 0.9.1 verl/trainer/ppo/core_algos.py: compute_grpo_outcome_advantage ("grpo", a Python loop)."""
    scores = token_level_rewards.sum(dim=-1)

    id2score = defaultdict(list)
    id2mean = {}
    id2std = {}

    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            elif len(id2score[idx]) > 1:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
            else:
                raise ValueError(f"no score in prompt index: {idx}")
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1) * response_mask

    return scores, scores


def compute_grpo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                              norm_adv_by_std_in_grpo=True, config=None):
    """verl 0.9.1 verl/trainer/ppo/core_algos.py: compute_grpo_vectorized_outcome_advantage ("grpo_vectorized")."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        g = as_torch_index(index, device=scores.device)
        mean_g, std_g, _ = group_mean_std(scores, g, eps=0.0, device=scores.device)
        if norm_adv_by_std_in_grpo:
            scalars = (scores - mean_g[g]) / (std_g[g] + epsilon)
        else:
            scalars = scores - mean_g[g]
        advantages = scalars.unsqueeze(-1) * response_mask
        return advantages, advantages
