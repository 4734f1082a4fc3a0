"""verl 0.9.1's gdpo, rate_limited and remote reward managers (verl/experimental/reward_loop/reward_manager/
{gdpo,limited,remote}.py) against hand-computed expectations: where the score lands, what extra_info each passes,
the rate limiter's token buckets (by a fake clock, and by the wall clock as lower bounds), and the failures."""

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pyrl.rewards import managers
from pyrl.rewards.managers import (
    AsyncTokenBucket,
    GDPORewardManager,
    RateLimitedRewardManager,
    RemoteRewardManager,
    close_scoring_pools,
    load_custom_function,
    load_reward_manager,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from test_managers import rollout as plain_rollout  # noqa: E402
from trainer_helpers import compose  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pyrl.models import tiny_model_path

    return AutoTokenizer.from_pretrained(tiny_model_path())


@pytest.fixture(autouse=True)
def fresh_limits():
    """Each test its own limiters (the process's are shared by settings, as verl's class-level ones)."""
    managers._RATE_LIMITS.clear()
    yield
    managers._RATE_LIMITS.clear()


@pytest.fixture(scope="module", autouse=True)
def scoring_pools():
    yield
    close_scoring_pools()


ROW_EXTRA = {"index": 7, "split": "train"}


def rollout(tokenizer, answers, truths, width=8, turns=False):
    """test_managers' rollout batch (`answers` + eos, right-padded to `width`), with extra_info where rows 0 and 1
    share one dict (the n samples of a prompt do); turns: a multi-turn rollout's columns (3 turns, the tools'
    rewards)."""
    data = plain_rollout(tokenizer, answers, truths, width)
    rows = len(answers)
    shared = dict(ROW_EXTRA)
    extra = np.empty(rows, dtype=object)
    extra[:] = [shared if i < 2 else {"index": i} for i in range(rows)]
    data.non_tensor_batch["extra_info"] = extra
    if turns:
        lists = np.empty(rows, dtype=object)
        for i in range(rows):
            lists[i] = [0.5, float(i)]
        fields = np.empty(rows, dtype=object)  # each loop's extra_fields whole: a user's loop's own field too
        fields[:] = [{"tool_rewards": lists[i], "turn_scores": lists[i], "searched": f"q{i}"} for i in range(rows)]
        data.non_tensor_batch.update({"__num_turns__": np.full(rows, 3, dtype=np.int32), "tool_rewards": lists,
                                      "turn_scores": lists.copy(), "tool_extra_fields": fields})
    return data


def expected_scores(data, values):
    """values[i] on row i's last valid response token (from the attention mask), 0 elsewhere."""
    prompt_width = data.batch["prompts"].shape[1]
    lengths = data.batch["attention_mask"][:, prompt_width:].sum(-1)
    out = torch.zeros(data.batch["responses"].shape)
    for i, value in enumerate(values):
        out[i, int(lengths[i]) - 1] = value
    return out


def recording_scorer(seen):
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        right = float(solution_str.strip() == ground_truth)
        return {"score": right + 0.5 * len(solution_str), "accuracy_reward": right, "format_reward": 0.25}
    return scorer


# ---------------------------------------------------------------- gdpo


def test_gdpo_passes_experiment_name_not_the_turns_and_reports_every_component(tokenizer):
    seen = []
    data = rollout(tokenizer, ["2", "5", "2"], ["2", "2", "2"], turns=True)
    manager = GDPORewardManager(tokenizer, recording_scorer(seen), experiment_name="exp-1")
    scores, extra, metrics = manager(data)
    assert torch.equal(scores, expected_scores(data, [1.5, 0.5, 1.5]))
    # verl's gdpo: the row's extra_info + experiment_name; no num_turns / rollout_reward_scores, no tool fields
    assert seen == [{**ROW_EXTRA, "experiment_name": "exp-1"}, {**ROW_EXTRA, "experiment_name": "exp-1"},
                    {"index": 2, "experiment_name": "exp-1"}]
    assert data.non_tensor_batch["extra_info"][0] == ROW_EXTRA  # the rows' dicts are left as they were
    assert extra == {"score": [1.5, 0.5, 1.5], "accuracy_reward": [1.0, 0.0, 1.0], "format_reward": [0.25] * 3}
    assert metrics == {"reward/scorer_errors": 0, "reward/scorer_timeouts": 0}
    # a plain-number scorer: "acc", as verl's gdpo reports it
    _, extra, _ = GDPORewardManager(tokenizer, lambda **kw: 2.0, experiment_name="e")(data)
    assert extra == {"acc": [2.0, 2.0, 2.0]}


def test_gdpo_components_feed_the_gdpo_estimator(tokenizer):
    from pyrl.algos import get_adv_estimator_fn
    from pyrl.config import AlgorithmConfig

    data = rollout(tokenizer, ["2", "5", "2", "2"], ["2"] * 4)
    scores, extra, _ = GDPORewardManager(tokenizer, recording_scorer([]), experiment_name="e")(data)
    config = AlgorithmConfig(adv_estimator="gdpo", gdpo_reward_keys=["accuracy_reward", "format_reward"])
    uids = np.array(["a", "a", "b", "b"], dtype=object)
    mask = data.batch["response_mask"].float()
    fn = get_adv_estimator_fn("gdpo")
    from_manager, _ = fn(scores, mask, uids, config=config,
                         non_tensor_batch={k: np.asarray(v, dtype=object) for k, v in extra.items()})
    by_hand, _ = fn(scores, mask, uids, config=config,
                    non_tensor_batch={"accuracy_reward": np.array([1.0, 0.0, 1.0, 1.0], dtype=object),
                                      "format_reward": np.array([0.25] * 4, dtype=object)})
    assert torch.equal(from_manager, by_hand)
    # group a: accuracy (1, 0) -> +-1/sqrt(2); group b and format agree within groups -> 0: the pair's signs
    assert (from_manager[0] * mask[0]).sum() > 0 > (from_manager[1] * mask[1]).sum()


def test_load_reward_manager_gives_gdpo_the_experiment_name(tokenizer, tmp_path):
    path = tmp_path / "scorer.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return {'score': 1.0, 'experiment': extra_info['experiment_name']}\n")
    config = compose("preset=toy", "reward.reward_manager.name=gdpo", "trainer.experiment_name=my_run",
                     f"reward.custom_reward_function.path={path}")
    manager = load_reward_manager(config, tokenizer)
    assert type(manager) is GDPORewardManager
    _, extra, _ = manager(rollout(tokenizer, ["1"], ["1"]))
    assert extra["experiment"] == ["my_run"]


