"""The built-in tool-use task: products of two three-digit numbers ("347*812="), which the tiny model cannot
compute itself but can look up with the calculator tool, then answer as "<answer>281764</answer>"; scored 0/1 by
pyrl.rewards.tool_calc (the last answer tag must hold the product).

Both operands are drawn from 317..999: the smallest three-digit range whose products all have six digits
(317 * 317 = 100489), so that every prompt has the same length and every demonstration the same layout (the
answer's digits sit at fixed distances from the tool response's, which a two-layer model learns to copy quickly).

A demonstration (what the supervised warm-start learns from, pyrl.models.warm_start.tool_warm_start_path), as
messages rendered with the tool model's chat template and tools=[calculator_schema()]:
system (the tool names) / user "347*812=" / assistant: a calculator call {"expression": "347*812"} / tool
"281764" / assistant "<answer>281764</answer>". Deterministic from a seed; train, validation (stops the
warm-start's stages, what runs report) and a held-out test split (never used to stop or choose anything) are
disjoint.

The transfer variant (preset=tool_calc_transfer) keeps the task and changes what the warm-start shows:
demonstrations of the calculator on sums and differences of the same operands ("347+812=", "812-347="), never on
products (tool_transfer_problems), so that calling it for a product is something RL has to discover."""

from __future__ import annotations

import operator
import random
from pathlib import Path

from pyrl.data.toy import TaskFiles, task_files
from pyrl.rewards.tool_calc import SOURCE as TOOL_CALC_SOURCE

TOOL_CALC_VERSION = 2  # 2: a held-out test split
LOW, HIGH = 317, 999  # operand range, both ends included: every product has six digits
TOOL_NAME = "calculator"
OPERATIONS = {"*": operator.mul, "+": operator.add, "-": operator.sub}  # the task's products, the transfer's others


def calculator_schema() -> dict:
    """The calculator tool's OpenAI function schema (pyrl.tools.calculator), what a rollout renders prompts with;
    the tiny tool model's chat template lists tools by name only, so only the name reaches the prompt."""
    from pyrl.tools.calculator import CalculatorTool  # lazy: pyrl.tools (pydantic, omegaconf) loads only for the schema

    return CalculatorTool({}).get_openai_tool_schema().model_dump(exclude_none=True)


def tool_calc_result(a: int, b: int, op: str = "*") -> int:
    return OPERATIONS[op](a, b)


def tool_calc_prompt(a: int, b: int, op: str = "*") -> str:
    return f"{a}{op}{b}="


def tool_calc_answer(a: int, b: int, op: str = "*") -> str:
    return f"<answer>{tool_calc_result(a, b, op)}</answer>"


