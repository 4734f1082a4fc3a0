"""python -m pyrl.plot RUN_DIR: a PNG (RUN_DIR/metrics.png) of a run's reward, validation reward,
response length, KL, entropy, losses and (multi-turn runs) tool calls over steps, from RUN_DIR/metrics.jsonl."""

from __future__ import annotations

import json
import os
import sys

PANELS = [
    ("reward", ["critic/score/mean", "val-core/*"]),
    ("response length", ["response_length/mean"]),
    ("KL", ["actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty"]),
    ("entropy", ["actor/entropy"]),
    ("losses", ["actor/pg_loss", "critic/vf_loss"]),
    ("tool calls", ["tool_calls/sample_ratio", "val-aux/tool_calls/sample_ratio", "tool_calls/error_ratio"]),
]


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: was the run's trainer.logger without jsonl?")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(run_dir: str, out: str | None = None) -> str:
    import matplotlib  # lazy: matplotlib loads only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: pyplot only after the Agg backend is chosen

    rows = read_metrics(run_dir)
    panels = [(title, sorted({k for row in rows for k in row for p in patterns
                              if (k.startswith(p[:-1]) if p.endswith("*") else k == p)})) for title, patterns in PANELS]
    panels = [(title, keys) for title, keys in panels if keys or title != "tool calls"]  # multi-turn runs only
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            points = [(row["step"], row[key]) for row in rows if key in row]
            ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        if keys:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = out or os.path.join(run_dir, "metrics.png")
    tmp = out + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m pyrl.plot RUN_DIR")
    print(plot_run(argv[0]))


if __name__ == "__main__":
    main()
