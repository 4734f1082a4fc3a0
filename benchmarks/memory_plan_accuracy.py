"""The memory plan's estimates (pyrl/trainer/memory_plan.py) against peaks measured on CPU through the real actor
worker, per phase, for a couple of model and batch shapes, with and without gradient checkpointing and the fused
log-prob kernel. Measurement: tests/trainer/memory_measure.py (a fresh process per configuration, peak RSS above
the resident set before the phase, malloc returning freed tensors to the kernel).

    python benchmarks/memory_plan_accuracy.py [--quick] [--batch NAME]   # prints a markdown table (RESULTS.md)
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "trainer"))
import memory_measure  # noqa: E402

MODELS = {  # name -> make_model keywords (head_dim 64, 2 KV heads, untied head)
    "h256-L4-V32k (21M)": dict(hidden=256, layers=4, intermediate=1024, vocab=32768),
    "h512-L8-V16k (42M)": dict(hidden=512, layers=8, intermediate=1536, vocab=16384, heads=8),
}
BATCHES = {  # name -> rows (one mini-batch), rows per micro-batch, prompt and response lengths
    "32 x (32+32)": dict(rows=32, micro=32, prompt=32, response=32),
    "8 x (64+192)": dict(rows=8, micro=8, prompt=64, response=192),
    # the second micro-batch runs beside the first one's gradients
    "32 x (32+32), micro-batches of 16": dict(rows=32, micro=16, prompt=32, response=32),
}
SHAPES = [("h256-L4-V32k (21M)", "32 x (32+32)"), ("h256-L4-V32k (21M)", "8 x (64+192)"),
          ("h512-L8-V16k (42M)", "32 x (32+32)"), ("h512-L8-V16k (42M)", "32 x (32+32), micro-batches of 16")]


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first shape's two corners only (a smoke run)")
    parser.add_argument("--batch", choices=sorted(BATCHES), help="only the shapes with this batch")
    args = parser.parse_args(argv)
    shapes = SHAPES[:1] if args.quick else [s for s in SHAPES if args.batch in (None, s[1])]
    corners = ((False, False), (True, True)) if args.quick else ((False, False), (True, False),
                                                                 (False, True), (True, True))
    MiB = 2 ** 20
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; float32, one process (no FSDP group)\n")
    print("| model | batch | checkpointing | fused | phase | estimate MiB | measured MiB | estimate / measured |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for model_name, batch_name in shapes:
            path = memory_measure.make_model(os.path.join(root, model_name.split()[0]), **MODELS[model_name])
            batch = BATCHES[batch_name]
            for checkpointing, fused in corners:
                spec = {"model": path, "checkpointing": checkpointing, "fused": fused, **batch}
                estimated, measured = memory_measure.estimate(spec), memory_measure.measure(spec)
                for phase in ("resident", "update_actor", "old_log_prob"):
                    if phase == "resident" and (checkpointing, fused) != (False, False):
                        continue  # the same weights, gradients and moments in every configuration
                    print(f"| {model_name} | {batch_name} | {checkpointing} | {fused} | {phase} | "
                          f"{estimated[phase] / MiB:.0f} | {measured[phase] / MiB:.0f} | "
                          f"{estimated[phase] / measured[phase]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
