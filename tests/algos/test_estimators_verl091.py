"""gdpo, grpo_vectorized, rloo_vectorized, reinforce_plus_plus, optimal_token_baseline and tir_optimal_token_baseline
against float64
transcriptions of verl 0.9.1's code (verl/trainer/ppo/core_algos.py, verl/utils/groupwise.py), on fresh random
batches with the edge cases: singleton groups, groups whose scores all agree, an all-masked row, length-1
responses, an odd batch size, string uids (numeric-looking ones too)."""

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pyrl.algos import get_adv_estimator_fn
from pyrl.config import AlgorithmConfig
from pyrl.protocol import DataProto
from pyrl.trainer.ppo_trainer import compute_advantage

f64 = torch.float64


# ---- verl 0.9.1, transcribed in float64 ----
def verl_masked_whiten(values, mask):
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    var = ((values - mean) ** 2 * mask).sum() / (mask.sum() + 1e-8)
    var = var * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """compute_grpo_outcome_advantage (the loop version)."""
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0, dtype=f64), torch.tensor(1.0, dtype=f64)
        else:
            id2mean[idx], id2std[idx] = torch.mean(torch.stack(id2score[idx])), torch.std(torch.stack(id2score[idx]))
    for i in range(scores.shape[0]):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores.unsqueeze(-1) * response_mask


def verl_reinforce_plus_plus(token_level_rewards, response_mask, gamma):
    """compute_reinforce_plus_plus_outcome_advantage: masked (tool output) tokens carry the return through."""
    returns = torch.zeros_like(token_level_rewards)
    running_return = 0
    for t in reversed(range(token_level_rewards.shape[1])):
        new_running_return = token_level_rewards[:, t] + gamma * running_return
        returns[:, t] = new_running_return * response_mask[:, t]
        running_return = new_running_return * response_mask[:, t] + running_return * (1 - response_mask[:, t])
    return verl_masked_whiten(returns, response_mask) * response_mask, returns


def verl_as_torch_index(index):
    """as_torch_index for a numpy array of labels: integers (or strings that parse as integers) as they are,
    anything else factorized."""
    arr = np.asarray(index, dtype=object)
    try:
        return torch.from_numpy(arr.astype(np.int64))
    except (TypeError, ValueError):
        return torch.from_numpy(np.unique(arr, return_inverse=True)[1].astype(np.int64))