# ---------------------------------------------------------------- remote

REMOTE_SCORER = """import os
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    if '3' in solution_str:
        raise ValueError('cannot parse')
    return {'score': float(solution_str.strip() == ground_truth) + bonus, 'pid': os.getpid(),
            'keys': ','.join(sorted(extra_info)), 'num_turns': extra_info.get('num_turns', -1)}
async def async_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return 1.0
"""


def test_remote_scores_in_another_process_with_naive_extra_info(tokenizer, tmp_path):
    path = tmp_path / "remote_scorer.py"
    path.write_text(REMOTE_SCORER)
    fn = load_custom_function(str(path), "compute_score", {"bonus": 0.25})
    data = rollout(tokenizer, ["2", "3", "7"], ["2", "2", "2"], turns=True)
    manager = RemoteRewardManager(tokenizer, fn, num_workers=1)  # one worker: still out of the driver
    scores, extra, metrics = manager(data)
    assert torch.equal(scores, expected_scores(data, [1.25, 0.0, 0.25]))
    assert extra["pid"][0] != os.getpid() and extra["pid"][2] == extra["pid"][0] and extra["pid"][1] == 0.0
    # naive's extra_info (verl's remote passes what its naive does): the row's, num_turns, the tools' rewards
    assert extra["keys"] == ["index,num_turns,rollout_reward_scores,searched,split,tool_rewards,turn_scores", None,
                             "index,num_turns,rollout_reward_scores,searched,tool_rewards,turn_scores"]
    assert extra["num_turns"] == [3, 0.0, 3]
    # the raising sample: 0, counted, as naive (verl 0.9.1's remote lets the exception end the step)
    assert extra["score"] == [1.25, 0.0, 0.25] and metrics == {"reward/scorer_errors": 1, "reward/scorer_timeouts": 0}
    with pytest.raises(RuntimeError, match="raised on sample 1 .reward.strict=true.: ValueError: cannot parse"):
        RemoteRewardManager(tokenizer, fn, num_workers=1, strict=True)(data)


