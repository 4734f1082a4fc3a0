"""The rollout server agent loops talk to (pyrl/workers/rollout/server.py) with engines that answer by rule: requests
are served as they come (a turn never waits for another trajectory's tool), lock-step waits for every running
trajectory, continuous batching adds requests between engine steps, errors reach every waiting request, and bad
sampling_params are refused naming the key. Then the hf engine's per-row sampling: a row's tokens depend on its
seed alone, and are drawn from the softmax they should be."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from pyrl.workers.rollout.base import SamplingSpec
from pyrl.workers.rollout.server import CURRENT_TRAJECTORY, RolloutServer, TrajectorySlot


class _EchoEngine:
    """Answers each prompt with [its last token + 1] * budget; records each call's prompts and seeds."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def generate(self, prompt_ids, spec, max_tokens=None, seeds=None):
        self.calls.append(([list(p) for p in prompt_ids], list(max_tokens or []), seeds))
        if self.fail:
            raise RuntimeError("engine down")
        time.sleep(0.01)
        return [[p[-1] + 1] * budget for p, budget in zip(prompt_ids, max_tokens)], None


class _SteppedEngine(_EchoEngine):
    """Continuous batching by rule: each step adds one token to every running request; a request finishes at its
    budget. Records what was running at each step."""

    def __init__(self, step_s: float = 0.0):
        super().__init__()
        self.running, self.steps, self.aborted, self.step_s = {}, [], [], step_s

    def add_request(self, request_id, prompt_ids, spec, seed):
        self.running[request_id] = (list(prompt_ids), spec.max_tokens, [])

    def has_unfinished_requests(self):
        return bool(self.running)

    def abort_requests(self, request_ids):
        self.aborted += list(request_ids)
        for request_id in request_ids:
            del self.running[request_id]

    def step(self):
        time.sleep(self.step_s)
        self.steps.append(sorted(prompt[0] for prompt, _, _ in self.running.values()))
        finished = []
        for request_id, (prompt, budget, tokens) in list(self.running.items()):
            tokens.append(prompt[-1] + 1)
            if len(tokens) == budget:
                finished.append((request_id, tokens, None))
                del self.running[request_id]
        return finished


def _serve(engine, trajectories, lockstep=False, seed=None, max_batch=None):
    """Runs `trajectories` (async functions of (server, index)) as the batch driver does; returns the server."""
    server = RolloutServer(engine, SamplingSpec(max_tokens=8, do_sample=seed is not None, seed=seed), 16, 64,
                           lockstep, max_batch=max_batch)

    async def run():
        async def one(i, fn):
            CURRENT_TRAJECTORY.set(TrajectorySlot(i))
            server.trajectory_started()
            try:
                return await fn(server, i)
            finally:
                server.trajectory_finished()

        return await asyncio.gather(*(one(i, fn) for i, fn in enumerate(trajectories)))

    try:
        return server, asyncio.run(run())
    finally:
        server.close()


def _tool_agent(tool_seconds: list[float]):
    """A trajectory: generate 2 tokens, wait for a 'tool' (its seconds), again, then a last turn."""
    async def run(server, i):
        prompt, times = [100 * (i + 1)], []
        for seconds in tool_seconds + [None]:
            out = await server.generate(f"r{i}", prompt_ids=prompt, sampling_params={"max_tokens": 2})
            times.append(time.perf_counter())
            prompt = prompt + out.token_ids
            if seconds is not None:
                await asyncio.sleep(seconds)
        return prompt, times

    return run


