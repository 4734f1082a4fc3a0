"""On-policy distillation on the toy task (issue 28 item 2): a larger teacher trained on the task distils into the
tiny student, which gains on held-out prompts; GRPO from the same student, same steps and seeds, beside it.

    python benchmarks/distillation_toy.py [--seeds 0 1 2] [--steps N] [--out DIR]

1. The teacher: SFT of pyrl:tiny-wide (1.2M parameters) on pyrl:toy_addition_sft, 1600 steps
   (python -m pyrl.trainer.sft_trainer), exported as a Hugging Face model (kept in DIR and reused by a rerun).
2. The student: the toy preset's own, pyrl:tiny-toy-sft (0.34M parameters, pyrl's warm-start), or with
   --student-base MODEL a brief SFT of MODEL (--student-sft-steps, 250), e.g. pyrl:tiny-wide: a weak start of the
   teacher's own architecture.
3. Each seed, `python -m pyrl.ppo preset=toy` (benchmarks/heldout_eval.py's runs: validation on the held-out test
   split, greedy, every 25 steps), the preset's recipe unchanged but for the loss: with distillation
   (forward_kl_topk over the teacher's top 32, no task rewards), and as is (GRPO on the task's rewards).
4. The teacher's and the student's greedy held-out reward (main_generation_server + main_eval, temperature 0).

Writes DIR/distillation_toy.json and DIR/distillation_toy.png (every seed's held-out curve, both methods, the
teacher's level). Runs one after another (2 cores); --quick (the smoke run of benchmarks/test_results_scripts.py):
5 SFT steps, distillation only, 2 steps, one seed, 16 held-out prompts.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import heldout_eval  # noqa: E402

STUDENT = "pyrl:tiny-toy-sft"  # the toy preset's model
DISTILL = ["distillation.enabled=true", "distillation.distillation_loss.loss_mode=forward_kl_topk",
           "distillation.distillation_loss.use_task_rewards=false"]


def sft(name: str, base: str, lr: float, steps: int, out: str) -> tuple[str, float]:
    """The exported model of an SFT run (made once), and the run's seconds (0 when reused)."""
    run_dir = os.path.join(out, name)
    model = os.path.join(run_dir, f"global_step_{steps}", "huggingface")
    if os.path.isdir(model):
        return model, 0.0
    start = time.perf_counter()
    command = [sys.executable, "-m", "pyrl.trainer.sft_trainer", "data.train_files=pyrl:toy_addition_sft",
               "data.val_files=pyrl:toy_addition_sft:val", f"model.path={base}", "trainer.n_gpus_per_node=0",
               "data.train_batch_size=128", f"optim.lr={lr}", f"trainer.total_training_steps={steps}",
               f"trainer.test_freq={steps}", f"trainer.save_freq={steps}", "trainer.logger=[console]",
               f"trainer.default_local_dir={run_dir}", "checkpoint.save_contents=[model,optimizer,extra,hf_model]"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"SFT {name} failed: {' '.join(command)}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return model, time.perf_counter() - start


def greedy_heldout(model: str, out: str, name: str, max_samples: int | None) -> float:
    """Greedy (temperature 0) held-out reward of `model` on pyrl:toy_addition:test, as main_eval reports it."""
    path = os.path.join(out, f"{name}-test.parquet")
    gen = [sys.executable, "-m", "pyrl.trainer.main_generation_server", "data.train_files=pyrl:toy_addition:test",
           f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.n=1",
           "actor_rollout_ref.rollout.temperature=0", "data.max_prompt_length=64", "data.max_response_length=16",
           f"data.output_path={path}"] + ([f"data.train_max_samples={max_samples}"] if max_samples else [])
    for command in (gen, [sys.executable, "-m", "pyrl.trainer.main_eval", f"data.path={path}"]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"failed: {' '.join(command)}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    printed = next(line for line in done.stdout.splitlines()[::-1] if line.startswith("{"))  # main_eval's dict
    return float(ast.literal_eval(printed)["test_score/pyrl/toy_addition"])


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    for method, style in (("distillation", "-"), ("grpo", "--")):
        for r in result.get(method, []):
            steps, values = zip(*r["val"])
            ax.plot(steps, values, style, marker=".", label=f"{method}, seed {r['seed']}")
        if method == "distillation":
            for r in result.get(method, []):
                curve = r["training"]["actor/distillation/loss"]
                if curve:
                    steps, values = zip(*curve)
                    loss_ax.plot(steps, values, label=f"seed {r['seed']}")
    ax.axhline(result["teacher_greedy"], color="k", lw=0.8, label="teacher (SFT, 1.2M)")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out reward (greedy)")
    student = result["student"]  # a builtin's name, or an SFT run's DIR/<run>/global_step_N/huggingface
    name = os.path.basename(os.path.dirname(os.path.dirname(student))) if os.path.isdir(student) else student
    ax.set_title(f"student {name}: on-policy distillation vs GRPO", fontsize=9)
    ax.legend(fontsize=7)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("actor/distillation/loss")
    loss_ax.set_title("forward KL over the teacher's top 32 (student's samples)", fontsize=9)
    loss_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def spread(values) -> str:
    return f"{np.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=0, help="trainer.total_training_steps (default: the preset's)")
    parser.add_argument("--out", default="distillation_runs")
    parser.add_argument("--student-base", default=None,
                        help="a model to SFT briefly into the student (e.g. pyrl:tiny-wide, the teacher's architecture)"
                             "; default: the toy preset's student, pyrl:tiny-toy-sft")
    parser.add_argument("--student-sft-steps", type=int, default=250, help="the student's SFT steps (--student-base)")
    parser.add_argument("--quick", action="store_true", help="5 SFT steps, distillation only, 2 steps, one seed, 16 "
                                                             "held-out prompts")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sft_steps = 5 if args.quick else 1600
    teacher, teacher_s = sft("teacher", "pyrl:tiny-wide", 2e-3, sft_steps, args.out)
    student = STUDENT
    if args.student_base:  # a weak start of the teacher's architecture
        steps = 5 if args.quick else args.student_sft_steps
        student, _ = sft(f"student-{args.student_base.replace(':', '-').replace('/', '-')}-{steps}",
                         args.student_base, 2e-3, steps, args.out)
    samples = 16 if args.quick else None
    result = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "teacher_sft_seconds": round(teacher_s, 1), "student": student,
              "teacher_greedy": greedy_heldout(teacher, args.out, "teacher", samples),
              "student_greedy": greedy_heldout(student, args.out, "student", samples)}
    print(f"greedy held-out reward: teacher {result['teacher_greedy']:.3f}, student {result['student_greedy']:.3f}",
          flush=True)
    student_path = [] if student == STUDENT else [f"actor_rollout_ref.model.path={student}"]
    methods = {"distillation": student_path + DISTILL + [
        f"distillation.teacher_models.teacher_model.model_path={teacher}"], "grpo": student_path}
    if args.quick:  # the smoke run: distillation only
        methods.pop("grpo")
    for method, extra in methods.items():
        runs = []
        for seed in args.seeds if not args.quick else args.seeds[:1]:
            run_args = argparse.Namespace(name=method, overrides=extra,
                                          steps=args.steps or (2 if args.quick else 0), quick=args.quick)
            runs.append(heldout_eval.run("toy", seed, run_args, args.out))
            r = runs[-1]
            print(f"{method} seed {seed}: {r['val'][0][1]:.3f} at step {r['val'][0][0]} -> {r['val'][-1][1]:.3f} at "
                  f"step {r['val'][-1][0]} ({r['seconds']:.0f} s)", flush=True)
        result[method] = runs
    with open(os.path.join(args.out, "distillation_toy.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, "distillation_toy.png"))
    print("\n| from the student | seeds | held-out reward at step 0 | at the last step | gain | seconds |")
    print("|---|---|---|---|---|---|")
    for method in methods:
        runs = result[method]
        start, final = [r["val"][0][1] for r in runs], [r["val"][-1][1] for r in runs]
        print(f"| {method} | {len(runs)} | {spread(start)} | {spread(final)} | "
              f"{spread([f - s for s, f in zip(start, final)])} | {spread([r['seconds'] for r in runs])} |")
    print("(mean (min-max) over seeds)")


if __name__ == "__main__":
    main()
