#!/usr/bin/env bash
# The GPU suite, in one command, for whoever is lent a CUDA GPU (needs neither Ray nor vLLM):
#   1. every test marked gpu, on CUDA: the ops (Triton and torch backends) against their float64 oracles, packed
#      attention against a per-sequence float64 reference, the policy's packed-vs-padded log-probs, entropy and
#      gradients against float64 HF, the gated MLP (its Triton kernels bit for bit against transformers), RMSNorm
#      (torch path and Triton kernels against transformers and float64), the fused AdamW against float64;
#   2. benchmarks/gpu_kernels.py: each Triton kernel at full size against float64, timed against its named peers
#      (torch eager, Liger-Kernel and flash-attn where installed) and against the floor this card measures.
# Results (logs, junit XML, gpu_kernels.json/.md) go to $OUT (default ./gpu-results). Exits non-zero if either fails.
# GPU_SUITE_TEST_TIMEOUT / GPU_SUITE_KERNEL_TIMEOUT (seconds) bound each half, for a lease of fixed length.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_suite: no CUDA GPU here')" || exit 2
python3 -c "import torch; print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__)"
PARALLEL=()  # Triton compiles each kernel variant on first launch: pytest-xdist spreads that over the cores
python3 -c "import xdist" 2>/dev/null && PARALLEL=(-n "${GPU_SUITE_WORKERS:-8}")
timeout "${GPU_SUITE_TEST_TIMEOUT:-0}" python3 -m pytest -q -m gpu -p no:cacheprovider "${PARALLEL[@]}" --junitxml="$OUT/gpu_tests.xml" \
  tests/ops tests/models/test_varlen_attention.py tests/models/test_gated_mlp.py tests/models/test_rms_norm.py \
  tests/workers/test_policy.py tests/workers/test_optim.py 2>&1 | tee "$OUT/gpu_tests.log"
tests=${PIPESTATUS[0]}
timeout "${GPU_SUITE_KERNEL_TIMEOUT:-0}" python3 benchmarks/gpu_kernels.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_kernels.log"
kernels=${PIPESTATUS[0]}
echo "gpu_suite: tests exit $tests, kernels exit $kernels"
[ "$tests" = 0 ] && [ "$kernels" = 0 ]