def test_a_turn_goes_to_the_engine_as_soon_as_its_tool_returns():
    """Trajectory 0's tools take 0.05 s, trajectory 1's 0.6 s: per-trajectory, 0 finishes all its turns while 1
    waits on its first tool; lock-step, 0's second turn waits for 1's tool. Both give the same tokens."""
    fast, slow = _tool_agent([0.05, 0.05]), _tool_agent([0.6, 0.05])
    engine = _EchoEngine()
    _, results = _serve(engine, [fast, slow])
    (fast_tokens, fast_times), (slow_tokens, slow_times) = results
    assert fast_times[-1] < slow_times[1]  # the fast one was done before the slow one's second turn
    lock_engine = _EchoEngine()
    _, lock_results = _serve(lock_engine, [fast, slow], lockstep=True)
    assert [r[0] for r in lock_results] == [fast_tokens, slow_tokens] == [[100, 101, 101, 102, 102, 103, 103],
                                                                          [200, 201, 201, 202, 202, 203, 203]]
    assert lock_results[0][1][1] > lock_results[1][1][0] + 0.55  # lock-step: the fast one waited for the slow tool
    assert [len(prompts) for prompts, _, _ in lock_engine.calls] == [2, 2, 2]  # one call per round, both rows


def test_lockstep_serves_the_rest_when_a_trajectory_ends():
    async def short(server, i):
        return (await server.generate("s", prompt_ids=[1], sampling_params={"max_tokens": 1})).token_ids

    engine = _EchoEngine()
    _, results = _serve(engine, [short, _tool_agent([0.01])], lockstep=True)
    assert results[0] == [2] and results[1][0] == [200, 201, 201, 202, 202]
    assert [len(prompts) for prompts, _, _ in engine.calls] == [2, 1]


def test_a_batching_engine_takes_at_most_max_batch_requests_per_call():
    """A served reward model's hf engine (max_batch: its rollout.max_num_seqs): an async judge's five calls, pending
    at once, go in calls of 2, 2 and 1, each answered as its own."""
    async def one_turn(server, i):
        return (await server.generate(f"r{i}", prompt_ids=[10 * i], sampling_params={"max_tokens": 1})).token_ids

    engine = _EchoEngine()
    _, results = _serve(engine, [one_turn] * 5, max_batch=2)
    assert results == [[10 * i + 1] for i in range(5)]
    assert [prompts for prompts, _, _ in engine.calls] == [[[0], [10]], [[20], [30]], [[40]]]


def test_continuous_batching_adds_requests_between_steps():
    engine = _SteppedEngine()
    _, results = _serve(engine, [_tool_agent([0.0]), _tool_agent([0.3])])
    assert [r[0] for r in results] == [[100, 101, 101, 102, 102], [200, 201, 201, 202, 202]]
    assert engine.steps[0] == [100, 200]  # both first turns in the first step
    assert [100] in engine.steps and engine.steps[-1] == [200]  # 0's later turns ran while 1's tool was out
    assert not engine.calls  # never a whole-batch call


def test_requests_a_batch_leaves_in_vllms_running_batch_are_aborted():
    """A loop that stops waiting for its request (a timeout of its own) leaves it running in the engine: the batch's
    end aborts it there, so it cannot finish inside the next batch; request ids never repeat across batches."""
    async def impatient(server, i):
        try:
            await asyncio.wait_for(server.generate("slow", prompt_ids=[7], sampling_params={"max_tokens": 10_000}),
                                   0.05)
        except asyncio.TimeoutError:
            return "gave up"

    engine = _SteppedEngine(step_s=0.01)  # its 63 tokens take 0.63 s
    server, results = _serve(engine, [impatient])
    assert results == ["gave up"] and engine.running == {} and len(engine.aborted) == 1
    other, _ = _serve(engine, [_tool_agent([0.0])])
    assert other.id_prefix != server.id_prefix and engine.aborted[0].startswith(server.id_prefix)


def test_a_request_the_engine_refuses_fails_alone():
    class Refusing(_SteppedEngine):
        def add_request(self, request_id, prompt_ids, spec, seed):
            if prompt_ids[0] == 200:
                raise ValueError("token id out of vocabulary")
            super().add_request(request_id, prompt_ids, spec, seed)

    async def guarded(server, i):
        try:
            return await _tool_agent([0.0])(server, i)
        except ValueError as error:
            return str(error)

    _, results = _serve(Refusing(), [guarded, guarded])
    assert results[0][0] == [100, 101, 101, 102, 102] and results[1] == "token id out of vocabulary"