def tool_calc_call(a: int, b: int, op: str = "*") -> dict:
    """The assistant's tool call, as an OpenAI tool_calls item."""
    return {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": f"{a}{op}{b}"}}}


def tool_calc_demonstration(a: int, b: int, op: str = "*") -> list[dict]:
    """The whole demonstrated conversation (render it with tools=[calculator_schema()]): the question, the calculator
    call, its result, the answer."""
    return [
        {"role": "user", "content": tool_calc_prompt(a, b, op)},
        {"role": "assistant", "content": "", "tool_calls": [tool_calc_call(a, b, op)]},
        {"role": "tool", "content": str(tool_calc_result(a, b, op))},
        {"role": "assistant", "content": tool_calc_answer(a, b, op)},
    ]


# The warm-start's second stage learns from a teacher that uses the calculator only sometimes: with probability
# TOOL_USE_HIGH when the first operand is >= TOOL_USE_FROM (about 15% of prompts), TOOL_USE_LOW otherwise; else it
# answers in its head, with a wrong guess (pyrl.models.warm_start explains why).
TOOL_USE_FROM, TOOL_USE_HIGH, TOOL_USE_LOW = 900, 0.8, 0.2


def tool_calc_guess(a: int, b: int, rng: random.Random) -> list[dict]:
    """A conversation where the assistant answers without the tool: a six-digit guess, never the product."""
    guess = a * b
    while guess == a * b:
        guess = rng.randrange(100000, 1000000)
    return [{"role": "user", "content": tool_calc_prompt(a, b)},
            {"role": "assistant", "content": f"<answer>{guess}</answer>"}]


def tool_calc_mixed(pairs, seed: int = 0) -> tuple[list[list[dict]], list[bool]]:
    """(conversations, used_tool) of the sometimes-calculating teacher (TOOL_USE_*), deterministic from `seed`."""
    rng = random.Random(seed)
    conversations, used = [], []
    for a, b in pairs:
        tool = rng.random() < (TOOL_USE_HIGH if a >= TOOL_USE_FROM else TOOL_USE_LOW)
        conversations.append(tool_calc_demonstration(a, b) if tool else tool_calc_guess(a, b, rng))
        used.append(tool)
    return conversations, used


def tool_calc_pairs(seed: int = 0, train_size: int = 20000, val_size: int = 256,
                    test_size: int = 256) -> tuple[list, list, list]:
    """(train, val, test): distinct operand pairs drawn by `seed` from the 683 x 683 possible. train_size +
    val_size are drawn first (the first val_size for validation, the rest train), then test_size more among
    the pairs left, by a generator of their own (so that train and val are those of the task before it had a
    test split, and the warm-start made from them stays valid)."""
    side = HIGH - LOW + 1
    drawn = random.Random(seed).sample(range(side * side), train_size + val_size)
    taken = set(drawn)
    rest = random.Random(f"tool_calc-test-{seed}")
    held = []
    while len(held) < test_size:
        k = rest.randrange(side * side)
        if k not in taken:
            taken.add(k)
            held.append(k)
    pair = lambda k: (LOW + k // side, LOW + k % side)  # noqa: E731
    pairs = [pair(k) for k in drawn]
    return pairs[val_size:], pairs[:val_size], [pair(k) for k in held]


def tool_transfer_problems(seed: int = 0, train_size: int = 20000, val_size: int = 256) -> tuple[list, list]:
    """The transfer variant's warm-start problems, (a, b, op) with op "+" or "-" (half each; the larger operand
    first in a difference, so results are never negative), operands from the task's range: (train, val)."""
    rng = random.Random(f"tool_transfer-{seed}")
    problems, seen = [], set()
    while len(problems) < train_size + val_size:
        a, b, op = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH), rng.choice("+-")
        if op == "-" and a < b:
            a, b = b, a
        if (a, b, op) not in seen:
            seen.add((a, b, op))
            problems.append((a, b, op))
    return problems[val_size:], problems[:val_size]


TRANSFER_PRODUCTS = ("absent", "guessed")  # how the transfer variant's training data holds products


def check_transfer_products(products: str) -> None:
    if products not in TRANSFER_PRODUCTS:
        raise ValueError(f"products={products!r}: expected one of {', '.join(map(repr, TRANSFER_PRODUCTS))}")


def tool_transfer_conversations(problems, products: str, seed: int = 0) -> list[list[dict]]:
    """The transfer warm-start's training conversations: a calculator demonstration of each (a, b, op) problem
    (sums and differences, tool_transfer_problems), and with products="guessed" half as many products of the task's
    train split answered without the calculator (tool_calc_guess); products="absent": no product at all."""
    check_transfer_products(products)
    if any(op == "*" for _, _, op in problems):
        raise ValueError("the transfer warm-start never demonstrates the calculator on a product")
    conversations = [tool_calc_demonstration(*p) for p in problems]
    if products == "guessed":
        rng = random.Random(f"tool_transfer-guess-{seed}")
        conversations += [tool_calc_guess(a, b, rng) for a, b in tool_calc_pairs(seed)[0][:len(problems) // 2]]
    return conversations


def tool_calc_rows(pairs, split: str) -> list[dict]:
    """verl's schema, as its multi-turn datasets carry it: extra_info.tools_kwargs (the calculator needs no
    per-sample arguments: empty)."""
    return [{
        "data_source": TOOL_CALC_SOURCE,
        "prompt": [{"role": "user", "content": tool_calc_prompt(a, b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "extra_info": {"split": split, "index": i, "question": tool_calc_prompt(a, b),
                       "answer": tool_calc_answer(a, b), "tools_kwargs": {}},
    } for i, (a, b) in enumerate(pairs)]


def _schema():
    """Parquet cannot store an empty struct, which is what pyarrow infers for tools_kwargs={}: it is a map
    (string -> string) instead, empty; it reads back as [] (pyrl.data.RLHFDataset makes that {})."""
    import pyarrow as pa  # lazy: pyarrow loads only when the task files are written

    string = pa.string()
    return pa.schema([
        ("data_source", string),
        ("prompt", pa.list_(pa.struct([("role", string), ("content", string)]))),
        ("ability", string),
        ("reward_model", pa.struct([("style", string), ("ground_truth", string)])),
        ("extra_info", pa.struct([("split", string), ("index", pa.int64()), ("question", string), ("answer", string),
                                  ("tools_kwargs", pa.map_(string, string))])),
    ])


def _rows_for_parquet(rows: list[dict]) -> list[dict]:
    return [{**r, "extra_info": {**r["extra_info"], "tools_kwargs": list(r["extra_info"]["tools_kwargs"].items())}}
            for r in rows]


def tool_calc_task_files(seed: int = 0, train_size: int = 20000, val_size: int = 256, test_size: int = 256,
                         cache_dir: str | None = None) -> TaskFiles:
    """The tool task's TaskFiles in verl's schema (see pyrl.data.toy.task_files; extra_info.split as there)."""
    # lazy: pyarrow loads only when the task files are written
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(tmp: Path) -> None:
        train, val, test = tool_calc_pairs(seed, train_size, val_size, test_size)
        for name, pairs, split in (("train", train, "train"), ("val", val, "test"), ("test", test, "heldout")):
            table = pa.Table.from_pylist(_rows_for_parquet(tool_calc_rows(pairs, split)), schema=_schema())
            pq.write_table(table, tmp / f"{name}.parquet")

    return task_files(f"tool_calc-v{TOOL_CALC_VERSION}-seed{seed}-train{train_size}-val{val_size}-test{test_size}",
                      write, cache_dir)
