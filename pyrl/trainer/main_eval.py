"""python -m pyrl.trainer.main_eval [key=value ...]: verl 0.9.1's offline evaluation with the module name changed.
It reads a generations parquet (data.path; main_generation_server's output: a list of responses per row in
data.response_key), scores every response against its row's ground truth (data.reward_model_key's
`ground_truth`) with the row's data source (data.data_source_key), and prints per data source:

- `test_score/{source}`: verl's metric, the mean over rows of each row's mean score (mean@n, each row weighing the
  same);
- `pass@{k}/{source}` for k = 1, 2, 4, ... below the fewest responses a row has, and that number: the unbiased
  estimate 1 - C(n - c, k) / C(n, k) of the chance that k of a row's n responses (c of them passing) hold at least
  one that passes, averaged over rows. A response passes when its scorer says so (a dict score's `acc`) or its score
  reaches pass_threshold (pyrl's key, 1.0: a full score).

    python -m pyrl.trainer.main_eval data.path=/tmp/gen.parquet \\
        custom_reward_function.path=my_score.py custom_reward_function.name=compute_score

The scorer: custom_reward_function.path / .name (verl's evaluation.yaml keys; verl 0.9.1's own code reads
reward.custom_reward_function, which its evaluation.yaml lacks: both are taken here, one at a time), called as verl
calls it, fn(data_source, response, ground_truth, **reward_kwargs); without one, pyrl's rule-based scorers by data
source (verl 0.9.1 has no fallback: a null path fails there). A dict score's `score` is the score (verl's np.mean
fails on dicts). A scorer that raises or runs over SCORE_TIMEOUT_S stops the evaluation naming the row: a score
never stands in silently for an error. Scoring runs in ray_kwargs.ray_init.num_cpus processes (null: one per
core), as verl's Ray tasks use that many CPUs.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

import pyrl.ppo as ppo
from pyrl.config import typed_config

log = logging.getLogger("pyrl")

SCORE_TIMEOUT_S = 300.0  # one response's scoring


@dataclass
class EvalDataConfig:
    path: str = "/tmp/math_Qwen2-7B-Instruct.parquet"  # verl 0.9.1's default
    prompt_key: str = "prompt"  # verl's evaluation.yaml has it and reads it nowhere: only its default is taken
    response_key: str = "responses"
    data_source_key: str = "data_source"
    reward_model_key: str = "reward_model"


@dataclass
class EvalRewardFunction:
    path: Optional[str] = None  # a Python file or a dotted module; null: pyrl's scorers by data source
    name: Optional[str] = "compute_score"
    reward_kwargs: dict = field(default_factory=dict)  # bound to the function as keywords


@dataclass
class EvalRewardSection:
    """verl 0.9.1's main_eval reads the scorer here (its evaluation.yaml has it at the top level)."""
    custom_reward_function: EvalRewardFunction = field(default_factory=EvalRewardFunction)


@dataclass
class EvalRayInit:
    num_cpus: Optional[int] = None  # scoring processes; null: one per core


@dataclass
class EvalRayKwargs:
    ray_init: EvalRayInit = field(default_factory=EvalRayInit)
    timeline_json_file: Optional[str] = None  # verl's key, read nowhere there; refused when set


@dataclass
class EvalConfig:
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    custom_reward_function: EvalRewardFunction = field(default_factory=EvalRewardFunction)
    reward: EvalRewardSection = field(default_factory=EvalRewardSection)
    ray_kwargs: EvalRayKwargs = field(default_factory=EvalRayKwargs)
    pass_threshold: float = 1.0  # pyrl's: a response passes when its score reaches this (or its dict's acc is true)


