"""Turn local GSM8K, MATH and Countdown files (parquet or JSON lines, as their hubs ship them) into
verl's parquet schema:

    python -m pyrl.data.preprocess gsm8k --input gsm8k/train.parquet --output ~/data/gsm8k/train.parquet
"""

from __future__ import annotations

import argparse
import json
import os
import re

from pyrl.rewards.math_answer import last_boxed_only_string, remove_boxed

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def read_records(path: str) -> list[dict]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq  # lazy: pyarrow loads only when a parquet file is read or written

        return pq.read_table(path).to_pylist()
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _require(record: dict, keys, index: int, path: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise ValueError(f"{path}: record {index} lacks {missing} (has {sorted(record)})")


def gsm8k_row(record: dict, index: int, split: str, path: str = "") -> dict:
    _require(record, ("question", "answer"), index, path)
    found = re.search(r"#### (\-?[0-9\.\,]+)", record["answer"])
    if found is None:
        raise ValueError(f"{path}: record {index}: no '#### <number>' in its answer")
    truth = found.group(1).replace(",", "")
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{record['question']} {GSM8K_INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "answer": record["answer"], "question": record["question"]}}


def math_row(record: dict, index: int, split: str, path: str = "") -> dict:
    _require(record, ("problem", "solution"), index, path)
    boxed = last_boxed_only_string(record["solution"])
    if boxed is None:
        raise ValueError(f"{path}: record {index}: no \\boxed{{}} answer in its solution")
    return {"data_source": "DigitalLearningGmbH/MATH-lighteval",
            "prompt": [{"role": "user", "content": f"{record['problem']} {MATH_INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": remove_boxed(boxed)},
            "extra_info": {"split": split, "index": index}}


def countdown_row(record: dict, index: int, split: str, path: str = "") -> dict:
    _require(record, ("target", "nums"), index, path)
    numbers = [int(n) for n in record["nums"]]
    question = (f"Using the numbers {numbers}, create an equation that equals {record['target']}. You can use basic "
                "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in <think> "
                "</think> tags. And return the final answer in <answer> </answer> tags, for example "
                "<answer> (1 + 2) / 3 </answer>.")
    return {"data_source": "countdown", "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": {"target": int(record["target"]), "numbers": numbers}},
            "extra_info": {"split": split, "index": index}}


CONVERTERS = {"gsm8k": gsm8k_row, "math": math_row, "countdown": countdown_row}


def convert(kind: str, input_path: str, output_path: str, split: str = "train") -> int:
    # lazy: pyarrow loads only when a parquet file is read or written
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind not in CONVERTERS:
        raise ValueError(f"unknown data set {kind!r}, expected one of {sorted(CONVERTERS)}")
    rows = [CONVERTERS[kind](r, i, split, input_path) for i, r in enumerate(read_records(input_path))]
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    tmp = output_path + ".tmp"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, output_path)
    return len(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(CONVERTERS))
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--split", default="train")
    args = parser.parse_args(argv)
    print(f"wrote {convert(args.kind, args.input, args.output, args.split)} rows to {args.output}")


if __name__ == "__main__":
    main()
