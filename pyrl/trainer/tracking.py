"""Where metrics go (trainer.logger): console (a compact line per step, a header every 20 steps, under a
progress bar over steps), jsonl (RUN_DIR/metrics.jsonl, one object per step with a `step` field),
wandb (honours WANDB_MODE=offline) and tensorboard (RUN_DIR/tensorboard). Validation generations
(trainer.log_val_generations) go to the console, a wandb table and tensorboard text."""

from __future__ import annotations

import json
import math
import os

from tqdm import tqdm

BACKENDS = ("console", "jsonl", "wandb", "tensorboard")
CONSOLE_COLUMNS = [("critic/score/mean", "score"), ("val-core/*", "val"), ("actor/pg_loss", "pg_loss"),
                   ("actor/entropy", "entropy"), ("actor/ppo_kl", "ppo_kl"), ("critic/vf_loss", "vf_loss"),
                   ("response_length/mean", "resp_len"), ("timing_s/gen", "gen_s"), ("timing_s/step", "step_s")]


def metrics_file(run_dir: str) -> str:
    return os.path.join(run_dir, "metrics.jsonl")


def truncate_metrics(run_dir: str, last_step: int) -> None:
    """Drop entries after `last_step` (a resumed run repeats them), rewriting the file atomically."""
    path = metrics_file(run_dir)
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= last_step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _markdown_cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


class Tracking:
    def __init__(self, backends, run_dir: str, project: str, experiment: str, config: dict, total_steps: int,
                 initial_step: int = 0):
        backends = [backends] if isinstance(backends, str) else list(backends)
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"trainer.logger: unknown {unknown}, expected some of {list(BACKENDS)}")
        self.backends, self.run_dir = backends, run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.bar = tqdm(total=total_steps, initial=initial_step, desc="training", unit="step",
                        disable="console" not in backends, dynamic_ncols=True)
        self.lines = 0
        self.jsonl = open(metrics_file(run_dir), "a") if "jsonl" in backends else None
        self.wandb = self.tensorboard = None
        if "wandb" in backends:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("trainer.logger=wandb needs the wandb package: pip install wandb") from e
            self.wandb = wandb.init(project=project, name=experiment, config=config, dir=run_dir, resume="allow")
        if "tensorboard" in backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("trainer.logger=tensorboard needs the tensorboard package: pip install tensorboard") from e
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log(self, metrics: dict, step: int, advance: bool = True) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if self.tensorboard is not None:
            for key, value in clean.items():
                self.tensorboard.add_scalar(key, value, step)
        if "console" in self.backends:
            self._console(clean, step)
            if advance:
                self.bar.update()

    def log_generations(self, records: list[dict], step: int) -> None:
        """A few validation samples: input, output, score (and ground truth) as text / a table."""
        if not records:
            return
        columns = ["step", "input", "output", "gts", "score"]
        rows = [[step, r["input"], r["output"], str(r.get("gts")), r["score"]] for r in records]
        if "console" in self.backends:
            self.bar.write(f"validation generations at step {step}:")
            for _, text_in, text_out, gts, score in rows:
                self.bar.write(f"  score {score:.3g}  {text_in!r} -> {text_out!r}  (expected {gts})")
        if self.wandb is not None:
            import wandb

            self.wandb.log({"val/generations": wandb.Table(columns=columns, data=rows)}, step=step)
        if self.tensorboard is not None:
            table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            table += ["| " + " | ".join(_markdown_cell(v) for v in row) + " |" for row in rows]
            self.tensorboard.add_text("val/generations", "\n".join(table), step)

    def _console(self, metrics: dict, step: int) -> None:
        def pick(pattern):
            if pattern.endswith("*"):
                hits = [v for k, v in metrics.items() if k.startswith(pattern[:-1])]
                return hits[0] if hits else None
            return metrics.get(pattern)

        if self.lines % 20 == 0:
            self.bar.write(" ".join(f"{label:>9}" for label in ["step"] + [c[1] for c in CONSOLE_COLUMNS]))
        cells = [f"{step:>9d}"] + [f"{'-':>9}" if (v := pick(p)) is None else f"{v:>9.4g}" for p, _ in CONSOLE_COLUMNS]
        self.bar.write(" ".join(cells))
        self.lines += 1

    def close(self) -> None:
        self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
