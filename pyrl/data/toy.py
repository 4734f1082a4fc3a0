"""The built-in toy task: two-digit addition with zero-padded operands ("03+47="), answered as
"<answer>50</answer>", scored 0/1 by pyrl.rewards.toy. Every prompt has the same length, and the tiny
model learns it on a CPU in minutes. Deterministic from a seed; three disjoint splits (TaskFiles): train;
validation, which stops the warm-start and is what the run's validation reports (and what the recipe was chosen
on); and a held-out test split that nothing in pyrl looks at (`data.val_files=pyrl:toy_addition:test` puts it
in a run's validation, benchmarks/heldout_eval.py reports it over seeds)."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

from pyrl.rewards.scorers import TOY_SOURCE

TOY_VERSION = 2  # 2: a held-out test split (256 pairs) carved from the train split


def toy_prompt(a: int, b: int) -> str:
    return f"{a:02d}+{b:02d}="


def toy_answer(a: int, b: int) -> str:
    return f"<answer>{a + b}</answer>"


def toy_rows(pairs, split: str) -> list[dict]:
    return [{
        "data_source": TOY_SOURCE,
        "prompt": [{"role": "user", "content": toy_prompt(a, b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": i, "question": toy_prompt(a, b), "answer": toy_answer(a, b)},
    } for i, (a, b) in enumerate(pairs)]


class TaskFiles(NamedTuple):
    """A built-in task's parquet files: train; val (validation: stops the warm-start, the runs report it);
    test (held out: never used to stop, tune or choose anything)."""
    train: str
    val: str
    test: str


def toy_pairs(seed: int = 0, val_size: int = 256, test_size: int = 256) -> tuple[list, list, list]:
    """All 10,000 operand pairs shuffled by `seed`: (train, val, test), val the first val_size, test the next
    test_size, train the rest."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    held = val_size + test_size
    return pairs[held:], pairs[:val_size], pairs[val_size:held]


def task_files(name: str, write, cache_dir: str | None = None) -> TaskFiles:
    """TaskFiles (train, val, test .parquet) of a built-in task under $PYRL_CACHE_DIR (default
    ~/.cache/pyrl)/data/`name`, made on first use by write(tmp_dir) into a temp dir renamed into place (a crash
    leaves no half-written task; a process that loses the race keeps the other's)."""
    root = Path(cache_dir or os.environ.get("PYRL_CACHE_DIR", Path.home() / ".cache" / "pyrl")) / "data"
    target = root / name
    files = TaskFiles(*(str(target / f"{split}.parquet") for split in TaskFiles._fields))
    if all(os.path.exists(f) for f in files):
        return files
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-"))
    try:
        write(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process made it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return files


def toy_task_files(seed: int = 0, val_size: int = 256, test_size: int = 256, cache_dir: str | None = None) -> TaskFiles:
    """The toy task's TaskFiles in verl's schema (see task_files). extra_info.split: "train", "test" for the
    validation split (verl's name for what validation reads), "heldout" for the test split."""
    # lazy: pyarrow loads only when the task files are written
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(tmp: Path) -> None:
        train, val, test = toy_pairs(seed, val_size, test_size)
        for name, pairs, split in (("train", train, "train"), ("val", val, "test"), ("test", test, "heldout")):
            pq.write_table(pa.Table.from_pylist(toy_rows(pairs, split)), tmp / f"{name}.parquet")

    return task_files(f"toy_addition-v{TOY_VERSION}-seed{seed}-val{val_size}-test{test_size}", write, cache_dir)


def toy_sft_task_files(seed: int = 0, val_size: int = 256, test_size: int = 256,
                       cache_dir: str | None = None) -> TaskFiles:
    """The toy task as supervised conversations (data.messages_key "messages"): each question and its right answer
    (toy_answer), for pyrl.trainer.sft_trainer; the same pairs and splits as toy_task_files."""
    # lazy: pyarrow loads only when the task files are written
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(tmp: Path) -> None:
        for name, pairs in zip(TaskFiles._fields, toy_pairs(seed, val_size, test_size)):
            rows = [{"messages": [{"role": "user", "content": toy_prompt(a, b)},
                                  {"role": "assistant", "content": toy_answer(a, b)}]} for a, b in pairs]
            pq.write_table(pa.Table.from_pylist(rows), tmp / f"{name}.parquet")

    return task_files(f"toy_addition_sft-v{TOY_VERSION}-seed{seed}-val{val_size}-test{test_size}", write, cache_dir)