def test_an_engine_error_reaches_every_waiting_request():
    async def asks(server, i):
        return await server.generate(str(i), prompt_ids=[i + 1], sampling_params={})

    with pytest.raises(RuntimeError, match="engine down"):
        _serve(_EchoEngine(fail=True), [asks, asks, asks])


def test_seeds_are_per_trajectory_and_request_and_do_not_depend_on_timing():
    def agent(delay):
        async def run(server, i):
            await asyncio.sleep(delay)
            for _ in range(2):
                await server.generate("x", prompt_ids=[i + 1], sampling_params={"temperature": 1.0, "max_tokens": 1})
        return run

    seeds = []
    for delays in ((0.0, 0.0), (0.2, 0.0)):  # batched together, then one after the other
        engine = _EchoEngine()
        _serve(engine, [agent(d) for d in delays], seed=11)
        seeds.append({prompt[0]: [] for prompts, _, _ in engine.calls for prompt in prompts})
        for prompts, _, call_seeds in engine.calls:
            for prompt, seed in zip(prompts, call_seeds):
                seeds[-1][prompt[0]].append(seed)
    assert seeds[0] == seeds[1]
    assert len({s for row in seeds[0].values() for s in row}) == 4


def test_sampling_params_are_checked_and_max_tokens_defaults_as_verl():
    def asks(params, prompt_len=4):
        async def run(server, i):
            return await server.generate("q", prompt_ids=list(range(1, prompt_len + 1)), sampling_params=params)
        return run

    for params, match in (({"presence_penalty": 0.5}, r"\['presence_penalty'\] are not honoured"),
                          ({"top_p": 0.0}, r"sampling_params: expected temperature >= 0, 0 < top_p <= 1"),
                          ({"top_k": -5}, "top_k -1 \\(off\\) or >= 1"),
                          ({"repetition_penalty": 1.1}, "repetition_penalty must be 1.0"),
                          ({"n": 2}, "n 1")):
        with pytest.raises(ValueError, match=match):
            _serve(_EchoEngine(), [(asks(params))])
    with pytest.raises(ValueError, match="text-only"):
        async def image(server, i):
            return await server.generate("q", prompt_ids=[1], sampling_params={}, image_data=["x"])
        _serve(_EchoEngine(), [image])
    # verl 0.9.1: min(response_length, prompt_length + response_length - len(prompt)), within max_model_len
    engine = _EchoEngine()
    _serve(engine, [(asks({}, prompt_len=4)), (asks({}, prompt_len=20))])
    assert sorted(budget for _, budgets, _ in engine.calls for budget in budgets) == [4, 8]  # 16 + 8 - 20 = 4
    with pytest.raises(ValueError, match="no room to generate within max_model_len=64"):
        _serve(_EchoEngine(), [(asks({}, prompt_len=64))])


# ---- the hf engine: a generator per row ----
@pytest.fixture(scope="module")
def hf_engine(tiny_path):
    from transformers import AutoTokenizer

    from pyrl.config import RolloutConfig
    from pyrl.workers.rollout.hf_engine import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    return HFEngine(tiny_path, RolloutConfig(dtype="float32"), torch.device("cpu"), tokenizer)


def test_hf_rows_sample_from_their_own_seed_whatever_they_are_batched_with(hf_engine):
    spec = SamplingSpec(temperature=1.0, top_k=20, top_p=0.9, max_tokens=12, logprobs=True)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    alone = [hf_engine.generate([p], spec, max_tokens=[12], seeds=[s]) for p, s in zip(prompts, (1, 2, 3))]
    together = hf_engine.generate(prompts, spec, max_tokens=[12, 12, 12], seeds=[1, 2, 3])
    reordered = hf_engine.generate(prompts[::-1], spec, max_tokens=[12] * 3, seeds=[3, 2, 1])
    for i in range(3):
        assert alone[i][0][0] == together[0][i] == reordered[0][2 - i]
        torch.testing.assert_close(torch.tensor(alone[i][1][0]), torch.tensor(together[1][i]), atol=1e-5, rtol=0)
    other_seed = hf_engine.generate([prompts[0]], spec, max_tokens=[12], seeds=[99])[0][0]
    assert other_seed != alone[0][0][0]