def test_remote_refuses_an_async_scorer_at_load(tokenizer, tmp_path):
    path = tmp_path / "remote_scorer.py"
    path.write_text(REMOTE_SCORER)

    async def scorer(**kwargs):
        return 1.0

    with pytest.raises(ValueError, match="reward.reward_manager.name=remote: compute_score is an `async def`"):
        RemoteRewardManager(tokenizer, scorer)
    config = compose("preset=toy", "reward.reward_manager.name=remote", f"reward.custom_reward_function.path={path}",
                     "reward.custom_reward_function.name=async_score",
                     "+reward.custom_reward_function.reward_kwargs.bonus=1")  # bound with functools.partial
    with pytest.raises(ValueError, match="remote.*async def.*use naive or rate_limited"):
        load_reward_manager(config, tokenizer)
    config.reward.custom_reward_function.name = "compute_score"
    assert type(load_reward_manager(config, tokenizer)) is RemoteRewardManager


# ---------------------------------------------------------------- rate_limited: the token bucket


def test_async_token_bucket_by_hand():
    """verl's AsyncTokenBucket on a fake clock (times and rates exact in binary): the bucket starts full, refills
    rate_limit a second up to max_tokens, and a request above max_tokens goes into debt and sleeps for its
    shortfall."""
    now, sleeps = [0.0], []

    async def sleep(seconds):
        sleeps.append(seconds)
        now[0] += seconds
        assert len(sleeps) < 20, sleeps  # a bucket that never fills

    async def scenario():
        bucket = AsyncTokenBucket(8.0, clock=lambda: now[0], sleep=sleep)
        assert bucket.max_tokens == 8.0 and bucket.tokens == 8.0  # max_tokens defaults to the rate
        await bucket.acquire(4)  # 8 -> 4, no wait
        assert (bucket.tokens, sleeps) == (4.0, [])
        await bucket.acquire(8)  # 4 short: sleeps 4 / 8 s, refilled to 8, takes them all
        assert (sleeps, bucket.tokens, now[0]) == ([0.5], 0.0, 0.5)
        now[0] += 0.25  # 2 tokens flow in
        await bucket.acquire(1)
        assert (bucket.tokens, len(sleeps)) == (1.0, 1)
        now[0] += 5.0  # refilled past the top: capped at 8
        await bucket.acquire(0)
        assert bucket.tokens == 8.0
        await bucket.acquire(20)  # more than the bucket holds: 12 short -> sleeps 1.5 s, balance -12
        assert (sleeps[-1], bucket.tokens) == (1.5, -12.0)
        await bucket.acquire(1)  # 1.5 s of refill since the debt: -12 + 12 = 0, then 1 / 8 s for 1 more
        assert (sleeps[1:], bucket.tokens, now[0]) == ([1.5, 0.125], 0.0, 0.5 + 0.25 + 5.0 + 1.5 + 0.125)

    asyncio.run(scenario())


def test_async_token_bucket_on_the_loop_clock():
    """The default clock: 3 requests of a 2-token bucket refilling 20 a second take at least 1 / 20 s."""
    async def scenario():
        bucket = AsyncTokenBucket(20.0, 2.0)
        start = asyncio.get_running_loop().time()
        await asyncio.gather(*(bucket.acquire(1) for _ in range(3)))
        return asyncio.get_running_loop().time() - start

    assert 0.05 - 1e-3 <= asyncio.run(scenario()) < 5.0


# ---------------------------------------------------------------- rate_limited: the manager


def entry_times(tokenizer, n, **limits):
    """n calls of an instant scorer under `limits`: (seconds from before the call to each entry, sorted, and the
    scores)."""
    entries = []

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        entries.append(time.monotonic())
        return 1.0

    data = rollout(tokenizer, ["2"] * n, ["2"] * n)
    start = time.monotonic()
    scores, extra, _ = RateLimitedRewardManager(tokenizer, scorer, **limits)(data)
    assert torch.equal(scores, expected_scores(data, [1.0] * n)) and extra == {"acc": [1.0] * n}
    return sorted(t - start for t in entries)


def test_rate_limited_requests_per_minute(tokenizer):
    """max_rpm=600: a bucket of 10 requests refilled 10 a second; call k (from 0) cannot start before
    (k + 1 - 10) / 10 s, so 15 calls take at least 0.5 s."""
    times = entry_times(tokenizer, 15, max_rpm=600, max_concurrent=4)
    for k, t in enumerate(times):
        assert t >= (k + 1 - 10) / 10 - 1e-3, (k, times)
    assert times[-1] < 8.0


