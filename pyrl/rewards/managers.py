"""Reward managers: a rollout batch -> token-level scores [B, R], each response's score on its last valid
token (verl's naive / batch / dapo managers).

A scorer that raises or runs past reward_model.timeout_s scores 0 for that sample; the count goes into
the metrics (reward/scorer_errors, reward/scorer_timeouts) and the first failure of each kind is logged
with the sample's index. With reward_model.strict=true the run stops instead.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import signal
import threading
from collections import defaultdict
from typing import Callable

import numpy as np
import torch

from pyrl.protocol import DataProto
from pyrl.rewards.scorers import default_compute_score

log = logging.getLogger(__name__)


class ScorerTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """SIGALRM-based limit (main thread only; elsewhere no limit is applied)."""
    if not seconds or seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise ScorerTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def load_custom_function(path: str, name: str, kwargs: dict | None = None) -> Callable:
    """custom_reward_function.path / .name: a function from a Python file, with reward_kwargs bound."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"custom_reward_function.path: {path!r} does not exist")
    spec = importlib.util.spec_from_file_location("pyrl_custom_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise AttributeError(f"custom_reward_function.name: {path!r} defines no function {name!r}")
    fn = getattr(module, name)
    return functools.partial(fn, **kwargs) if kwargs else fn


class RewardManager:
    """naive: one compute_score call per sample. Subclasses change how scores are computed or shaped."""

    def __init__(self, tokenizer, compute_score: Callable | None = None, reward_fn_key: str = "data_source",
                 strict: bool = False, timeout_s: float = 10.0, max_response_length: int | None = None,
                 overlong_buffer: dict | None = None):
        self.tokenizer = tokenizer
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key
        self.strict, self.timeout_s = strict, timeout_s
        self.max_response_length = max_response_length
        self.overlong_buffer = overlong_buffer or {}
        self.failures_logged: set[str] = set()

    # ---- per-sample inputs ----
    def decoded(self, data: DataProto):
        """(prompt strings, response strings, valid response lengths)."""
        prompt_mask = data.batch["attention_mask"][:, :data.batch["prompts"].shape[1]].bool()
        lengths = data.batch["response_mask"].sum(-1).tolist()
        prompts = [self.tokenizer.decode(row[m], skip_special_tokens=False)
                   for row, m in zip(data.batch["prompts"], prompt_mask)]
        responses = [self.tokenizer.decode(row[:n], skip_special_tokens=True)
                     for row, n in zip(data.batch["responses"], lengths)]
        return prompts, responses, lengths

    def sample_fields(self, data: DataProto, i: int):
        nt = data.non_tensor_batch
        if self.reward_fn_key not in nt:
            raise KeyError(f"reward: the batch has no {self.reward_fn_key!r} column (data.reward_fn_key)")
        reward_model = nt["reward_model"][i] if "reward_model" in nt else {}
        extra = nt["extra_info"][i] if "extra_info" in nt else None
        return nt[self.reward_fn_key][i], reward_model.get("ground_truth"), extra

    def guarded(self, kind_counts, index: int, fn, *args, failed=0.0):
        """fn(*args) under the time limit; a failure gives `failed` (a zero score) unless strict."""
        try:
            with time_limit(self.timeout_s):
                return fn(*args)
        except Exception as e:  # noqa: BLE001 - any scorer failure is counted, not fatal (unless strict)
            kind = "timeouts" if isinstance(e, ScorerTimeout) else "errors"
            if self.strict:
                raise RuntimeError(f"reward: the scorer {'timed out' if kind == 'timeouts' else 'raised'} on sample {index} "
                                   f"(reward_model.strict=true): {type(e).__name__}: {e}") from e
            kind_counts[kind] += 1
            if kind not in self.failures_logged:
                self.failures_logged.add(kind)
                log.warning("reward: scorer %s on sample %d (%s: %s); it scores 0, and later failures are only counted "
                            "in reward/scorer_%s", "timed out" if kind == "timeouts" else "raised", index,
                            type(e).__name__, e, kind)
            return failed

    def scores(self, data: DataProto, responses, counts) -> list:
        out = []
        for i, response in enumerate(responses):
            source, truth, extra = self.sample_fields(data, i)
            out.append(self.guarded(counts, i, self.compute_score, source, response, truth, extra))
        return out

    # ---- the call ----
    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict, dict]:
        """-> (token_level_scores [B, R], reward_extra_info {name: list}, metrics)."""
        if "rm_scores" in data.batch:  # a reward model scored the batch already
            return data.batch["rm_scores"], {}, {}
        _, responses, lengths = self.decoded(data)
        counts = defaultdict(int)
        raw = self.scores(data, responses, counts)
        for i, score in enumerate(raw):
            if isinstance(score, dict) and "score" not in score:
                raise ValueError(f"reward: compute_score returned a dict without 'score' for sample {i}: {score!r:.200}")
        values = np.asarray([score["score"] if isinstance(score, dict) else score for score in raw], dtype=np.float64)
        extra_info = extra_fields(raw)
        if self.overlong_buffer.get("enable"):
            values = values + self.overlong_penalty(np.asarray(lengths))
        scores = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        last = torch.as_tensor(lengths) - 1
        has = last >= 0
        scores[torch.nonzero(has).squeeze(-1), last[has]] = torch.as_tensor(values, dtype=torch.float32)[has]
        metrics = {"reward/scorer_errors": counts["errors"], "reward/scorer_timeouts": counts["timeouts"]}
        return scores, dict(extra_info), metrics

    def overlong_penalty(self, lengths: np.ndarray) -> np.ndarray:
        """DAPO's soft overlong punishment: 0 up to max_len - buffer, then linearly down to -penalty_factor."""
        buffer_len = int(self.overlong_buffer.get("len", 0))
        if buffer_len <= 0 or not self.max_response_length:
            raise ValueError("reward_model.overlong_buffer: enable needs len > 0 and data.max_response_length")
        exceed = lengths - (self.max_response_length - buffer_len)
        return np.minimum(-exceed / buffer_len * float(self.overlong_buffer.get("penalty_factor", 1.0)), 0.0)