def verl_grpo_vectorized(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """compute_grpo_vectorized_outcome_advantage with group_mean_std(eps=0.0)."""
    scores = token_level_rewards.sum(dim=-1)
    g = verl_as_torch_index(index)
    _, g = torch.unique(g, return_inverse=True)  # group_mean_std sizes its tables by max(g) + 1: same values
    count = torch.zeros(int(g.max()) + 1, dtype=f64).index_add_(0, g, torch.ones_like(scores))
    mean = torch.zeros_like(count).index_add_(0, g, scores) / count.clamp_min(1.0)
    centered = scores - mean[g]
    var = torch.zeros_like(count).index_add_(0, g, centered * centered) / (count - 1.0).clamp_min(1.0)
    std = torch.sqrt(torch.clamp(var, min=0.0))
    single = count <= 1.0
    mean[single], std[single] = 0.0, 1.0
    scalars = (scores - mean[g]) / (std[g] + epsilon) if norm_adv_by_std_in_grpo else scores - mean[g]
    return scalars.unsqueeze(-1) * response_mask


def verl_rloo_vectorized(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    inv = torch.from_numpy(np.unique(index, return_inverse=True)[1])
    c = torch.bincount(inv)[inv].to(scores.dtype)
    adv = ((c * scores - torch.bincount(inv, weights=scores)[inv]) / (c - 1).clamp_min(1)) * (c > 1)
    return adv.unsqueeze(-1) * response_mask


def verl_gdpo(token_level_rewards, response_mask, index, config, non_tensor_batch, batch, epsilon=1e-6,
              norm_adv_by_std_in_grpo=True):
    """compute_gdpo_outcome_advantage: each component placed on the last valid token (from the attention mask),
    GRPO per component, weighted sum, masked whitening."""
    prompt_length = batch["prompts"].size(1)
    valid_response_length = batch["attention_mask"][:, prompt_length:].sum(dim=1) - 1
    score_list = []
    for key in config.gdpo_reward_keys:
        rm_score = torch.tensor(np.asarray(non_tensor_batch[key], dtype=np.float32), dtype=f64)
        rm_scores = torch.zeros_like(response_mask, dtype=f64)
        rm_scores[torch.arange(rm_scores.size(0)), valid_response_length] = rm_score
        score_list.append(rm_scores)
    weights = config.gdpo_reward_weights or [1.0] * len(score_list)
    new_advantage = sum(w * verl_grpo(s, response_mask, index, epsilon, norm_adv_by_std_in_grpo)
                        for w, s in zip(weights, score_list))
    return verl_masked_whiten(new_advantage, response_mask) * response_mask


def _w_cumulative(response_mask, old_log_probs, sum_pi_squared, rollout_is_weights):
    w_per_timestep = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w_per_timestep = w_per_timestep * (rollout_is_weights**2)
    return (w_per_timestep * response_mask).cumsum(dim=-1)


def _zero_tail(baselines, response_lengths, trajectory_indices, row):
    sorted_lengths, _ = torch.sort(response_lengths)
    max_length, second_max_length = int(sorted_lengths[-1].item()), int(sorted_lengths[-2].item())
    max_length_idx = (response_lengths == max_length).nonzero(as_tuple=True)[0]
    if max_length_idx.numel() == 1 and max_length > second_max_length:
        baselines[row(trajectory_indices[int(max_length_idx[0])]), second_max_length:] = 0.0


def verl_otb(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=None,
             handle_zero_tail=True, epsilon=1e-8):
    """compute_optimal_token_baseline_advantage."""
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w_cumulative = _w_cumulative(response_mask, old_log_probs, sum_pi_squared, rollout_is_weights)
    prompt_groups = defaultdict(list)
    for i in range(returns.shape[0]):
        prompt_groups[index[i]].append(i)
    baselines = torch.zeros_like(returns)
    for trajectory_indices in prompt_groups.values():
        N = len(trajectory_indices)
        if N == 1:
            continue
        traj_idx = torch.tensor(trajectory_indices)
        mask_group = response_mask[traj_idx]
        numerator = (returns[traj_idx] * w_cumulative[traj_idx] * mask_group).sum(dim=0)
        denominator = (w_cumulative[traj_idx] * mask_group).sum(dim=0) + epsilon
        baselines[traj_idx] = (numerator / denominator).unsqueeze(0).expand(N, -1)
        if handle_zero_tail:
            _zero_tail(baselines, mask_group.sum(dim=-1), trajectory_indices, lambda i: i)
    return (returns - baselines) * response_mask, returns


def verl_tir_otb(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=None,
                 handle_zero_tail=True, epsilon=1e-8):
    """compute_multi_turn_optimal_token_baseline_advantage."""
    token_returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w_cumulative = _w_cumulative(response_mask, old_log_probs, sum_pi_squared, rollout_is_weights)
    response_lengths = response_mask.sum(dim=-1).to(dtype=torch.long)
    max_response_length = int(response_lengths.max().item())
    all_w_values = w_cumulative.new_zeros((len(response_lengths), max_response_length))
    all_returns = torch.zeros_like(all_w_values)
    for i in range(len(response_lengths)):
        length = int(response_lengths[i].item())
        if length:
            all_w_values[i, :length] = w_cumulative[i, response_mask[i].bool()]
            all_returns[i, :length] = token_returns[i, response_mask[i].bool()]
    prompt_groups = defaultdict(list)
    for i in range(len(response_lengths)):
        if response_lengths[i] != 0:
            prompt_groups[index[i]].append(i)
    baselines = torch.zeros_like(all_returns)
    for trajectory_indices in prompt_groups.values():
        traj_idx = torch.tensor(trajectory_indices)
        if len(trajectory_indices) == 1:
            continue
        w_group, R_group = all_w_values[traj_idx], all_returns[traj_idx]
        baselines[traj_idx] = (R_group * w_group).sum(dim=0) / (w_group.sum(dim=0) + epsilon)
        if handle_zero_tail:
            _zero_tail(baselines, response_lengths[traj_idx], trajectory_indices, lambda i: i)
    all_advantages = all_returns - baselines
    advantages = torch.zeros_like(token_returns)
    for i in range(len(response_lengths)):
        if response_lengths[i]:
            advantages[i, response_mask[i].bool()] = all_advantages[i, : response_lengths[i]]
    return advantages * response_mask, token_returns


# ---- batches ----
# 15 rows (odd): a singleton ("7"), a pair whose scores agree ("p-pair"), groups of 3 and 4 with an all-masked row
# and length-1 responses, a pair of which one is all-masked ("c": a group of one for the multi-turn OTB),
# numeric-looking uids ("7", "12") beside others
UIDS = np.array(["a-1", "a-1", "a-1", "7", "p-pair", "p-pair", "12", "12", "12", "12", "b", "b", "b", "c", "c"],
                dtype=object)
LENGTHS = [5, 1, 7, 3, 4, 4, 0, 1, 6, 6, 7, 2, 1, 0, 3]


def outcome_batch(seed, width=7):
    g = torch.Generator().manual_seed(seed)
    rows = len(UIDS)
    mask = (torch.arange(width)[None] < torch.tensor(LENGTHS)[:, None]).to(torch.float32)
    scores = torch.randint(0, 3, (rows,), generator=g).float() + 0.25 * torch.randn(rows, generator=g)
    scores[5] = scores[4]  # the pair agrees
    rewards = torch.zeros(rows, width)
    last = (mask.sum(-1).long() - 1).clamp(min=0)
    rewards[torch.arange(rows), last] = scores  # the all-masked row keeps its score on column 0 (summed alike)
    return rewards, mask


def otb_batch(seed, width=9, holes=False):
    """Dense token rewards, old log-probs and a consistent sum of pi^2 (>= pi^2), response lengths with a unique
    longest in some groups and ties in others; `holes`: multi-turn masks (tool output tokens masked out)."""
    g = torch.Generator().manual_seed(seed)
    rows = len(UIDS)
    lengths = torch.tensor([5, 1, 9, 3, 4, 4, 0, 1, 6, 6, 9, 2, 1, 0, 3])
    mask = (torch.arange(width)[None] < lengths[:, None]).to(torch.float32)
    if holes:
        mask[2, 3:5] = 0
        mask[8, 1] = 0
        mask[10, 6:8] = 0
    rewards = torch.randn(rows, width, generator=g) * (torch.rand(rows, width, generator=g) < 0.3) * mask
    last = mask.cumsum(-1).argmax(-1)  # and an outcome reward on each response's last valid token
    rewards[torch.arange(rows), last] += torch.randn(rows, generator=g) * mask[torch.arange(rows), last]
    old_log_probs = -torch.rand(rows, width, generator=g) * 3
    pi = old_log_probs.exp()
    sum_pi_squared = pi**2 + (1 - pi) ** 2 * torch.rand(rows, width, generator=g)
    rollout_is_weights = 0.5 + torch.rand(rows, width, generator=g)
    return rewards, mask, old_log_probs, sum_pi_squared, rollout_is_weights


def close(actual, expected, atol=1e-5):
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=1e-5)


# ---- the estimators ----
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_vectorized_matches_verl(fresh_seed, norm):
    rewards, mask = outcome_batch(fresh_seed)
    adv, ret = get_adv_estimator_fn("grpo_vectorized")(rewards, mask, UIDS, norm_adv_by_std_in_grpo=norm)
    expected = verl_grpo_vectorized(rewards.double(), mask.double(), UIDS, norm_adv_by_std_in_grpo=norm)
    close(adv, expected)
    assert torch.equal(adv, ret)
    singleton = rewards[3].sum().item()
    assert adv[3, 0] == pytest.approx(singleton / (1 + 1e-6) if norm else singleton)  # mean 0, std 1
    assert (adv[4:6] == 0).all()  # the pair agrees
    # the same numbers as the loop version, singletons included
    close(adv, verl_grpo(rewards.double(), mask.double(), UIDS, norm_adv_by_std_in_grpo=norm))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus_matches_verl(fresh_seed, gamma, holes):
    rewards, mask, *_ = otb_batch(fresh_seed, holes=holes)
    adv, ret = get_adv_estimator_fn("reinforce_plus_plus")(rewards, mask, gamma=gamma)
    expected_adv, expected_ret = verl_reinforce_plus_plus(rewards.double(), mask.double(), gamma)
    close(ret, expected_ret)
    close(adv, expected_adv)


def test_reinforce_plus_plus_carries_the_return_over_tool_output():
    """An outcome reward of 1 after a masked (tool output) token reaches the tokens before it undiscounted by the
    masked one, and the masked token's own reward is dropped."""
    rewards = torch.tensor([[0.0, 5.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    _, ret = get_adv_estimator_fn("reinforce_plus_plus")(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.0, 0.5, 1.0]]))


def test_rloo_vectorized_matches_verl(fresh_seed):
    rewards, mask = outcome_batch(fresh_seed)
    adv, ret = get_adv_estimator_fn("rloo_vectorized")(rewards, mask, UIDS)
    close(adv, verl_rloo_vectorized(rewards.double(), mask.double(), UIDS))
    assert torch.equal(adv, ret)
    assert (adv[3] == 0).all()  # the vectorized version zeroes a singleton; the loop `rloo` keeps its score
    loop, _ = get_adv_estimator_fn("rloo")(rewards, mask, UIDS)
    assert loop[3, 0] == rewards[3].sum()
    torch.testing.assert_close(adv[torch.arange(15) != 3], loop[torch.arange(15) != 3], atol=1e-6, rtol=1e-6)


def gdpo_inputs(seed, weights):
    g = torch.Generator().manual_seed(seed)
    rewards, mask = outcome_batch(seed)
    rows, prompt_width = mask.shape[0], 4
    components = {"format_reward": (torch.rand(rows, generator=g) < 0.5).float().numpy().astype(object),
                  "accuracy_reward": (3 * torch.randn(rows, generator=g)).numpy().astype(object).tolist()}
    components["format_reward"][4] = components["format_reward"][5]  # the pair also agrees on a component
    non_tensor_batch = {"uid": UIDS, **{k: np.asarray(v, dtype=object) for k, v in components.items()}}
    prompts = torch.ones(rows, prompt_width, dtype=torch.long)
    batch = {"prompts": prompts, "attention_mask": torch.cat([torch.ones(rows, prompt_width), mask], -1).long()}
    config = AlgorithmConfig(adv_estimator="gdpo", gdpo_reward_keys=list(components), gdpo_reward_weights=weights)
    return rewards, mask, non_tensor_batch, batch, config


@pytest.mark.parametrize("weights", [None, [0.3, 2.0]])
@pytest.mark.parametrize("norm", [True, False])
def test_gdpo_matches_verl(fresh_seed, weights, norm):
    rewards, mask, non_tensor_batch, batch, config = gdpo_inputs(fresh_seed, weights)
    adv, ret = get_adv_estimator_fn("gdpo")(rewards, mask, UIDS, norm_adv_by_std_in_grpo=norm, config=config,
                                            non_tensor_batch=non_tensor_batch)
    expected = verl_gdpo(rewards.double(), mask.double(), UIDS, config, non_tensor_batch, batch,
                         norm_adv_by_std_in_grpo=norm)
    close(adv, expected)
    assert torch.equal(adv, ret)
    assert (adv[6] == 0).all()  # the all-masked row


def test_gdpo_without_config_is_grpo_whitened(fresh_seed):
    """verl's fallback when called without config / non_tensor_batch: the one component token_level_rewards."""
    rewards, mask = outcome_batch(fresh_seed)
    adv, _ = get_adv_estimator_fn("gdpo")(rewards, mask, UIDS)
    grpo = verl_grpo(rewards.double(), mask.double(), UIDS)
    close(adv, verl_masked_whiten(grpo, mask.double()) * mask.double())


def test_gdpo_names_what_is_missing(fresh_seed):
    rewards, mask, non_tensor_batch, _, config = gdpo_inputs(fresh_seed, None)
    fn = get_adv_estimator_fn("gdpo")
    del non_tensor_batch["accuracy_reward"]
    with pytest.raises(KeyError, match="'accuracy_reward'.*gdpo_reward_keys"):
        fn(rewards, mask, UIDS, config=config, non_tensor_batch=non_tensor_batch)
    with pytest.raises(ValueError, match="algorithm.gdpo_reward_keys must list"):
        fn(rewards, mask, UIDS, config=AlgorithmConfig(), non_tensor_batch=non_tensor_batch)
    config.gdpo_reward_keys, config.gdpo_reward_weights = ["format_reward"], [1.0, 2.0]
    with pytest.raises(ValueError, match="2 algorithm.gdpo_reward_weights for 1 gdpo_reward_keys"):
        fn(rewards, mask, UIDS, config=config, non_tensor_batch=non_tensor_batch)


@pytest.mark.parametrize("name,verl_fn,holes", [("optimal_token_baseline", verl_otb, False),
                                                 ("optimal_token_baseline", verl_otb, True),
                                                 ("tir_optimal_token_baseline", verl_tir_otb, False),
                                                 ("tir_optimal_token_baseline", verl_tir_otb, True)])
@pytest.mark.parametrize("with_is", [False, True])
@pytest.mark.parametrize("zero_tail", [True, False])
def test_optimal_token_baseline_matches_verl(fresh_seed, name, verl_fn, holes, with_is, zero_tail):
    rewards, mask, old_log_probs, sum_pi_squared, is_weights = otb_batch(fresh_seed, holes=holes)
    is_weights = is_weights if with_is else None
    adv, ret = get_adv_estimator_fn(name)(rewards, mask, UIDS, old_log_probs=old_log_probs,
                                          sum_pi_squared=sum_pi_squared, rollout_is_weights=is_weights,
                                          handle_zero_tail=zero_tail)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    expected_adv, expected_ret = verl_fn(d(rewards), d(mask), UIDS, d(old_log_probs), d(sum_pi_squared), d(is_weights),
                                         handle_zero_tail=zero_tail)
    close(adv, expected_adv)
    close(ret, expected_ret)
    torch.testing.assert_close(adv[3], (ret[3] * mask[3]))  # the singleton: no baseline
    assert (adv[6] == 0).all()  # the all-masked row


def test_optimal_token_baseline_zero_tail_by_hand():
    """Two responses of lengths 3 and 1 with the outcome reward on their last token and w = 1 everywhere
    (pi = 0.5, sum pi^2 = 0.5): W = 1, 2, 3; column 0 gets the mean of the two returns, the longer response keeps
    its return from column 1 on (past the shorter one's length)."""
    rewards = torch.tensor([[0.0, 0.0, 2.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    logp, spp = torch.full((2, 3), np.log(0.5)), torch.full((2, 3), 0.5)
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        adv, ret = get_adv_estimator_fn(name)(rewards, mask, ["g", "g"], old_log_probs=logp, sum_pi_squared=spp)
        baseline = (2.0 + 4.0) / (2 + 1e-8)
        torch.testing.assert_close(adv, torch.tensor([[2.0 - baseline, 2.0, 2.0], [4.0 - baseline, 0.0, 0.0]]))
        torch.testing.assert_close(ret, torch.tensor([[2.0, 2.0, 2.0], [4.0, 0.0, 0.0]]))


def test_tensor_uids_group_like_strings(fresh_seed):
    """A tensor index with arbitrary (large, negative) values groups as its distinct values."""
    rewards, mask, old_log_probs, sum_pi_squared, _ = otb_batch(fresh_seed)
    codes = {u: c for u, c in zip(dict.fromkeys(UIDS), [10**12, -5, 3, 0, 77, 8])}
    tensor_index = torch.tensor([codes[u] for u in UIDS])
    for name in ("rloo_vectorized", "optimal_token_baseline", "tir_optimal_token_baseline"):
        fn = get_adv_estimator_fn(name)
        kwargs = {"old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared}
        assert torch.equal(fn(rewards, mask, tensor_index, **kwargs)[0], fn(rewards, mask, UIDS, **kwargs)[0])


# ---- the trainer's compute_advantage ----
def trainer_batch(seed, **extra_tensors):
    rewards, mask, non_tensor_batch, _, _ = gdpo_inputs(seed, None)
    return DataProto.from_dict({"token_level_rewards": rewards, "response_mask": mask, **extra_tensors},
                               non_tensors=non_tensor_batch)


def test_compute_advantage_passes_gdpo_its_components_and_reports_them(fresh_seed):
    config = AlgorithmConfig(adv_estimator="gdpo", gdpo_reward_keys=["accuracy_reward", "format_reward"],
                             gdpo_reward_weights=[1.0, 0.5], norm_adv_by_std_in_grpo=False)
    batch = trainer_batch(fresh_seed)
    metrics = compute_advantage(batch, config)
    expected = get_adv_estimator_fn("gdpo")(batch.batch["token_level_rewards"], batch.batch["response_mask"], UIDS,
                                            norm_adv_by_std_in_grpo=False, config=config,
                                            non_tensor_batch=batch.non_tensor_batch)[0]
    assert torch.equal(batch.batch["advantages"], expected)
    accuracy = np.asarray(batch.non_tensor_batch["accuracy_reward"], dtype=np.float32)
    assert metrics["gdpo/accuracy_reward/max"] == pytest.approx(accuracy.max())
    assert set(metrics) == {f"gdpo/{k}/{s}" for k in ("accuracy_reward", "format_reward")
                            for s in ("mean", "std", "max", "min")}
    config.gdpo_reward_keys = ["length_reward"]
    with pytest.raises(KeyError, match="length_reward"):
        compute_advantage(trainer_batch(fresh_seed), config)


def test_compute_advantage_feeds_the_optimal_token_baseline(fresh_seed):
    rewards, mask, old_log_probs, sum_pi_squared, is_weights = otb_batch(fresh_seed, width=7)
    config = AlgorithmConfig(adv_estimator="optimal_token_baseline")
    batch = DataProto.from_dict({"token_level_rewards": rewards, "response_mask": mask, "old_log_probs": old_log_probs,
                                 "rollout_is_weights": is_weights}, non_tensors={"uid": UIDS})
    with pytest.raises(KeyError, match="calculate_sum_pi_squared=true"):
        compute_advantage(batch, config)
    batch.batch["sum_pi_squared"] = sum_pi_squared
    assert compute_advantage(batch, config) == {}
    expected = verl_otb(rewards.double(), mask.double(), UIDS, old_log_probs.double(), sum_pi_squared.double(),
                        is_weights.double())
    close(batch.batch["advantages"], expected[0])


def test_trainer_refuses_the_optimal_token_baseline_without_sum_pi_squared():
    """verl asserts at the first advantage computation; pyrl refuses the config before workers start."""
    from omegaconf import OmegaConf

    from pyrl.config import PPOConfig
    from pyrl.trainer.checks import check_names
    from pyrl.trainer.ppo_trainer import PPOTrainer
    from pyrl.trainer.run_plan import resolve_run_plan

    config = OmegaConf.to_object(OmegaConf.structured(PPOConfig))  # resolved, as the command line gives it
    config.algorithm.adv_estimator = "tir_optimal_token_baseline"
    config.data.train_batch_size = 2
    config.trainer.logger = ["console"]
    tokenizer = SimpleNamespace(pad_token_id=0)
    workers = SimpleNamespace(critic=None)
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.calculate_sum_pi_squared=true"):
        check_names(config)
    config.actor_rollout_ref.actor.calculate_sum_pi_squared = True
    check_names(config)
    trainer = PPOTrainer(config, tokenizer, list(range(4)), None, None, None, workers, resolve_run_plan(config))
    assert trainer.plan.runs("old_log_prob")  # the baseline needs the old-log-prob pass before the update