def test_rate_limited_tokens_per_minute(tokenizer):
    """max_tpm=24000, 100 tokens a call: a bucket of 400 tokens (4 calls) refilled 400 a second; call k cannot
    start before (100 (k + 1) - 400) / 400 s, so 6 calls take at least 0.5 s."""
    times = entry_times(tokenizer, 6, max_tpm=24000, estimated_tokens_per_request=100, max_concurrent=4)
    for k, t in enumerate(times):
        assert t >= (100 * (k + 1) - 400) / 400 - 1e-3, (k, times)
    assert times[-1] < 8.0


def concurrency_scorer(seconds, asynchronous=False):
    """A scorer that sleeps and records how many calls were inside it at once (state["most"])."""
    state = {"now": 0, "most": 0}
    lock = threading.Lock()

    def enter():
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])

    def leave():
        with lock:
            state["now"] -= 1

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        enter()
        time.sleep(seconds)
        leave()
        return float(solution_str.strip() == ground_truth)

    async def async_scorer(data_source, solution_str, ground_truth, extra_info=None):
        enter()
        await asyncio.sleep(seconds)
        leave()
        return {"score": float(solution_str.strip() == ground_truth), "len": len(solution_str)}

    return (async_scorer if asynchronous else scorer), state


def test_rate_limited_max_concurrent(tokenizer):
    """max_concurrent=3: 6 calls of 0.25 s run 3 at a time, in at least two rounds (0.5 s)."""
    scorer, state = concurrency_scorer(0.25)
    data = rollout(tokenizer, ["2", "5", "2", "2", "2", "2"], ["2"] * 6)
    start = time.monotonic()
    scores, extra, _ = RateLimitedRewardManager(tokenizer, scorer, max_concurrent=3)(data)
    elapsed = time.monotonic() - start
    assert state["most"] == 3 and 0.5 - 1e-3 <= elapsed < 10.0
    assert torch.equal(scores, expected_scores(data, [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]))
    assert extra == {"acc": [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]}


def test_rate_limited_awaits_an_async_scorer(tokenizer):
    """An `async def` scorer runs on the limiter's loop: 4 of them at once under max_concurrent=4; verl's default
    max_concurrent=1 runs them one by one."""
    scorer, state = concurrency_scorer(0.2, asynchronous=True)
    data = rollout(tokenizer, ["2", "5", "2", "22"], ["2"] * 4)
    scores, extra, _ = RateLimitedRewardManager(tokenizer, scorer, max_concurrent=4)(data)
    assert state["most"] == 4
    assert torch.equal(scores, expected_scores(data, [1.0, 0.0, 1.0, 0.0]))
    assert extra == {"score": [1.0, 0.0, 1.0, 0.0], "len": [1, 1, 1, 2]}
    scorer, state = concurrency_scorer(0.05, asynchronous=True)
    RateLimitedRewardManager(tokenizer, scorer)(data)
    assert state["most"] == 1