def is_number(value) -> bool:
    """A plain or numpy number (bools included): what a reward extra field must be to be averaged."""
    return isinstance(value, (bool, int, float, np.bool_, np.number))


def extra_fields(raw: list) -> dict[str, list]:
    """The fields of scorers that return dicts (verl's reward_extra_info), one value per sample. A sample
    whose scorer failed (or returned a plain number) gets 0.0 for a field that is numeric elsewhere (its
    score is 0 too) and None otherwise, so every list stays aligned with the batch."""
    keys = list(dict.fromkeys(key for score in raw if isinstance(score, dict) for key in score))
    fields = {}
    for key in keys:
        present = [score[key] for score in raw if isinstance(score, dict) and key in score]
        fill = 0.0 if all(is_number(v) for v in present) else None
        fields[key] = [score.get(key, fill) if isinstance(score, dict) else fill for score in raw]
    return fields


class BatchRewardManager(RewardManager):
    """One compute_score call for the whole batch: compute_score(data_sources, solution_strs, ground_truths,
    extra_infos) -> list of scores."""

    def scores(self, data: DataProto, responses, counts) -> list:
        fields = [self.sample_fields(data, i) for i in range(len(responses))]
        sources, truths, extras = (list(x) for x in zip(*fields)) if fields else ([], [], [])
        result = self.guarded(counts, 0, self.compute_score, sources, responses, truths, extras,
                              failed=[0.0] * len(responses))
        if not isinstance(result, (list, tuple, np.ndarray)) or len(result) != len(responses):
            raise ValueError(f"reward: the batch compute_score returned {type(result).__name__}, expected a list of "
                             f"{len(responses)} scores")
        return list(result)


MANAGERS = {"naive": RewardManager, "dapo": RewardManager, "batch": BatchRewardManager}


def load_reward_manager(config, tokenizer, validation: bool = False) -> RewardManager:
    """The manager reward_model.reward_manager names, with custom_reward_function if one is set. Validation
    never applies the overlong penalty (verl scores validation by the rule alone)."""
    name = config.reward_model.reward_manager
    if name not in MANAGERS:
        raise ValueError(f"reward_model.reward_manager: unknown {name!r}, expected one of {sorted(MANAGERS)}")
    custom = config.reward_model.custom_reward_function
    if not custom.path:
        custom = config.custom_reward_function
    compute_score = None
    if custom.path:
        compute_score = load_custom_function(custom.path, custom.name, dict(custom.reward_kwargs))
    elif name == "batch":
        raise ValueError("reward_model.reward_manager=batch needs custom_reward_function.path (a batched scorer)")
    overlong = dict(config.reward_model.overlong_buffer) if name == "dapo" and not validation else None
    return MANAGERS[name](tokenizer, compute_score, config.data.reward_fn_key, strict=config.reward_model.strict,
                          timeout_s=config.reward_model.timeout_s, max_response_length=config.data.max_response_length,
                          overlong_buffer=overlong)
