"""Update cost per token across micro-batch sizes on CPU (issue 25 item 1): the actor's update forward (packed,
ResponseLogProbs) + backward over the same 256 rows of uniform 16-token prompts and 32-token responses, cut into
micro-batches of 16, 32, 64, 128 or 256 rows (256: what a verl command line without ppo_micro_batch_size_per_gpu
runs), with bench_e2e's ~24M-parameter Qwen2 (pyrl.models.BENCH_SPEC), float32, for both log-prob paths:

  fused     model.use_fused_kernels (pyrl's default): log-probs from the hidden states, no [tokens, vocab] logits
  unfused   verl's default: the logits materialized, then log-softmax and gather

    python benchmarks/micro_batch_sizes.py [--rounds 3] [--repeats 2] [--rows 16 32 64 128 256] [--quick]

Each path runs in a fresh process per round (rounds rotate the order); a process times every size `repeats` times
after a warm-up and keeps the fastest. Reported: seconds for the 256 rows, median (min-max) over rounds, and each
size's time per token against the path's best size (target: within 1.10x from 16 to 256 rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spread import ratio, rotated, show, spread  # noqa: E402

PROMPT, RESPONSE, ROWS = 16, 32, 256
PATHS = ["fused", "unfused"]


def child(sizes: list[int], repeats: int, quick: bool, fused: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pyrl.models import tiny_model_path, varlen_attention
    from pyrl.models.tiny import BENCH_SPEC, TinyModelSpec
    from pyrl.workers.batching import ModelInputs
    from pyrl.workers.policy import ResponseLogProbs

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path(TinyModelSpec() if quick else BENCH_SPEC),
                                              dtype=torch.float32, attn_implementation=varlen_attention.register())
    policy = ResponseLogProbs(lm, use_fused_kernels=fused)
    ids = torch.randint(3, lm.config.vocab_size, (ROWS, PROMPT + RESPONSE))
    mask = torch.ones_like(ids)
    tensors = {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1}

    def update(size: int) -> float:
        start = time.perf_counter()
        for first in range(0, ROWS, size):
            micro = {key: value[first:first + size] for key, value in tensors.items()}
            policy(ModelInputs.responses(micro, RESPONSE, True, torch.device("cpu"))).sum().backward()
        return time.perf_counter() - start

    out = {}
    for size in sizes:
        update(size)  # warm-up
        out[size] = min(update(size) for _ in range(repeats))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--quick", action="store_true", help="the tiny model, one round, one repeat")
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.repeats = 1, 1
    if args.child:
        print(json.dumps(child(args.rows, args.repeats, args.quick, args.child == "fused")))
        return
    times: dict = {(path, size): [] for path in PATHS for size in args.rows}
    for r in range(args.rounds):
        for path in rotated(PATHS, r):
            command = [sys.executable, __file__, "--child", path, "--repeats", str(args.repeats), "--rows",
                       *map(str, args.rows), *(["--quick"] if args.quick else [])]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{path}: the child failed:\n{done.stderr[-3000:]}")
            for size, seconds in json.loads(done.stdout.strip().splitlines()[-1]).items():
                times[(path, int(size))].append(seconds)
            print(f"round {r + 1}, {path}: " + ", ".join(f"{size} rows {times[(path, size)][-1]:.2f} s"
                                                        for size in args.rows), flush=True)
    print(f"\nseconds for {ROWS} rows of {PROMPT}+{RESPONSE} tokens, fwd + bwd, median (min-max) over {args.rounds} "
          f"round(s); x: time per token over the path's best size\n")
    print("| rows per micro-batch | " + " | ".join(PATHS) + " | fused / unfused |")
    print("|---|" + "---|" * (len(PATHS) + 1))
    best = {path: min(spread(times[(path, size)])[0] for size in args.rows) for path in PATHS}
    for size in args.rows:
        cells = [f"{show(times[(p, size)])} ({spread(times[(p, size)])[0] / best[p]:.2f}x)" for p in PATHS]
        print(f"| {size} | " + " | ".join(cells) + f" | {ratio(times[('fused', size)], times[('unfused', size)])} |")


if __name__ == "__main__":
    main()