ConfigStore.instance().store(name="evaluation_schema", node=EvalConfig)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with n responses, c of them passing (Chen et al., 2021): 1 - C(n-c, k) /
    C(n, k), the chance that k responses drawn without replacement hold a passing one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: expected 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n (verl's validation reports best@k at these sizes)."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def _positional(fn, data_source, solution_str, ground_truth):
    """verl's main_eval calls its scorer with three positional arguments (their names are the user's)."""
    return fn(data_source, solution_str, ground_truth)


def scorer_of(config: EvalConfig):
    """The configured function (reward_kwargs bound), or pyrl's rule-based scorers by data source."""
    # lazy: the scorers' modules load only for an evaluation
    from pyrl.rewards.managers import load_custom_function
    from pyrl.rewards.scorers import default_compute_score

    top, nested = config.custom_reward_function, config.reward.custom_reward_function
    if top.path and nested.path:
        raise ValueError(f"custom_reward_function.path={top.path!r} and reward.custom_reward_function.path="
                         f"{nested.path!r}: set one (verl 0.9.1's evaluation.yaml has the first, its code reads the "
                         f"second)")
    chosen = nested if nested.path else top
    if not chosen.path:
        return default_compute_score
    return load_custom_function(chosen.path, chosen.name, dict(chosen.reward_kwargs))


def score_rows(config: EvalConfig, calls: list[dict], places: list[str]) -> list:
    """Each call's score (scorer(data_source, response, ground_truth)), in ray_kwargs.ray_init.num_cpus processes
    (null: one per core); a failure stops here naming its place."""
    from pyrl.rewards.managers import attempt, close_scoring_pools, pool_outcomes  # lazy: as scorer_of

    scorer = functools.partial(_positional, scorer_of(config))
    processes = config.ray_kwargs.ray_init.num_cpus or os.cpu_count() or 1
    if processes <= 1 or len(calls) < 2:
        results = [attempt(scorer, SCORE_TIMEOUT_S, call) for call in calls]
    else:
        try:
            results = pool_outcomes(scorer, SCORE_TIMEOUT_S, calls, processes)
        finally:
            close_scoring_pools()
    for (value, failure, message, _), place in zip(results, places):
        if failure:
            raise RuntimeError(f"{place}: the scorer failed ({message}); no score stands in for it")
    return [value for value, *_ in results]


def evaluate(config: EvalConfig) -> dict:
    """The metrics of data.path's generations (see the module's docstring)."""
    import pyarrow.parquet as pq  # lazy: pyarrow loads only when a run starts

    data = config.data
    if data.prompt_key != EvalDataConfig.prompt_key:
        raise ValueError(f"data.prompt_key={data.prompt_key!r}: evaluation reads no prompt (verl 0.9.1 neither); "
                         f"leave it out")
    if config.ray_kwargs.timeline_json_file:
        raise ValueError("ray_kwargs.timeline_json_file: evaluation starts no Ray timeline (verl 0.9.1 reads the key "
                         "nowhere either); leave it out")
    if not os.path.exists(data.path):
        raise FileNotFoundError(f"data.path={data.path!r}: no such file (a generations parquet, e.g. "
                                f"python -m pyrl.trainer.main_generation_server's output)")
    table = pq.read_table(data.path)
    for key in ("response_key", "data_source_key", "reward_model_key"):
        column = getattr(data, key)
        if column not in table.column_names:
            raise ValueError(f"data file {data.path!r}: missing column {column!r} (data.{key}; the file has "
                             f"{table.column_names})")
    rows = table.select([data.response_key, data.data_source_key, data.reward_model_key]).to_pylist()
    calls, places, owners = [], [], []
    for i, row in enumerate(rows):
        place = f"data file {data.path!r} row {i}"
        responses, truth = row[data.response_key], row[data.reward_model_key]
        if not isinstance(responses, list) or not responses or not all(isinstance(r, str) for r in responses):
            raise ValueError(f"{place}: column {data.response_key!r} must be a non-empty list of strings, got "
                             f"{responses!r:.100}")
        if not isinstance(truth, dict) or "ground_truth" not in truth:
            raise ValueError(f"{place}: column {data.reward_model_key!r} must be a struct with 'ground_truth', got "
                             f"{truth!r:.100}")
        for j, response in enumerate(responses):
            calls.append({"data_source": row[data.data_source_key], "solution_str": response,
                          "ground_truth": truth["ground_truth"]})
            places.append(f"{place} response {j}")
            owners.append(i)
    scores = score_rows(config, calls, places)
    per_row: dict[int, list[tuple[float, bool]]] = {}
    for i, value, place in zip(owners, scores, places):
        score = value.get("score") if isinstance(value, dict) else value
        try:  # any real number, numpy's and bool included (verl takes np.mean of whatever it gets); NaN stays NaN
            if isinstance(score, (str, bytes)):
                raise TypeError("text")
            score = float(score)
        except (TypeError, ValueError):
            raise ValueError(f"{place}: the scorer returned {value!r:.100}; expected a number or a dict with a "
                             f"numeric 'score'") from None
        passed = bool(value["acc"]) if isinstance(value, dict) and "acc" in value else score >= config.pass_threshold
        per_row.setdefault(i, []).append((score, passed))
    by_source: dict[str, list[list[tuple[float, bool]]]] = {}
    for i, results in per_row.items():
        by_source.setdefault(rows[i][data.data_source_key], []).append(results)
    metrics = {}
    for source, groups in by_source.items():
        metrics[f"test_score/{source}"] = sum(sum(s for s, _ in g) / len(g) for g in groups) / len(groups)
    for source, groups in by_source.items():
        for k in ks_for(min(len(g) for g in groups)):
            metrics[f"pass@{k}/{source}"] = sum(pass_at_k(len(g), sum(p for _, p in g), k)
                                                for g in groups) / len(groups)
    return metrics


@hydra.main(config_path="pkg://pyrl.configs", config_name="evaluation", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="[pyrl] %(message)s")
    print(evaluate(typed_config(cfg, EvalConfig)))  # the dict, as verl prints it


def cli() -> int | None:
    # verl's workaround for its own main_eval, +reward.custom_reward_function.path=..., names keys this schema has
    return ppo.schema_cli(main, EvalConfig)


if __name__ == "__main__":
    sys.exit(cli())