def test_rate_limited_timeout_and_errors_give_verls_values(tokenizer, caplog):
    """A call past reward.timeout scores 0.0 with {"timeout": True, "acc": 0.0}, one that raises 0.0 with
    {"error": str(e), "acc": 0.0} (verl's values), both counted; a dict without "score" is an error, as in verl."""
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        if "4" in solution_str:
            time.sleep(2.0)
        if "3" in solution_str:
            raise ValueError("cannot parse")
        return float(solution_str.strip() == ground_truth)

    data = rollout(tokenizer, ["2", "4", "3", "5"], ["2"] * 4)
    start = time.monotonic()
    scores, extra, metrics = RateLimitedRewardManager(tokenizer, scorer, max_concurrent=4, timeout=0.2)(data)
    assert time.monotonic() - start < 1.8  # the slow call was given up at its timeout, not waited for
    assert torch.equal(scores, expected_scores(data, [1.0, 0.0, 0.0, 0.0]))
    assert extra == {"acc": [1.0, 0.0, 0.0, 0.0], "timeout": [False, True, False, False],
                     "error": [None, None, "cannot parse", None]}
    assert metrics == {"reward/scorer_errors": 1, "reward/scorer_timeouts": 1}

    async def slow(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(10 if "4" in solution_str else 0)
        return {"score": 1.0, "tag": "ok"} if "2" in solution_str else {"acc": 1.0}

    scores, extra, metrics = RateLimitedRewardManager(tokenizer, slow, max_concurrent=4, timeout=0.2)(data)
    assert torch.equal(scores, expected_scores(data, [1.0, 0.0, 0.0, 0.0]))
    assert extra == {"score": [1.0, 0.0, 0.0, 0.0], "tag": ["ok", None, None, None],
                     "acc": [0.0, 0.0, 0.0, 0.0], "timeout": [False, True, False, False],
                     "error": [None, None, "'score'", "'score'"]}
    assert metrics == {"reward/scorer_errors": 2, "reward/scorer_timeouts": 1}
    with pytest.raises(RuntimeError, match="timed out on sample 1 .reward.strict=true.: TimeoutError: over 0.2 s"):
        RateLimitedRewardManager(tokenizer, slow, max_concurrent=4, timeout=0.2, strict=True)(data)


def test_rate_limited_extra_info_has_the_tools_fields_not_num_turns(tokenizer):
    seen = []
    data = rollout(tokenizer, ["2", "5"], ["2", "2"], turns=True)
    RateLimitedRewardManager(tokenizer, recording_scorer(seen))(data)
    assert seen == [{**ROW_EXTRA, "tool_rewards": [0.5, 0.0], "turn_scores": [0.5, 0.0], "searched": "q0"},
                    {**ROW_EXTRA, "tool_rewards": [0.5, 1.0], "turn_scores": [0.5, 1.0], "searched": "q1"}]
    seen.clear()
    RateLimitedRewardManager(tokenizer, recording_scorer(seen))(rollout(tokenizer, ["2"], ["2"]))
    assert seen == [{**ROW_EXTRA, "turn_scores": [], "tool_rewards": []}]  # verl's single-turn loop's fields


def test_rate_limited_keys_where_verl_reads_them(tokenizer):
    """reward.max_concurrent / max_rpm / max_tpm / estimated_tokens_per_request / timeout (verl's command lines
    add them: +reward.max_rpm=...), verl's defaults; the training and validation managers share one set of
    limiters; another manager given one stops the run, as does rate_limited given pyrl's reward.timeout_s."""
    from pyrl.config import plus_dropped_for_known

    default = load_reward_manager(compose("preset=toy", "reward.reward_manager.name=rate_limited"), tokenizer)
    assert default.limits.semaphore._value == 1 and default.limits.rpm is None and default.limits.tpm is None
    assert default.limits.estimated_tokens_per_request == 2000 and default.timeout == 300.0
    overrides = plus_dropped_for_known(["reward.reward_manager.name=rate_limited", "+reward.max_concurrent=8",
                                        "+reward.max_rpm=120", "+reward.max_tpm=6000",
                                        "+reward.estimated_tokens_per_request=50", "+reward.timeout=30"])
    config = compose("preset=toy", *overrides)
    manager = load_reward_manager(config, tokenizer)
    assert type(manager) is RateLimitedRewardManager and manager.timeout == 30.0
    limits = manager.limits
    assert limits.semaphore._value == 8 and limits.estimated_tokens_per_request == 50
    assert (limits.rpm.rate_limit, limits.rpm.max_tokens) == (2.0, 2.0)  # a second's worth
    assert (limits.tpm.rate_limit, limits.tpm.max_tokens) == (100.0, 100.0)
    assert load_reward_manager(config, tokenizer).limits is limits
    with pytest.raises(ValueError, match="reward.max_rpm=60 is read by the rate_limited manager only: set "
                                         "reward.reward_manager.name=rate_limited .it is 'naive'."):
        load_reward_manager(compose("preset=toy", "reward.max_rpm=60"), tokenizer)
    with pytest.raises(ValueError, match="reward.timeout_s=5.0 is not read by the rate_limited manager"):
        load_reward_manager(compose("preset=toy", "reward.reward_manager.name=rate_limited", "reward.timeout_s=5"),
                            tokenizer)
    with pytest.raises(ValueError, match="reward.max_concurrent=0: expected at least 1"):
        load_reward_manager(compose("preset=toy", "reward.reward_manager.name=rate_limited",
                                    "reward.max_concurrent=0"), tokenizer)
    unlimited = load_reward_manager(compose("preset=toy", "reward.reward_manager.name=rate_limited",
                                            "reward.timeout=null"), tokenizer)
    assert unlimited.timeout is None


def test_the_managers_are_registered_names():
    from pyrl.config import migrate_legacy_reward
    from pyrl.trainer.checks import check_names

    for name in ("gdpo", "rate_limited", "remote"):
        for override in (f"reward.reward_manager.name={name}", f"reward_model.reward_manager={name}"):
            config = compose("preset=toy", override)
            migrate_legacy_reward(config)
            check_names(config)
            assert config.reward.reward_manager.name == name