def test_hf_sampling_ignores_the_models_shipped_sampling_settings(hf_engine, tiny_path, tmp_path):
    """A generation_config.json's repetition_penalty / no_repeat_ngram_size (Qwen2.5-Instruct ships a penalty) would
    sample from another distribution than the trainer scores: the engine keeps only its token ids, as verl's
    engines sample with repetition_penalty 1.0. Greedy, sampled and per-row seeded alike."""
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    from pyrl.config import RolloutConfig
    from pyrl.workers.rollout.hf_engine import HFEngine

    shipped_path = tmp_path / "shipped"
    shutil.copytree(tiny_path, shipped_path)
    shipped = GenerationConfig.from_pretrained(tiny_path)
    shipped.repetition_penalty, shipped.no_repeat_ngram_size, shipped.top_k, shipped.do_sample = 5.0, 1, 3, True
    shipped.save_pretrained(shipped_path)
    engine = HFEngine(str(shipped_path), RolloutConfig(dtype="float32"), torch.device("cpu"),
                      AutoTokenizer.from_pretrained(tiny_path))
    prompts = [[5, 6, 7], [8, 9]]
    for temperature, seeds in ((0.0, None), (1.0, None), (1.0, [4, 5])):
        spec = SamplingSpec(temperature=temperature, max_tokens=16, logprobs=True)
        outputs = []
        for which in (hf_engine, engine):
            which.generator.manual_seed(0)
            outputs.append(which.generate(prompts, spec, max_tokens=[16, 16], seeds=seeds))
        assert outputs[0] == outputs[1], (temperature, seeds)
    greedy = hf_engine.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=16))[0]
    assert any(len(set(tokens)) < len(tokens) for tokens in greedy)  # a token repeats: the penalty would bite


def test_hf_per_row_sampling_draws_from_the_tempered_top_k_top_p_softmax(hf_engine):
    """One token from one prompt, 3,000 seeds: the frequencies match the float64 distribution after temperature,
    top-k and top-p (transformers' order and rules), and each token's reported log-prob is that distribution's."""
    prompt, temperature, top_k, top_p = [5, 6, 7], 1.3, 12, 0.8
    spec = SamplingSpec(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=1, logprobs=True)
    draws = 3000
    tokens, logprobs = hf_engine.generate([prompt] * draws, spec, max_tokens=[1] * draws, seeds=list(range(draws)))
    with torch.no_grad():
        logits = hf_engine.model(torch.tensor([prompt])).logits[0, -1].double() / temperature
    kth = torch.topk(logits, top_k).values[-1]
    logits[logits < kth] = float("-inf")
    ascending, order = torch.sort(logits)
    cut = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
    cut[-1] = False
    logits[order[cut]] = float("-inf")
    want = logits.log_softmax(-1)
    counts = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=want.numel()).double()
    support = torch.isfinite(want)
    assert counts[~support].sum() == 0  # never a token top-k / top-p removed
    expected = want.exp() * draws
    chi2 = (((counts - expected) ** 2 / expected)[support]).sum().item()
    dof = int(support.sum()) - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5, (chi2, dof)  # far inside the 1e-6 tail
    for token, logprob in zip(tokens[:50], logprobs[:50]):
        assert logprob[0] == pytest.approx(want[token[0]].item(), abs=1e-5)


@pytest.mark.parametrize("config_do_sample, meta, greedy", [
    (False, {"temperature": 1.0}, False),  # verl 0.9.1's rollout samples: do_sample is read nowhere
    (True, {"temperature": 0.0}, True),  # temperature 0 decodes greedily whatever do_sample says
    (True, {}, False),  # the rollout's own temperature (1.0)
    (True, {"do_sample": False}, True),  # pyrl's internal greedy pass (ReMax's baseline)
])
def test_the_temperature_decides_greedy_decoding_as_in_verl(config_do_sample, meta, greedy):
    from pyrl.config import RolloutConfig

    config = RolloutConfig(temperature=1.0, do_sample=config_do_sample, response_length=8)
    assert SamplingSpec.from_config(config, meta).greedy is greedy
