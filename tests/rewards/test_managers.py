import asyncio
import logging
import time

import numpy as np
import pytest
import torch

from pyrl.protocol import DataProto
from pyrl.rewards.managers import BatchRewardManager, RewardManager, close_scoring_pools, load_custom_function


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pyrl.models import tiny_model_path

    return AutoTokenizer.from_pretrained(tiny_model_path())


def rollout(tokenizer, answers, truths, width=8):
    """A rollout batch whose responses are `answers` (+ eos), right-padded to `width`."""
    prompt = tokenizer("1+1=", add_special_tokens=False)["input_ids"]
    rows = [tokenizer(a + tokenizer.eos_token, add_special_tokens=False)["input_ids"][:width] for a in answers]
    responses = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        responses[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    prompts = torch.tensor([prompt] * len(rows))
    return DataProto.from_dict(
        {"prompts": prompts, "responses": responses, "response_mask": mask,
         "attention_mask": torch.cat([torch.ones_like(prompts), mask], -1)},
        {"data_source": np.array(["pyrl/toy_addition"] * len(rows), dtype=object),
         "reward_model": np.array([{"ground_truth": t} for t in truths], dtype=object)})


def test_naive_puts_the_score_on_the_last_valid_token(tokenizer):
    data = rollout(tokenizer, ["<answer>2</answer>", "<answer>3</answer>", ""], ["2", "2", "2"])
    scores, extra, metrics = RewardManager(tokenizer)(data)
    lengths = data.batch["response_mask"].sum(-1)
    assert scores[0, lengths[0] - 1] == 1.0 and scores.sum() == 1.0
    assert extra == {"acc": [1.0, 0.0, 0.0]}  # a scorer returning numbers: verl 0.9.1 reports each as "acc"
    assert metrics == {"reward/scorer_errors": 0, "reward/scorer_timeouts": 0}


def test_failing_and_slow_scorers_score_zero_are_counted_and_logged_once(tokenizer, caplog):
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if "3" in solution_str:
            raise ValueError("cannot parse")
        if "4" in solution_str:
            time.sleep(5)
        return 1.0

    data = rollout(tokenizer, ["<answer>3</answer>", "<answer>3</answer>", "<answer>4</answer>", "<answer>2</answer>"],
                   ["2"] * 4)
    with caplog.at_level(logging.WARNING):
        scores, _, metrics = RewardManager(tokenizer, flaky, timeout_s=0.2)(data)
    assert scores.sum(-1).tolist() == [0.0, 0.0, 0.0, 1.0]
    assert metrics == {"reward/scorer_errors": 2, "reward/scorer_timeouts": 1}
    messages = [r.getMessage() for r in caplog.records]
    assert sum("raised on sample 0" in m for m in messages) == 1 and not any("sample 1" in m for m in messages)
    assert any("timed out on sample 2" in m for m in messages)
    with pytest.raises(RuntimeError, match="raised on sample 0 .reward.strict=true.: ValueError: cannot parse"):
        RewardManager(tokenizer, flaky, strict=True)(data)


def test_dict_scores_batch_manager_and_overlong_penalty(tokenizer, tmp_path):
    path = tmp_path / "my_reward.py"
    # verl's batch keywords, in another order than verl passes them
    path.write_text("def compute_reward(solution_strs, data_sources, extra_infos, ground_truths, bonus=0.0):\n"
                    "    return [{'score': float(len(s)) + bonus, 'chars': len(s)} for s in solution_strs]\n")
    fn = load_custom_function(str(path), "compute_reward", {"bonus": 0.5})
    data = rollout(tokenizer, ["ab", "abcdef"], ["", ""])
    scores, extra, _ = BatchRewardManager(tokenizer, fn)(data)
    assert scores.sum(-1).tolist() == [2.5, 6.5] and extra["chars"] == [2, 6]
    with pytest.raises(AttributeError, match="defines no function 'nope'"):
        load_custom_function(str(path), "nope")
    # DAPO: responses longer than max_len - buffer lose up to penalty_factor, linearly
    manager = RewardManager(tokenizer, lambda **kw: 1.0, max_response_length=8,
                            overlong_buffer={"enable": True, "len": 4, "penalty_factor": 1.0})
    data = rollout(tokenizer, ["a", "abcdefghijk"], ["", ""])
    lengths = data.batch["response_mask"].sum(-1).tolist()
    scores, extra, _ = manager(data)
    expected = [min(0.0, -(n - 4) / 4) for n in lengths]
    assert scores.sum(-1).tolist() == pytest.approx([1.0 + e for e in expected]) and "overlong" not in extra
    manager.overlong_buffer["log"] = True  # verl's dapo manager: the penalty and whether it applied, per sample
    _, extra, _ = manager(data)
    assert extra["overlong_reward"] == pytest.approx(expected) and extra["overlong"] == [e < 0 for e in expected]


def test_extra_fields_stay_aligned_when_a_dict_scorer_fails(tokenizer):
    """A sample whose scorer raised scores 0 and gets 0.0 for the numeric extra fields, None for the others;
    a field only some samples return is filled the same way; a dict without 'score' is an error."""
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        if "3" in solution_str:
            raise ValueError("cannot parse")
        out = {"score": 1.0, "acc": True, "pred": solution_str}
        if "4" in solution_str:
            out["format_ok"] = 0.5
        return out

    data = rollout(tokenizer, ["<answer>3</answer>", "<answer>4</answer>", "<answer>2</answer>"], ["2"] * 3)
    scores, extra, metrics = RewardManager(tokenizer, scorer)(data)
    assert scores.sum(-1).tolist() == [0.0, 1.0, 1.0] and metrics["reward/scorer_errors"] == 1
    assert extra == {"score": [0.0, 1.0, 1.0], "acc": [0.0, True, True],
                     "pred": [None, "<answer>4</answer>", "<answer>2</answer>"], "format_ok": [0.0, 0.5, 0.0]}
    with pytest.raises(ValueError, match="compute_score returned a dict without 'score' for sample 0"):
        RewardManager(tokenizer, lambda **kw: {"acc": 1.0})(data)


def test_custom_reward_gets_verl_keywords_reward_kwargs_and_may_be_async(tokenizer, tmp_path):
    """A verl reward function declares its parameters in any order (verl passes them by name), takes
    reward_kwargs, and may be `async def` (awaited). A single-turn sample's extra_info is verl 0.9.1's naive one:
    the turn fields of its single-turn agent loop (2 turns, no turn scores or tool rewards)."""
    path = tmp_path / "verl_reward.py"
    path.write_text(
        "import asyncio\n"
        "def by_name(solution_str, ground_truth, extra_info, data_source, scale=1.0):\n"
        "    assert data_source == 'pyrl/toy_addition' and extra_info['num_turns'] == 2\n"
        "    assert extra_info['turn_scores'] == extra_info['tool_rewards'] == []\n"
        "    return scale * float(solution_str.strip() == ground_truth)\n"
        "async def awaited(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):\n"
        "    await asyncio.sleep(0)\n"
        "    return {'score': scale * float(solution_str.strip() == ground_truth), 'len': len(solution_str)}\n")
    data = rollout(tokenizer, ["7", "8"], ["7", "7"])
    for name in ("by_name", "awaited"):
        fn = load_custom_function(str(path), name, {"scale": 2.0})
        scores, _, metrics = RewardManager(tokenizer, fn, strict=True)(data)
        assert scores.sum(-1).tolist() == [2.0, 0.0] and metrics["reward/scorer_errors"] == 0, name
    # a reward_kwargs key the manager passes too wins over the manager's value (verl's _call_with_kwargs)
    fn = load_custom_function(str(path), "awaited", {"ground_truth": "8"})
    assert RewardManager(tokenizer, fn, strict=True)(data)[0].sum(-1).tolist() == [0.0, 1.0]


def test_an_async_scorers_calls_are_awaited_together_each_within_the_timeout(tokenizer):
    """verl's reward loop gathers a batch's calls of an `async def` scorer (a judge behind a served reward model
    sees them at once): every call is in flight before any returns, whatever reward.num_workers; a call past
    reward.timeout_s or raising scores 0 and is counted, the others keep their scores; pyrl.rewards.counts sums."""
    from pyrl.rewards import counts

    in_flight, peak = [0], [0]

    async def judge(data_source, solution_str, ground_truth, extra_info=None):
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await asyncio.sleep(0.05)
        in_flight[0] -= 1
        counts.add("judge_calls")
        if solution_str.strip() == "8":
            raise ConnectionError("the judge is down")
        if solution_str.strip() == "9":
            await asyncio.sleep(30)
        return float(solution_str.strip() == ground_truth)

    data = rollout(tokenizer, ["7", "8", "9", "6", "7", "5"], ["7"] * 6)
    for workers in (1, 2):
        peak[0] = 0
        scores, _, metrics = RewardManager(tokenizer, judge, timeout_s=1.0, num_workers=workers)(data)
        assert peak[0] == 6, workers
        assert scores.sum(-1).tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        assert (metrics["reward/scorer_errors"], metrics["reward/scorer_timeouts"]) == (1, 1)
        assert metrics["reward/judge_calls"] == 6  # every call counted before it failed or hung


def test_worker_processes_score_in_order_with_failures_counted(tokenizer, tmp_path):
    """reward.num_workers=2: a custom scorer from a file (sent by value to the spawned workers) gives the same
    scores, extras and failure counts as in the driver; timeouts still apply there."""
    path = tmp_path / "slow_reward.py"
    path.write_text(
        "import time\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    if '3' in solution_str:\n"
        "        raise ValueError('cannot parse')\n"
        "    if '4' in solution_str:\n"
        "        time.sleep(5)\n"
        "    return {'score': float(solution_str.strip() == ground_truth) + bonus, 'n': len(solution_str)}\n")
    fn = load_custom_function(str(path), "compute_score", {"bonus": 0.25})
    data = rollout(tokenizer, ["2", "3", "4", "2", "7", "2"], ["2"] * 6)
    inline = RewardManager(tokenizer, fn, timeout_s=1.0)(data)
    try:
        pooled = RewardManager(tokenizer, fn, timeout_s=1.0, num_workers=2)(data)
    finally:
        close_scoring_pools()
    assert pooled[0].sum(-1).tolist() == inline[0].sum(-1).tolist() == [1.25, 0.0, 0.0, 1.25, 0.25, 1.25]
    assert pooled[1] == inline[1] and pooled[2] == inline[2] == {"reward/scorer_errors": 1, "reward/scorer_timeouts": 1}

    # a scorer that kills its process: its chunk scores 0, counted, the run goes on
    crash = tmp_path / "crash_reward.py"
    crash.write_text("import os\n"
                     "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                     "    if '3' in solution_str:\n"
                     "        os._exit(3)\n"
                     "    return 1.0\n")
    try:
        scores, _, metrics = RewardManager(tokenizer, load_custom_function(str(crash), "compute_score"),
                                           num_workers=2)(rollout(tokenizer, ["3", "1", "2", "4"], ["1"] * 4))
        assert metrics["reward/scorer_errors"] >= 1 and scores.sum() <= 3
        again, _, _ = RewardManager(tokenizer, num_workers=2)(data)  # a fresh pool serves the next batch
        assert again.sum(-1).tolist() == [0.0] * 6
    finally:
        close_scoring_pools()


def test_verl_091_reward_keys_and_their_legacy_spellings():
    """reward.* (verl 0.9.1) and the legacy reward_model.* / custom_reward_function.* keys load the same manager;
    one key given both ways with different values is an error naming both."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "trainer"))
    from trainer_helpers import compose

    from pyrl.config import migrate_legacy_reward
    from pyrl.rewards.managers import load_reward_manager

    new = compose("preset=toy", "reward.reward_manager.name=dapo",
                  "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                  "+reward.reward_kwargs.overlong_buffer_cfg.len=4", "+reward.reward_kwargs.max_resp_len=8",
                  "reward.reward_model.enable=true", "reward.reward_model.model_path=pyrl:tiny")
    old = compose("preset=toy", "data.max_response_length=8", "reward_model.reward_manager=dapo",
                  "reward.num_workers=8", "reward_model.num_workers=2",  # verl's default, then the legacy key
                  "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4",
                  "reward_model.enable=true", "reward_model.model.path=pyrl:tiny")
    for config in (new, old):
        migrate_legacy_reward(config)
        assert config.reward.reward_manager.name == "dapo" and config.reward.reward_model.enable
        assert config.reward.num_workers == (2 if config is old else 1)  # the toy preset's 1
        assert config.reward_model.model.path == "pyrl:tiny"  # where the reward model worker reads it
        manager = load_reward_manager(config, None)
        assert manager.overlong_buffer["len"] == 4 and manager.max_response_length == 8
    clash = compose("preset=toy", "reward.custom_reward_function.path=a.py", "custom_reward_function.path=b.py")
    with pytest.raises(ValueError, match="custom_reward_function.path='b.py' and "
                                         "reward.custom_reward_function.path='a.py' disagree"):
        migrate_legacy_reward(clash)
    missing = compose("preset=toy", "reward.reward_manager.name=dapo",
                      "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                      "+reward.reward_kwargs.overlong_buffer_cfg.len=4")
    with pytest.raises(ValueError, match="needs reward.reward_kwargs.max_resp_len"):
        load_reward_manager(missing, None)
    for length in (9, 0):  # verl's dapo manager asserts 0 < len <= max_resp_len
        wrong = compose("preset=toy", "reward.reward_manager.name=dapo", "+reward.reward_kwargs.max_resp_len=8",
                        "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                        f"+reward.reward_kwargs.overlong_buffer_cfg.len={length}")
        with pytest.raises(ValueError, match=f"overlong_buffer_cfg.len={length}: expected more than 0 and at most "
                                             "max_resp_len=8"):
            load_reward_manager(wrong, None)


DAPO_RECIPE = ("reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
               "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
               "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
               "+reward_model.reward_kwargs.overlong_buffer_cfg.log=false",
               "+reward_model.reward_kwargs.max_resp_len=8")


def test_the_dapo_recipes_reward_kwargs_reach_the_manager():
    """verl's DAPO scripts pass +reward_model.reward_kwargs.* (verl 0.9.1's main_ppo drops them, its fully-async
    entry moves them to reward.reward_kwargs): pyrl moves them, so the overlong penalty is on as the script says;
    given both ways they must agree. A key no manager reads, or the penalty asked of another manager, stops."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "trainer"))
    from trainer_helpers import compose

    from pyrl.config import migrate_legacy_reward
    from pyrl.rewards.managers import load_reward_manager

    def manager(*overrides):
        config = compose("preset=toy", *overrides)
        migrate_legacy_reward(config)
        return load_reward_manager(config, None)

    dapo = manager(*DAPO_RECIPE)
    assert dapo.overlong_buffer == {"enable": True, "len": 4, "penalty_factor": 0.5, "log": False}
    assert dapo.max_response_length == 8
    assert manager(*DAPO_RECIPE, "+reward.reward_kwargs.max_resp_len=8").max_response_length == 8  # agreeing
    with pytest.raises(ValueError, match="reward_model.reward_kwargs.max_resp_len=8 and reward.reward_kwargs."
                                         "max_resp_len=16 disagree"):
        manager(*DAPO_RECIPE, "+reward.reward_kwargs.max_resp_len=16")
    with pytest.raises(ValueError, match="overlong_buffer_cfg.lenght: unknown key"):
        manager(*DAPO_RECIPE, "+reward_model.reward_kwargs.overlong_buffer_cfg.lenght=4")
    with pytest.raises(ValueError, match="reward.reward_kwargs.scale: unknown key"):
        manager("+reward.reward_kwargs.scale=2")
    with pytest.raises(ValueError, match="applied by the dapo manager only: set reward.reward_manager.name=dapo"):
        manager(*DAPO_RECIPE[1:])


def test_the_legacy_top_level_sandbox_fusion_moves_to_reward():
    """verl's top-level sandbox_fusion.* (its legacy spelling) is moved to reward.sandbox_fusion, as verl's
    migration does; given both ways with different values it is an error naming both."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "trainer"))
    from trainer_helpers import compose

    from pyrl.config import migrate_legacy_reward

    config = compose("preset=toy", "sandbox_fusion.url=http://sandbox:8080/run_code", "sandbox_fusion.max_concurrent=4")
    migrate_legacy_reward(config)
    assert (config.reward.sandbox_fusion.url, config.reward.sandbox_fusion.max_concurrent,
            config.reward.sandbox_fusion.memory_limit_mb) == ("http://sandbox:8080/run_code", 4, 1024)
    clash = compose("preset=toy", "sandbox_fusion.url=http://a/run_code", "reward.sandbox_fusion.url=http://b/run_code")
    with pytest.raises(ValueError, match="sandbox_fusion.url='http://a/run_code' and reward.sandbox_fusion.url="
                                         "'http://b/run_code' disagree"):
        migrate_legacy_reward(clash)
