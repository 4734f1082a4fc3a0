"""Reward managers: a rollout batch -> token-level scores [B, R], each response's score on its last valid
token (verl's naive / batch / dapo managers, and verl 0.9.1's gdpo / rate_limited / remote reward-loop managers).

compute_score is called with verl's keywords: compute_score(data_source=, solution_str=, ground_truth=,
extra_info=, **reward_kwargs) per sample, or compute_score(data_sources=, solution_strs=, ground_truths=,
extra_infos=, **reward_kwargs) for the batch manager; an `async def` one's calls are awaited together in the driver
(verl's reward loop gathers them: a judge behind a served reward model sees the batch at once). reward.num_workers > 1
processes score a plain function's samples in parallel (in order, the same numbers as one process); remote always
scores in such processes, rate_limited in the driver, its calls concurrent under its limits.

A scorer that raises or runs past reward.timeout_s (rate_limited: reward.timeout) scores 0 for that sample (except
pyrl.sandbox's SandboxUnavailable, which stops the run: code cannot be scored safely on this machine); the count goes
into the metrics (reward/scorer_errors, reward/scorer_timeouts) and the first failure of each kind is logged with the
sample's index. With reward.strict=true the run stops instead. What a scorer counts through pyrl.rewards.counts while it
scores (code_exec: hostile outputs) is summed over the batch into reward/<name> (reward/code_hostile_outputs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import logging
import multiprocessing
import os
import pickle
import signal
import threading
from collections import defaultdict
from typing import Callable

import numpy as np
import torch

from pyrl.config import RewardConfig
from pyrl.protocol import DataProto, response_lengths
from pyrl.rewards import counts as counts_module
from pyrl.rewards.scorers import default_compute_score
from pyrl.sandbox import SandboxUnavailable
from pyrl.usercode import load_object
from pyrl.workers.rollout.agent_loop import agent_loop_reward_extra_info, agent_loop_rm_scores

log = logging.getLogger(__name__)
COUNTED = "counted/"  # a key of the manager's counts: what scorers counted (pyrl.rewards.counts), by name


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


class KeywordsFirst(functools.partial):
    """functools.partial whose bound keywords win over the call's, as verl 0.9.1's _call_with_kwargs merges
    reward_kwargs into each call ({**call's, **reward_kwargs}); still a partial to inspect (an `async def` function
    bound so is a coroutine function) and to pickle."""

    def __call__(self, /, *args, **kwargs):
        return self.func(*self.args, *args, **{**kwargs, **self.keywords})


def load_custom_function(path: str, name: str, kwargs: dict | None = None) -> Callable:
    """reward.custom_reward_function.path / .name: a function from a Python file (or module), with reward_kwargs
    bound (a keyword the manager passes too, such as extra_info, takes reward_kwargs' value, as in verl)."""
    fn = load_object(path, "reward.custom_reward_function.path", name=name,
                     name_key="reward.custom_reward_function.name", what="function")
    return KeywordsFirst(fn, **kwargs) if kwargs else fn


def call_scorer(fn: Callable, **kwargs):
    """fn(**kwargs), run to completion when fn is a coroutine function (an `async def` reward, as verl allows)."""
    result = fn(**kwargs)
    return asyncio.run(_awaited(result)) if inspect.isawaitable(result) else result


async def _awaited(awaitable):
    return await awaitable


def attempt(fn: Callable, timeout_s: float, call: dict) -> tuple:
    """(value, None, None, counted), or (None, "errors" | "timeouts", "Type: message", counted) when fn failed or
    ran too long; counted: what the scorer counted meanwhile through pyrl.rewards.counts ({name: n})."""
    with counts_module.recording() as counted:
        try:
            with time_limit(timeout_s):
                return call_scorer(fn, **call), None, None, counted
        except Exception as e:  # noqa: BLE001 - any scorer failure is counted, not fatal (unless strict)
            return (*failure(e, timeout_s, isinstance(e, ScorerTimeout)), counted)


def failure(error: Exception, timeout_s: float, timed_out: bool) -> tuple[None, str, str]:
    """A failed scorer call's (None, "timeouts" | "errors", "Type: message"). SandboxUnavailable is raised again: the
    machine cannot score code safely, a setting to change, never a 0 score."""
    if isinstance(error, SandboxUnavailable):
        raise error
    if timed_out:
        return None, "timeouts", f"ScorerTimeout: over {timeout_s} s"
    return None, "errors", f"{type(error).__name__}: {error}"


_POOLS: dict[int, concurrent.futures.ProcessPoolExecutor] = {}


def scoring_pool(num_workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """The run's scoring processes (reward.num_workers, at most one per core), shared by the training and the
    validation managers; spawned, not forked (the driver runs Ray's threads), deaf to Ctrl-C (the driver ends
    the run)."""
    size = scoring_processes(num_workers)
    if size not in _POOLS:
        _POOLS[size] = concurrent.futures.ProcessPoolExecutor(size, mp_context=multiprocessing.get_context("spawn"),
                                                              initializer=signal.signal,
                                                              initargs=(signal.SIGINT, signal.SIG_IGN))
    return _POOLS[size]


def scoring_processes(num_workers: int) -> int:
    """How many processes score a batch: reward.num_workers, at most one per core; 1 (the driver) for <= 1."""
    return max(1, min(num_workers, os.cpu_count() or 1))


def close_scoring_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].shutdown(cancel_futures=True)


def attempt_chunk(scorer: bytes, timeout_s: float, calls: list[dict]) -> list[tuple]:
    """In a worker process: attempt() on each call with the pickled scorer."""
    fn = pickle.loads(scorer)
    return [attempt(fn, timeout_s, call) for call in calls]


def pool_outcomes(fn: Callable, timeout_s: float, calls: list[dict], num_workers: int) -> list[tuple]:
    """attempt(fn, timeout_s, call) for every call, in order, spread over the scoring pool's processes; a scorer
    that kills its process makes its chunk's calls errors."""
    # lazy: Ray loads only for a scoring pool
    import ray.cloudpickle  # a custom scorer's module cannot be imported by name in the workers: sent by value

    pool = scoring_pool(num_workers)
    scorer = ray.cloudpickle.dumps(fn)
    size = -(-len(calls) // pool._max_workers)
    chunks = [calls[start:start + size] for start in range(0, len(calls), size)]
    futures = [pool.submit(attempt_chunk, scorer, timeout_s, chunk) for chunk in chunks]
    outcomes = []
    for chunk, future in zip(chunks, futures):
        try:
            outcomes += future.result()
        except concurrent.futures.process.BrokenProcessPool as e:  # a scorer killed its process: errors
            close_scoring_pools()
            outcomes += [(None, "errors", f"BrokenProcessPool: {e}", {})] * len(chunk)
    return outcomes


def gather_outcomes(fn: Callable, timeout_s: float, calls: list[dict]) -> list[tuple]:
    """attempt(fn, timeout_s, call) for every call of an `async def` scorer, awaited together, as verl 0.9.1's
    reward loop gathers a batch's calls (a judge behind a served reward model sees them at once, for its engine to
    batch); each within timeout_s. What the scorer counts (pyrl.rewards.counts) is the batch's, given with the first
    outcome (concurrent calls' counts cannot be told apart)."""
    async def one(call: dict) -> tuple:
        try:
            if timeout_s and timeout_s > 0:
                return await asyncio.wait_for(fn(**call), timeout_s), None, None, {}
            return await fn(**call), None, None, {}
        except Exception as e:  # noqa: BLE001 - any scorer failure is counted, not fatal (unless strict)
            return (*failure(e, timeout_s, isinstance(e, asyncio.TimeoutError)), {})

    async def every() -> list[tuple]:
        return list(await asyncio.gather(*(one(call) for call in calls)))

    with counts_module.recording() as counted:
        outcomes = asyncio.run(every())
    if outcomes:
        outcomes[0] = (*outcomes[0][:3], counted)
    return outcomes


class RewardManager:
    """naive: one compute_score call per sample. Subclasses change how scores are computed or shaped."""

    def __init__(self, tokenizer, compute_score: Callable | None = None, reward_fn_key: str = "data_source",
                 strict: bool = False, timeout_s: float = 10.0, max_response_length: int | None = None,
                 overlong_buffer: dict | None = None, num_workers: int = 1):
        """overlong_buffer (dapo): verl's overlong_buffer_cfg {enable, len, penalty_factor}, with
        max_response_length its max_resp_len."""
        self.tokenizer = tokenizer
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key
        self.strict, self.timeout_s = strict, timeout_s
        self.max_response_length = max_response_length
        self.overlong_buffer = overlong_buffer or {}
        self.num_workers = num_workers
        self.failures_logged: set[str] = set()

    def bind_reward_model(self, router_address: str, reward_model_tokenizer) -> None:
        """A served reward model runs (pyrl.workers.reward_server) and the custom reward function scores: it is
        called with reward_router_address ("host:port") and reward_model_tokenizer as well (as verl 0.9.1's
        managers call it), to ask the model itself."""
        self.compute_score = functools.partial(self.compute_score, reward_router_address=router_address,
                                               reward_model_tokenizer=reward_model_tokenizer)

    # ---- per-sample inputs ----
    def decoded(self, data: DataProto):
        """(prompt strings, response strings, valid response lengths)."""
        prompt_mask = data.batch["attention_mask"][:, :data.batch["prompts"].shape[1]].bool()
        lengths = response_lengths(data).tolist()
        prompts = [self.tokenizer.decode(row[m], skip_special_tokens=False)
                   for row, m in zip(data.batch["prompts"], prompt_mask)]
        responses = [self.tokenizer.decode(row[:n], skip_special_tokens=True)
                     for row, n in zip(data.batch["responses"], lengths)]
        return prompts, responses, lengths

    def row_fields(self, data: DataProto, i: int):
        """(data source, ground truth, the row's own extra_info) of sample i."""
        nt = data.non_tensor_batch
        if self.reward_fn_key not in nt:
            raise KeyError(f"reward: the batch has no {self.reward_fn_key!r} column (data.reward_fn_key)")
        reward_model = nt["reward_model"][i] if "reward_model" in nt else {}
        extra = nt["extra_info"][i] if "extra_info" in nt else {}  # verl: non_tensor_batch.get("extra_info", {})
        return nt[self.reward_fn_key][i], reward_model.get("ground_truth"), extra

    def turn_fields(self, data: DataProto, i: int) -> dict:
        """verl 0.9.1's tool_extra_fields of sample i: an agent-loop rollout's extra_fields whole (the tools' and the
        interaction's rewards, tool_rewards and turn_scores, and whatever a user's loop put there). Every verl 0.9.1
        rollout runs in an agent loop, so a single-turn sample has them too: no turn scores, no tool rewards. Both
        with the sample's raw prompt, as verl's loops add it."""
        nt = data.non_tensor_batch
        fields = nt.get("tool_extra_fields")
        fields = {"turn_scores": [], "tool_rewards": []} if fields is None else dict(fields[i] or {})
        if "raw_prompt" in nt:
            fields.setdefault("raw_prompt", nt["raw_prompt"][i])
        return fields

    def sample_fields(self, data: DataProto, i: int):
        """naive and remote (verl 0.9.1's): the row's extra_info with the turn fields (turn_fields), the turn count
        (2 for a single-turn rollout, as verl's single-turn loop counts it) and rollout_reward_scores (verl's
        "reward_scores" column, which nothing in 0.9.1 writes: {}). A copy: the n samples of a prompt share one
        extra_info dict, which verl writes into."""
        nt = data.non_tensor_batch
        source, truth, extra = self.row_fields(data, i)
        extra = {**(extra or {}), **self.turn_fields(data, i),
                 "num_turns": int(nt["__num_turns__"][i]) if "__num_turns__" in nt else 2,
                 "rollout_reward_scores": nt["reward_scores"][i] if "reward_scores" in nt else {}}
        return source, truth, extra

    def settle(self, counts, index: int, outcome: tuple, failed=0.0):
        """An attempt's value; a failure gives `failed` (a zero score), counted and logged once per kind, or
        stops the run when strict."""
        value, kind, error, counted = outcome
        for name, n in counted.items():  # the scorer's own counts (pyrl.rewards.counts): metrics reward/<name>
            counts[COUNTED + name] += n
        if kind is None:
            return value
        if self.strict:
            raise RuntimeError(f"reward: the scorer {'timed out' if kind == 'timeouts' else 'raised'} on sample "
                               f"{index} (reward.strict=true): {error}")
        counts[kind] += 1
        if kind not in self.failures_logged:
            self.failures_logged.add(kind)
            log.warning("reward: scorer %s on sample %d (%s); it scores 0, and later failures are only counted in "
                        "reward/scorer_%s", "timed out" if kind == "timeouts" else "raised", index, error, kind)
        return failed

    def run(self, calls: list[dict], counts, failed=0.0) -> list:
        """compute_score(**call) for every call, in order: here, or spread over the worker processes; an `async
        def` one's calls awaited together here."""
        if is_async_scorer(self.compute_score):
            outcomes = gather_outcomes(self.compute_score, self.timeout_s, calls)
        elif self.num_workers <= 1 or len(calls) < 2:
            outcomes = [attempt(self.compute_score, self.timeout_s, call) for call in calls]
        else:
            outcomes = pool_outcomes(self.compute_score, self.timeout_s, calls, self.num_workers)
        return [self.settle(counts, i, outcome, failed) for i, outcome in enumerate(outcomes)]

    def scores(self, data: DataProto, responses, counts) -> list:
        calls = []
        for i, response in enumerate(responses):
            source, truth, extra = self.sample_fields(data, i)
            calls.append({"data_source": source, "solution_str": response, "ground_truth": truth, "extra_info": extra})
        return self.run(calls, counts)

    # ---- the call ----
    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict, dict]:
        """-> (token_level_scores [B, R], reward_extra_info {name: list}, metrics)."""
        loop_scores = data.non_tensor_batch.get("agent_loop_reward_score")
        scored_by_loops = loop_scores is not None and any(score is not None for score in loop_scores)
        if "rm_scores" in data.batch:  # a reward model scored the batch already
            if scored_by_loops:
                raise ValueError("reward: the agent loops scored their trajectories (AgentLoopOutput.reward_score) "
                                 "and a reward model scored them too (reward.reward_model.enable): use one")
            return data.batch["rm_scores"], {}, {}
        if not scored_by_loops:
            return self.function_scores(data)
        # verl 0.9.1's rm_scores from the loops' reward_score; the reward function scores only the rows whose loop
        # left it None (its _compute_score)
        scores = agent_loop_rm_scores(loop_scores, response_lengths(data).tolist(), data.batch["responses"].shape[1])
        scored = [i for i, score in enumerate(loop_scores) if score is not None]
        rest = [i for i, score in enumerate(loop_scores) if score is None]
        extra_info: dict[str, list] = {}
        placed(extra_info, scored, agent_loop_reward_extra_info(data.non_tensor_batch["tool_extra_fields"][scored]),
               len(data))
        if not rest:
            return scores, extra_info, {}
        rest_scores, rest_info, metrics = self.function_scores(data.select_idxs(rest))
        scores[rest] = rest_scores
        placed(extra_info, rest, rest_info, len(data))
        return scores, extra_info, metrics

    def function_scores(self, data: DataProto) -> tuple[torch.Tensor, dict, dict]:
        """The reward function's scores of every row (and the overlong penalty), on each response's last token."""
        _, responses, lengths = self.decoded(data)
        counts = defaultdict(int)
        raw = self.scores(data, responses, counts)
        for i, score in enumerate(raw):
            if isinstance(score, dict) and "score" not in score:
                raise ValueError(f"reward: compute_score returned a dict without 'score' for sample {i}: "
                                 f"{score!r:.200}")
        values = np.asarray([score["score"] if isinstance(score, dict) else score for score in raw], dtype=np.float64)
        extra_info = self.extra_info(raw, values)
        if self.overlong_buffer.get("enable"):
            penalty = self.overlong_penalty(np.asarray(lengths))
            values = values + penalty
            if self.overlong_buffer.get("log"):  # verl's dapo manager's extra info
                extra_info["overlong_reward"] = penalty.tolist()
                extra_info["overlong"] = (penalty < 0).tolist()
        scores = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        last = torch.as_tensor(lengths) - 1
        has = last >= 0
        scores[torch.nonzero(has).squeeze(-1), last[has]] = torch.as_tensor(values, dtype=torch.float32)[has]
        metrics = {"reward/scorer_errors": counts["errors"], "reward/scorer_timeouts": counts["timeouts"]}
        metrics.update({f"reward/{key[len(COUNTED):]}": n for key, n in counts.items() if key.startswith(COUNTED)})
        return scores, dict(extra_info), metrics

    def extra_info(self, raw: list, values: np.ndarray) -> dict[str, list]:
        """reward_extra_info: the dict scores' fields (extra_fields), or each plain-number score as "acc"."""
        extra_info = extra_fields(raw)
        if not extra_info:  # plain-number scores: verl 0.9.1's managers report each as "acc" (validation's core metric)
            extra_info["acc"] = values.tolist()
        return extra_info

    def overlong_penalty(self, lengths: np.ndarray) -> np.ndarray:
        """DAPO's soft overlong punishment: 0 up to max_len - buffer, then linearly down to -penalty_factor."""
        buffer_len = int(self.overlong_buffer.get("len", 0))
        if buffer_len <= 0 or not self.max_response_length:
            raise ValueError("reward.reward_kwargs.overlong_buffer_cfg: enable needs len > 0 and max_resp_len")
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


def placed(extra_info: dict[str, list], rows: list[int], values: dict[str, list], size: int) -> None:
    """values {name: one value per row of `rows`} into extra_info {name: `size` values}, None at the other rows."""
    for name, column in values.items():
        extra_info.setdefault(name, [None] * size)
        for i, value in zip(rows, column):
            extra_info[name][i] = value


class DAPORewardManager(RewardManager):
    """dapo (verl 0.9.1's DAPORewardManager): naive scoring and, with reward.reward_kwargs.overlong_buffer_cfg, the
    overlong penalty; extra_info is the row's own (verl's dapo adds no turn fields)."""

    def sample_fields(self, data: DataProto, i: int):
        return self.row_fields(data, i)


class BatchRewardManager(RewardManager):
    """One compute_score call for the whole batch: compute_score(data_sources=, solution_strs=, ground_truths=,
    extra_infos=) -> list of scores."""

    def scores(self, data: DataProto, responses, counts) -> list:
        fields = [self.sample_fields(data, i) for i in range(len(responses))]
        sources, truths, extras = (list(x) for x in zip(*fields)) if fields else ([], [], [])
        outcome = attempt(self.compute_score, self.timeout_s, {"data_sources": sources, "solution_strs": responses,
                                                               "ground_truths": truths, "extra_infos": extras})
        result = self.settle(counts, 0, outcome, failed=[0.0] * len(responses))
        if not isinstance(result, (list, tuple, np.ndarray)) or len(result) != len(responses):
            raise ValueError(f"reward: the batch compute_score returned {type(result).__name__}, expected a list of "
                             f"{len(responses)} scores")
        return list(result)


class GDPORewardManager(RewardManager):
    """gdpo (verl 0.9.1's GDPORewardManager): naive scoring, but extra_info is the row's own plus experiment_name
    (trainer.experiment_name), without num_turns or the tools' fields (verl's gdpo merges neither __num_turns__
    nor tool_extra_fields). A dict score's every field goes to reward_extra_info, where the gdpo estimator reads its
    components (algorithm.gdpo_reward_keys)."""

    def __init__(self, *args, experiment_name: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.experiment_name = experiment_name

    def sample_fields(self, data: DataProto, i: int):
        source, truth, extra = self.row_fields(data, i)
        # a copy: verl writes into the row's dict, which the n samples of a prompt share
        return source, truth, {**(extra or {}), "experiment_name": self.experiment_name}


def is_async_scorer(fn: Callable) -> bool:
    """An `async def` compute_score (a functools.partial of one too), as verl's inspect.iscoroutinefunction sees
    it, or an object whose __call__ is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class RemoteRewardManager(RewardManager):
    """remote (verl 0.9.1's RemoteRewardManager): naive scoring with naive's extra_info, every call in a scoring
    process, never in the driver: reward.num_workers processes (at least one, at most one per core; verl: that many
    Ray actors per reward-loop worker, round-robin). An `async def` compute_score is refused at load, as verl
    asserts; a scorer that raises or runs past reward.timeout_s scores 0, counted, as naive's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if is_async_scorer(self.compute_score):
            raise ValueError("reward.reward_manager.name=remote: compute_score is an `async def` function, which the "
                             "remote manager's scoring processes cannot run (verl 0.9.1: 'Async reward score is not "
                             "supported in remote reward manager'); use naive or rate_limited for an async scorer")

    def run(self, calls: list[dict], counts, failed=0.0) -> list:
        outcomes = pool_outcomes(self.compute_score, self.timeout_s, calls, self.num_workers) if calls else []
        return [self.settle(counts, i, outcome, failed) for i, outcome in enumerate(outcomes)]


class AsyncTokenBucket:
    """verl 0.9.1's AsyncTokenBucket (experimental/reward_loop/reward_manager/limited.py): rate_limit tokens a
    second flow into a bucket of max_tokens (default rate_limit), full at the start. acquire(n) refills by the
    time elapsed since the last update (capped at max_tokens) and takes n, or sleeps (n - tokens) / rate_limit and
    tries again. A request larger than the bucket takes its tokens at once, leaving the balance negative, and
    sleeps for its shortfall (later requests wait for the debt to refill). The clock is the running loop's time();
    clock / sleep replace it and asyncio.sleep (tests)."""

    def __init__(self, rate_limit: float, max_tokens: float | None = None, *, clock: Callable[[], float] | None = None,
                 sleep: Callable | None = None):
        self.rate_limit = rate_limit
        self.max_tokens = max_tokens or rate_limit
        self.tokens = self.max_tokens
        self.last_update = None
        self.lock = asyncio.Lock()
        self.clock = clock or (lambda: asyncio.get_running_loop().time())
        self.sleep = sleep or asyncio.sleep

    def refill(self) -> float:
        now = self.clock()
        if self.last_update is None:
            self.last_update = now
        self.tokens = min(self.max_tokens, self.tokens + (now - self.last_update) * self.rate_limit)
        return now

    async def acquire(self, num_tokens: float = 1.0) -> None:
        if num_tokens > self.max_tokens:  # more than the bucket holds: go into debt, wait for the shortfall
            async with self.lock:
                self.last_update = self.refill()
                shortfall = num_tokens - self.tokens
                wait_time = shortfall / self.rate_limit if shortfall > 0 else 0.0
                self.tokens -= num_tokens
            if wait_time > 0:
                await self.sleep(wait_time)
            return
        while True:
            async with self.lock:
                self.last_update = self.refill()
                if self.tokens >= num_tokens:
                    self.tokens -= num_tokens
                    return
                wait_time = (num_tokens - self.tokens) / self.rate_limit
            if wait_time > 0:
                await self.sleep(wait_time)


class RateLimits:
    """One set of verl's rate_limited limiters: at most max_concurrent calls at once (a semaphore), max_rpm
    requests and max_tpm tokens a minute (token buckets of a second's worth, refilled continuously; None: no
    limit), each call counting estimated_tokens_per_request tokens."""

    def __init__(self, max_concurrent: int = 1, max_rpm: float | None = None, max_tpm: float | None = None,
                 estimated_tokens_per_request: float = 2000):
        self.semaphore = asyncio.Semaphore(max_concurrent)
        self.rpm = AsyncTokenBucket(max_rpm / 60.0, max_rpm / 60.0) if max_rpm is not None else None
        self.tpm = AsyncTokenBucket(max_tpm / 60.0, max_tpm / 60.0) if max_tpm is not None else None
        self.estimated_tokens_per_request = estimated_tokens_per_request


# the process's limiters by their settings: the training and the validation managers share one set (the same
# quota), as verl's class-level limiters are shared by every RateLimitedRewardManager of a process
_RATE_LIMITS: dict[tuple, RateLimits] = {}
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def shared_rate_limits(max_concurrent: int, max_rpm, max_tpm, estimated_tokens_per_request) -> RateLimits:
    key = (max_concurrent, max_rpm, max_tpm, estimated_tokens_per_request)
    with _LOOP_LOCK:
        if key not in _RATE_LIMITS:
            _RATE_LIMITS[key] = RateLimits(*key)
            log.info("reward: rate_limited: at most %d calls at once, %s requests/min, %s tokens/min (%s a call)",
                     max_concurrent, "unlimited" if max_rpm is None else max_rpm,
                     "unlimited" if max_tpm is None else max_tpm, estimated_tokens_per_request)
        return _RATE_LIMITS[key]


def limiter_loop() -> asyncio.AbstractEventLoop:
    """The event loop every rate_limited call runs on (a daemon thread's): the limiters' semaphore and buckets
    live across batches, and the manager may be called from any thread (one-step-off collects in its own)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="pyrl-rate-limited", daemon=True).start()
        return _LOOP


def in_thread(fn: Callable, call: dict) -> asyncio.Future:
    """call_scorer(fn, **call) in a daemon thread of its own, as a future of the running loop (verl runs a sync
    scorer in the loop's default executor; a daemon thread, because a scorer past its timeout cannot be stopped
    and must not hold the process at exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def resolve(result, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def work():
        try:
            result, error = call_scorer(fn, **call), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__}: {e}")
        loop.call_soon_threadsafe(resolve, result, error)

    threading.Thread(target=work, name="pyrl-reward-call", daemon=True).start()
    return future


class Failed(dict):
    """A rate_limited call that timed out or raised: {"score": 0.0} and verl's reward_extra_info for it."""


class RateLimitedRewardManager(RewardManager):
    """rate_limited (verl 0.9.1's RateLimitedRewardManager): each call takes a token from the requests-per-minute
    bucket, then estimated_tokens_per_request from the tokens-per-minute one, then a place among max_concurrent,
    and runs under `timeout` seconds (None: no limit); the batch's calls run concurrently on one event loop, an
    `async def` compute_score awaited there, a sync one in a thread. A call past its timeout scores 0.0 with
    {"timeout": True, "acc": 0.0}, one that raises (a dict without "score" too) 0.0 with {"error": str(e),
    "acc": 0.0}: verl's values; both are counted in reward/scorer_timeouts / scorer_errors, and reward.strict
    stops the run instead. extra_info: the row's, plus the turn fields (turn_fields), without num_turns (verl's
    rate_limited merges tool_extra_fields only)."""

    def __init__(self, *args, max_concurrent: int = 1, max_rpm: float | None = None, max_tpm: float | None = None,
                 estimated_tokens_per_request: float = 2000, timeout: float | None = 300.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = shared_rate_limits(max_concurrent, max_rpm, max_tpm, estimated_tokens_per_request)
        self.timeout = timeout
        self.is_async = is_async_scorer(self.compute_score)

    def sample_fields(self, data: DataProto, i: int):
        source, truth, extra = self.row_fields(data, i)
        return source, truth, {**(extra or {}), **self.turn_fields(data, i)}

    async def limited_call(self, call: dict) -> tuple:
        """verl's run_single for one call: (result, None, None, None), or (None, "timeouts" | "errors", what
        happened, verl's reward_extra_info for it)."""
        limits = self.limits
        if limits.rpm is not None:
            await limits.rpm.acquire(1.0)
        if limits.tpm is not None:
            await limits.tpm.acquire(limits.estimated_tokens_per_request)
        async with limits.semaphore:
            try:
                pending = self.compute_score(**call) if self.is_async else in_thread(self.compute_score, call)
                result = await asyncio.wait_for(pending, timeout=self.timeout)
                if isinstance(result, dict):
                    result["score"]  # noqa: B018 - verl reads it inside its try: a dict without it is an error
                return result, None, None, None
            except asyncio.TimeoutError:
                return None, "timeouts", f"TimeoutError: over {self.timeout} s", {"timeout": True}
            except SandboxUnavailable:
                raise
            except Exception as e:  # noqa: BLE001 - verl scores any failure 0
                return None, "errors", f"{type(e).__name__}: {e}", {"error": str(e)}

    async def limited_calls(self, calls: list[dict]) -> list[tuple]:
        return await asyncio.gather(*(self.limited_call(call) for call in calls))

    def scores(self, data: DataProto, responses, counts) -> list:
        calls = []
        for i, response in enumerate(responses):
            source, truth, extra = self.sample_fields(data, i)
            calls.append({"data_source": source, "solution_str": response, "ground_truth": truth, "extra_info": extra})
        with counts_module.recording() as counted:  # one recording: the calls overlap
            outcomes = asyncio.run_coroutine_threadsafe(self.limited_calls(calls), limiter_loop()).result()
        for name, n in counted.items():
            counts[COUNTED + name] += n
        raw = []
        for i, (value, kind, error, info) in enumerate(outcomes):
            failed = Failed(score=0.0, **info, acc=0.0) if kind else None
            raw.append(self.settle(counts, i, (value, kind, error, {}), failed=failed))
        return raw

    def extra_info(self, raw: list, values: np.ndarray) -> dict[str, list]:
        """verl's reward_extra_info of each call (a dict score's fields, a number's {"acc": score}, a failure's
        {"timeout" | "error", "acc"}), over the batch: a field a sample lacks is False where the field is
        boolean elsewhere, 0.0 where numeric, None otherwise (verl 0.9.1 fails on a batch whose samples' fields
        differ, or drops the fields its first sample lacks)."""
        infos = [{k: v for k, v in r.items() if k != "score"} if isinstance(r, Failed) else r if isinstance(r, dict)
                 else {"acc": r} for r in raw]
        fields = {}
        for key in dict.fromkeys(key for info in infos for key in info):
            present = [info[key] for info in infos if key in info]
            fill = False if all(isinstance(v, (bool, np.bool_)) for v in present) else \
                0.0 if all(is_number(v) for v in present) else None
            fields[key] = [info.get(key, fill) for info in infos]
        return fields


MANAGERS = {"naive": RewardManager, "dapo": DAPORewardManager, "batch": BatchRewardManager,
            "gdpo": GDPORewardManager, "rate_limited": RateLimitedRewardManager, "remote": RemoteRewardManager}


OVERLONG_BUFFER_KEYS = ("enable", "len", "penalty_factor", "log")  # verl 0.9.1's overlong_buffer_cfg


def load_reward_manager(config, tokenizer) -> RewardManager:
    """The manager reward.reward_manager.name names, with reward.custom_reward_function if one is set (see
    pyrl.config.migrate_legacy_reward for the legacy spellings). Training and validation score alike, the overlong
    penalty included (verl 0.9.1 scores validation in the same reward loop)."""
    reward = config.reward
    name = reward.reward_manager.name
    if name not in MANAGERS:
        raise ValueError(f"reward.reward_manager.name: unknown {name!r}, expected one of {sorted(MANAGERS)}")
    custom = reward.custom_reward_function
    compute_score = None
    if custom.path:
        compute_score = load_custom_function(custom.path, custom.name or "compute_score", dict(custom.reward_kwargs))
    elif name == "batch":
        raise ValueError("reward.reward_manager.name=batch needs reward.custom_reward_function.path (a batched scorer)")
    else:  # verl binds reward.sandbox_fusion to the default scorer (code-execution sources); its max_concurrent
        # is over all scoring processes, each holding its own share
        sandbox = reward.sandbox_fusion
        compute_score = functools.partial(
            default_compute_score, sandbox_fusion_url=sandbox.url, memory_limit_mb=sandbox.memory_limit_mb,
            allow_unisolated=reward.sandbox.allow_unisolated,
            max_concurrent=max(1, sandbox.max_concurrent // scoring_processes(reward.num_workers)))
    unknown = sorted(set(reward.reward_kwargs) - {"overlong_buffer_cfg", "max_resp_len"})
    if unknown:
        raise ValueError(f"reward.reward_kwargs.{unknown[0]}: unknown key; the managers read overlong_buffer_cfg and "
                         "max_resp_len (dapo); a custom function's keywords go in "
                         "reward.custom_reward_function.reward_kwargs")
    overlong = dict(reward.reward_kwargs.get("overlong_buffer_cfg") or {})
    unknown = sorted(set(overlong) - set(OVERLONG_BUFFER_KEYS))
    if unknown:
        raise ValueError(f"reward.reward_kwargs.overlong_buffer_cfg.{unknown[0]}: unknown key; verl's dapo manager "
                         f"reads {', '.join(OVERLONG_BUFFER_KEYS)}")
    if overlong.get("enable") and name != "dapo":
        raise ValueError(f"reward.reward_kwargs.overlong_buffer_cfg.enable=true is applied by the dapo manager only: "
                         f"set reward.reward_manager.name=dapo (it is {name!r})")
    max_resp_len = reward.reward_kwargs.get("max_resp_len")
    if overlong.get("enable") and max_resp_len is None:
        raise ValueError("reward.reward_kwargs.overlong_buffer_cfg.enable needs reward.reward_kwargs.max_resp_len "
                         "(verl's dapo manager does too)")
    if overlong.get("enable") and not 0 < (overlong.get("len") or 0) <= max_resp_len:
        raise ValueError(f"reward.reward_kwargs.overlong_buffer_cfg.len={overlong.get('len')!r}: expected more than 0 "
                         f"and at most max_resp_len={max_resp_len} (verl's dapo manager asserts both)")
    options = {}
    if name == "gdpo":
        options["experiment_name"] = config.trainer.experiment_name
    limits = rate_limit_settings(reward, name)
    if name == "rate_limited":
        options.update(limits)
    return MANAGERS[name](tokenizer, compute_score, config.data.reward_fn_key, strict=reward.strict,
                          timeout_s=reward.timeout_s, max_response_length=max_resp_len, overlong_buffer=overlong,
                          num_workers=reward.num_workers, **options)


RATE_LIMIT_KEYS = ("max_concurrent", "max_rpm", "max_tpm", "estimated_tokens_per_request", "timeout")


def rate_limit_settings(reward, name: str) -> dict:
    """reward.max_concurrent / max_rpm / max_tpm / estimated_tokens_per_request / timeout, where verl 0.9.1's
    rate_limited manager reads them (config.reward.get(...); its yaml does not list them, its command lines add them
    with +reward.max_rpm=...). Another manager given one, or rate_limited given pyrl's reward.timeout_s, stops the
    run (verl ignores them)."""
    defaults = RewardConfig()
    settings = {key: getattr(reward, key) for key in RATE_LIMIT_KEYS}
    if name != "rate_limited":
        for key, value in settings.items():
            if value != getattr(defaults, key):
                raise ValueError(f"reward.{key}={value!r} is read by the rate_limited manager only: set "
                                 f"reward.reward_manager.name=rate_limited (it is {name!r})")
        return settings
    if reward.timeout_s != defaults.timeout_s:
        raise ValueError(f"reward.timeout_s={reward.timeout_s!r} is not read by the rate_limited manager: its time "
                         "limit per call is verl's reward.timeout")
    problems = [f"reward.max_concurrent={settings['max_concurrent']!r}: expected at least 1"
                if settings["max_concurrent"] < 1 else None,
                *(f"reward.{key}={settings[key]!r}: expected a positive number or null (no limit)"
                  for key in ("max_rpm", "max_tpm") if settings[key] is not None and settings[key] <= 0),
                f"reward.estimated_tokens_per_request={settings['estimated_tokens_per_request']!r}: expected 0 or more"
                if settings["estimated_tokens_per_request"] < 0 else None,
                f"reward.timeout={settings['timeout']!r}: expected a positive number of seconds or null (no limit)"
                if settings["timeout"] is not None and settings["timeout"] <= 0 else None]
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(f"reward.reward_manager.name=rate_limited: {problems[0]}")
    return settings
