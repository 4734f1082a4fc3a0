"""The rollout server an agent loop talks to: verl 0.9.1's server manager as agent loops see it,

    output: TokenOutput = await server_manager.generate(request_id=..., prompt_ids=..., sampling_params={...})

in front of one of pyrl's engines. Every trajectory is its own coroutine and submits its next turn as soon as it
has one (its tool call returned, its user answered); a request never waits for the other trajectories' tools.
On the vllm engine requests join its running batch at the next engine step (continuous batching: vLLM's own
scheduler, driven a step at a time). On the hf engine (and a tensor-parallel group's leader, whose calls its
followers must make with it) requests pending when the engine is free go to it together, one call per set of
sampling settings, and requests that arrive while it runs wait for the call after. The engine runs in a thread of
its own, so tools and the other coroutines go on while it computes.

lockstep=True holds the engine until every running trajectory is waiting on it: the lock-step rollout (each
round's turns generated together, then every tool call, then the next round), kept to measure against.

Sampling is seeded per request, from the batch's seed and the trajectory's place and turn (never from what else a
call holds or when it came), so the tokens do not depend on timing, and lockstep gives the same tokens as not, up to
numerics that depend on a call's other rows (the hf engine pads a call's rows to its longest).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import itertools
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pyrl.seeding import derive_seed
from pyrl.workers.rollout.base import RolloutEngine, SamplingSpec
from pyrl.workers.rollout.replica import TokenOutput

# the keys of a request's sampling_params a pyrl engine honours (the rest are refused, naming them)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens", "max_new_tokens",
                 "stop_token_ids", "ignore_eos", "seed", "n")
MULTIMODAL_KEYS = ("image_data", "video_data", "audio_data", "mm_processor_output", "mm_processor_kwargs")


@dataclass
class TrajectorySlot:
    """Which trajectory of the batch a coroutine runs (its seeds' coordinates) and how many requests it made."""

    index: int
    calls: int = 0


CURRENT_TRAJECTORY: contextvars.ContextVar[TrajectorySlot] = contextvars.ContextVar("pyrl_trajectory")


@dataclass
class _Request:
    prompt_ids: list[int]
    spec: SamplingSpec  # the call's settings; its max_tokens and seed are this request's
    future: asyncio.Future = field(repr=False)


@dataclass
class ServerStats:
    """Per batch: engine calls (steps, with continuous batching), requests, and the seconds the engine computed
    (busy) within the batch's."""

    calls: int = 0
    requests: int = 0
    busy_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def idle_fraction(self) -> float:
        wall = time.perf_counter() - self.started
        return max(0.0, 1.0 - self.busy_s / wall) if wall > 0 else 0.0


class RolloutServer:
    """`generate` for the agent loops of one batch (see the module docstring). base: the batch's sampling (the
    rollout config's, or validation's), which a request's sampling_params override key by key."""

    def __init__(self, engine: RolloutEngine, base: SamplingSpec, prompt_length: int, max_model_len: int,
                 lockstep: bool = False, max_batch: int | None = None):
        """max_batch: at most that many pending requests per engine call (batching engines; None: all of them)."""
        self.engine, self.base, self.lockstep = engine, dataclasses.replace(base, n=1), lockstep
        self.max_batch = max_batch
        self.prompt_length, self.max_model_len = prompt_length, max_model_len
        self.pending: list[_Request] = []
        self.active: dict[str, _Request] = {}  # continuous batching: requests in the engine's running batch
        self.continuous = hasattr(engine, "add_request") and not lockstep
        # vLLM's request ids: unique to this server (an engine serves many batches)
        self.id_prefix, self.request_ids = f"pyrl-{uuid.uuid4().hex[:12]}", itertools.count()
        self.running = 0  # trajectories not yet finished (lockstep waits for all of them to be pending)
        self.serving: asyncio.Task | None = None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="pyrl-engine")
        self.stats = ServerStats()

    # ---- what an agent loop calls ----
    async def generate(self, request_id, *, prompt_ids: list[int], sampling_params: dict, **kwargs) -> TokenOutput:
        """The next tokens after prompt_ids. sampling_params: verl's keys (SAMPLING_KEYS); max_tokens defaults to
        verl 0.9.1's min(response_length, prompt_length + response_length - len(prompt_ids))."""
        given = [key for key in MULTIMODAL_KEYS if kwargs.get(key)]
        if given:
            raise ValueError(f"rollout server: request {request_id!r} carries {given}: pyrl's agent loop is "
                             "text-only")
        prompt_ids = [int(token) for token in prompt_ids]
        spec = self._request_spec(request_id, len(prompt_ids), dict(sampling_params or {}))
        future = asyncio.get_running_loop().create_future()
        self.pending.append(_Request(prompt_ids, spec, future))
        self.stats.requests += 1
        self._serve_soon()
        tokens, logprobs = await future
        return TokenOutput(token_ids=tokens, log_probs=logprobs, stop_reason="completed")

    # ---- the batch driver's side ----
    def trajectory_started(self) -> None:
        self.running += 1

    def trajectory_finished(self) -> None:
        self.running -= 1
        self._serve_soon()  # lockstep: the others may be all that is left

    def close(self) -> None:
        """After the batch: the engine thread stopped, and requests still in vLLM's running batch (a batch that
        failed, a loop that stopped waiting) aborted there, so nothing of this batch finishes in the next."""
        self.executor.shutdown(wait=True)
        self._abort_active()

    def _abort_active(self) -> None:
        if self.continuous and self.active:
            self.engine.abort_requests(list(self.active))
        self.active = {}

    # ---- serving ----
    def _serve_soon(self) -> None:
        if self.pending and (self.serving is None or self.serving.done()):
            serve = self._serve_continuously if self.continuous else self._serve
            self.serving = asyncio.get_running_loop().create_task(serve())

    async def _serve_continuously(self) -> None:
        """Engine steps while any request runs; each step first adds the requests that came since the last."""
        loop = asyncio.get_running_loop()
        while self.pending or self.active:
            await asyncio.sleep(0)  # the coroutines the last step's results woke submit their turns first
            started = time.perf_counter()
            try:
                pending, self.pending = self.pending, []
                for request in pending:
                    request_id = f"{self.id_prefix}-{next(self.request_ids)}"
                    try:
                        self.engine.add_request(request_id, request.prompt_ids, request.spec, request.spec.seed)
                    except Exception as error:  # this request's own (vLLM refused it): the others run on
                        request.future.set_exception(error)
                        continue
                    self.active[request_id] = request
                if not self.active:
                    continue
                finished = await loop.run_in_executor(self.executor, self.engine.step)
                for request_id, tokens, logprobs in finished:
                    request = self.active.pop(request_id, None)
                    if request is not None and not request.future.done():
                        request.future.set_result((tokens, logprobs))
                if self.active and not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"rollout server: vLLM holds none of the {len(self.active)} requests it was "
                                       "given and did not finish")
            except BaseException as error:  # every running request hears it, none waits forever
                for request in [*self.active.values(), *self.pending]:
                    if not request.future.done():
                        request.future.set_exception(error)
                self.pending = []
                self._abort_active()
                if isinstance(error, asyncio.CancelledError):
                    raise
                return
            finally:
                self.stats.busy_s += time.perf_counter() - started
                self.stats.calls += 1

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while self.pending:
            await asyncio.sleep(0)  # the coroutines the last call's results woke submit their turns first
            if self.lockstep and len(self.pending) < self.running:
                return  # the next request, or a trajectory's end, serves again
            batch, self.pending = self.pending[:self.max_batch], self.pending[self.max_batch:] if self.max_batch else []
            groups: dict[SamplingSpec, list[_Request]] = {}
            for request in batch:
                groups.setdefault(dataclasses.replace(request.spec, max_tokens=1, seed=None), []).append(request)
            for spec, requests in groups.items():
                started = time.perf_counter()
                try:
                    tokens, logprobs = await loop.run_in_executor(
                        self.executor, self._call, spec, [r.prompt_ids for r in requests],
                        [r.spec.max_tokens for r in requests], [r.spec.seed for r in requests])
                    if len(tokens) != len(requests):
                        raise RuntimeError(f"rollout server: the engine answered {len(tokens)} of {len(requests)} "
                                           "requests")
                    for i, request in enumerate(requests):
                        if not request.future.done():
                            request.future.set_result((tokens[i], None if logprobs is None else logprobs[i]))
                except BaseException as error:  # every request of the call hears it, none waits forever
                    for request in requests:
                        if not request.future.done():
                            request.future.set_exception(error)
                    if isinstance(error, asyncio.CancelledError):
                        raise
                finally:
                    self.stats.busy_s += time.perf_counter() - started
                    self.stats.calls += 1

    def _call(self, spec: SamplingSpec, prompt_ids: list[list[int]], budgets: list[int], seeds: list):
        if spec.greedy or all(seed is None for seed in seeds):
            return self.engine.generate(prompt_ids, spec, max_tokens=budgets)
        # a request without a seed (an unseeded batch, or one from outside a trajectory) among seeded ones gets a
        # fresh one: every row then samples from its own stream, and a tensor-parallel group's ranks alike
        seeds = [seed if seed is not None else random.getrandbits(62) for seed in seeds]
        return self.engine.generate(prompt_ids, spec, max_tokens=budgets, seeds=seeds)

    def _request_spec(self, request_id, prompt_len: int, params: dict) -> SamplingSpec:
        unknown = sorted(set(params) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"rollout server: request {request_id!r}: sampling_params {unknown} are not honoured by "
                             f"pyrl's engines (known: {list(SAMPLING_KEYS)})")
        if float(params.get("repetition_penalty", 1.0)) != 1.0 or int(params.get("n", 1)) != 1:
            raise ValueError(f"rollout server: request {request_id!r}: repetition_penalty must be 1.0 and n 1 (one "
                             f"sample per request), got {params.get('repetition_penalty')}, {params.get('n')}")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"rollout server: request {request_id!r}: its prompt of {prompt_len} tokens leaves no "
                             f"room to generate within max_model_len={self.max_model_len}")
        budget = params.get("max_tokens", params.get("max_new_tokens"))
        if budget is None:  # verl 0.9.1's default: the response length, and no further than the prompt's room
            budget = min(self.base.max_tokens, self.prompt_length + self.base.max_tokens - prompt_len)
        seed = params.get("seed")
        slot = CURRENT_TRAJECTORY.get(None)
        if seed is None and slot is not None and self.base.seed is not None:
            seed = derive_seed(self.base.seed, "trajectory", index=slot.index, call=slot.calls)
        if slot is not None:
            slot.calls += 1
        temperature = float(params.get("temperature", self.base.temperature))
        spec = dataclasses.replace(
            self.base, temperature=temperature,
            do_sample=self.base.do_sample and temperature > 0,
            top_p=float(params.get("top_p", self.base.top_p)),
            top_k=int(params.get("top_k", self.base.top_k)),
            logprobs=bool(params.get("logprobs", self.base.logprobs)),
            ignore_eos=bool(params.get("ignore_eos", self.base.ignore_eos)),
            stop_token_ids=tuple(sorted({int(t) for t in params.get("stop_token_ids") or ()})),
            max_tokens=max(1, min(int(budget), room)), seed=None if seed is None else int(seed))
        spec.check(f"rollout server: request {request_id!r}: sampling_params")
        return spec
