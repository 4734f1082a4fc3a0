"""The driver's own pieces of a PPO step, each against a hand-written reference on fresh random batches:
KL in the reward (fixed and adaptive beta), DAPO's group filter, balancing across ranks, the data metrics
and verl's validation summary (bootstrap best/worst/maj@N)."""

from collections import defaultdict

import numpy as np
import pytest
import torch

from pyrl.algos import get_kl_controller
from pyrl.config import KLControlConfig
from pyrl.protocol import DataProto
from pyrl.trainer import metrics as M
from pyrl.trainer.ppo_trainer import apply_kl_penalty, balance_batch, filter_groups


def random_batch(rows=7, prompt_width=5, response_width=6, empty_rows=(2,), uids=None) -> DataProto:
    """Left-padded prompts, right-padded responses (rows in `empty_rows` have none), an outcome score on
    each response's last token, log-probs of a policy and a reference."""
    prompt_lengths = torch.randint(1, prompt_width + 1, (rows,))
    response_lengths = torch.randint(1, response_width + 1, (rows,))
    response_lengths[list(empty_rows)] = 0
    prompt_mask = torch.arange(prompt_width).flip(0)[None] < prompt_lengths[:, None]
    response_mask = torch.arange(response_width)[None] < response_lengths[:, None]
    scores = torch.zeros(rows, response_width)
    outcome = torch.randint(0, 3, (rows,)).float() - 1
    has = response_lengths > 0
    scores[has, response_lengths[has] - 1] = outcome[has]
    uids = uids if uids is not None else [f"u{i // 2}" for i in range(rows)]
    return DataProto.from_dict({
        "attention_mask": torch.cat([prompt_mask, response_mask], -1).long(),
        "response_mask": response_mask.long(),
        "token_level_scores": scores,
        "old_log_probs": -torch.rand(rows, response_width) * 3,
        "ref_log_prob": -torch.rand(rows, response_width) * 3,
        "advantages": torch.randn(rows, response_width) * response_mask,
        "returns": torch.randn(rows, response_width) * response_mask,
        "values": torch.randn(rows, response_width) * response_mask,
        "row": torch.arange(rows),
    }, non_tensors={"uid": np.asarray(uids, dtype=object)})


@pytest.mark.parametrize("kind", ["kl", "low_var_kl"])
@pytest.mark.parametrize("ctrl", ["fixed", "adaptive"])
def test_kl_in_reward_matches_float64_and_updates_beta(kind, ctrl):
    batch = random_batch()
    controller = get_kl_controller(KLControlConfig(type=ctrl, kl_coef=0.05, target_kl=0.01, horizon=100))
    metrics = apply_kl_penalty(batch, controller, kind)

    old, ref = batch.batch["old_log_probs"].double(), batch.batch["ref_log_prob"].double()
    mask = batch.batch["response_mask"].double()
    delta = old - ref
    kl = delta if kind == "kl" else (torch.exp(-delta) + delta - 1).clamp(-10, 10)
    kl = kl * mask
    want_rewards = batch.batch["token_level_scores"].double() - 0.05 * kl
    torch.testing.assert_close(batch.batch["token_level_rewards"].double(), want_rewards, rtol=1e-6, atol=1e-6)
    row_means = [kl[i, mask[i] > 0].mean().item() if mask[i].sum() else 0.0 for i in range(len(batch))]  # empty row: 0
    current = float(np.mean(row_means))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current, rel=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.05  # the beta this step used
    if ctrl == "fixed":
        assert controller.value == 0.05
    else:  # Ziegler et al.: beta (1 + clip(kl / target - 1, +-0.2) * n / horizon)
        error = min(max(current / 0.01 - 1, -0.2), 0.2)
        assert controller.value == pytest.approx(0.05 * (1 + error * len(batch) / 100), rel=1e-6)


def test_adaptive_beta_falls_when_kl_is_under_target():
    controller = get_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.1, target_kl=1.0, horizon=10))
    controller.update(0.5, n_steps=2)  # error -0.5 clipped to -0.2
    assert controller.value == pytest.approx(0.1 * (1 - 0.2 * 2 / 10))
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.type"):
        get_kl_controller(KLControlConfig(type="pid"))


def test_filter_groups_keeps_exactly_the_groups_whose_scores_differ():
    # c is a singleton group: kept, as verl 0.9.1's replay buffer keeps it (it filters len > 1 and std == 0 only);
    # dropping it made rollout.n=1 with dynamic sampling generate forever
    uids = ["a", "a", "a", "b", "b", "c", "d", "d"]
    batch = random_batch(rows=8, empty_rows=(), uids=uids)
    outcome = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 1.0, -1.0, 2.0])
    batch.batch["token_level_scores"] = torch.zeros(8, 6)
    batch.batch["token_level_scores"][:, 0] = outcome
    kept = filter_groups(batch, "reward")
    assert kept.batch["row"].tolist() == [0, 1, 2, 5, 6, 7]
    assert list(kept.non_tensor_batch["uid"]) == ["a", "a", "a", "c", "d", "d"]
    assert filter_groups(batch, "seq_reward").batch["row"].tolist() == [0, 1, 2, 5, 6, 7]

    batch.non_tensor_batch["acc"] = np.asarray([1, 1, 1, 0, 1, 0, 1, 1], dtype=object)  # a reward extra field
    assert filter_groups(batch, "acc").batch["row"].tolist() == [3, 4, 5]
    batch.non_tensor_batch["seq_reward"] = batch.non_tensor_batch["acc"]  # the reward function's own field wins
    assert filter_groups(batch, "seq_reward").batch["row"].tolist() == [3, 4, 5]
    with pytest.raises(KeyError, match="algorithm.filter_groups.metric: 'nope'"):
        filter_groups(batch, "nope")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_balance_batch_moves_whole_rows_into_equal_rank_chunks(world_size):
    # seeded: Karmarkar-Karp is a heuristic, so on some draws the naive split is as good or a token better; these
    # draws are fixed (unseeded, the batch depended on which tests ran before)
    torch.manual_seed(world_size)
    rows = 4 * world_size + 4
    batch = random_batch(rows=rows, prompt_width=9, response_width=17, empty_rows=())
    before = {int(r): batch.batch["attention_mask"][i].clone() for i, r in enumerate(batch.batch["row"])}
    lengths = batch.batch["attention_mask"].sum(-1)
    naive_spread = (max(int(c.sum()) for c in lengths.chunk(world_size))
                    - min(int(c.sum()) for c in lengths.chunk(world_size)))
    metrics = balance_batch(batch, world_size)

    assert sorted(batch.batch["row"].tolist()) == list(range(rows))  # a permutation
    for i, r in enumerate(batch.batch["row"].tolist()):  # every field moved with its row
        assert torch.equal(batch.batch["attention_mask"][i], before[r])
        assert batch.non_tensor_batch["uid"][i] == f"u{r // 2}"
    # what each rank gets
    sums = [int(chunk.sum()) for chunk in batch.batch["attention_mask"].sum(-1).chunk(world_size)]
    assert metrics["global_seqlen/min"] == min(sums) and metrics["global_seqlen/max"] == max(sums)
    assert metrics["global_seqlen/minmax_diff"] == max(sums) - min(sums) <= min(naive_spread, int(lengths.max()))
    assert metrics["global_seqlen/mean"] == pytest.approx(np.mean(sums))


@pytest.mark.parametrize("world_size", [1, 2])
def test_balance_batch_by_group_keeps_each_prompts_samples_together(world_size):
    """actor.use_prefix_grouper (verl's group-level balancing): whole uid groups move to a rank, rows together."""
    rows = 8 * world_size
    batch = random_batch(rows=rows, prompt_width=9, response_width=17, empty_rows=())  # uid u{row // 2}
    lengths = batch.batch["attention_mask"].sum(-1)
    group_sums = {f"u{g}": int(lengths[2 * g:2 * g + 2].sum()) for g in range(rows // 2)}
    metrics = balance_batch(batch, world_size, by_group=True)
    uids = list(batch.non_tensor_batch["uid"])
    assert sorted(batch.batch["row"].tolist()) == list(range(rows))
    assert all(uids[i] == uids[i + 1] for i in range(0, rows, 2))  # each group's two rows adjacent
    chunks = [uids[k * rows // world_size:(k + 1) * rows // world_size] for k in range(world_size)]
    sums = [sum(group_sums[u] for u in set(chunk)) for chunk in chunks]
    assert metrics["global_seqlen/minmax_diff"] == max(sums) - min(sums)
    assert metrics["global_seqlen/minmax_diff"] <= max(group_sums.values())  # balanced to within one group
    # 5 groups cannot split evenly over 2 ranks: the rows are balanced instead, as without by_group
    odd, plain = (random_batch(rows=10, prompt_width=9, response_width=17, empty_rows=()) for _ in range(2))
    plain.batch["attention_mask"] = odd.batch["attention_mask"].clone()
    assert balance_batch(odd, 2, by_group=True) == balance_batch(plain, 2)
    assert torch.equal(odd.batch["row"], plain.batch["row"])


def test_data_metrics_by_hand():
    batch = random_batch(rows=9, empty_rows=(2, 5))
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"] - 0.1 * batch.batch["response_mask"]
    batch.batch["response_mask"][0] = 1  # one response that used every position: clipped
    batch.batch["attention_mask"][0, 5:] = 1
    got = M.compute_data_metrics(batch, use_critic=True)

    b = {k: v.double().numpy() for k, v in batch.batch.items()}
    resp_mask, resp_len = b["response_mask"] > 0, b["response_mask"].sum(-1)
    prompt_len = b["attention_mask"][:, :5].sum(-1)
    live = resp_len > 0
    want = {}
    for name, values in {"critic/score": b["token_level_scores"].sum(-1)[live],
                         "critic/rewards": b["token_level_rewards"].sum(-1)[live],
                         "critic/advantages": b["advantages"][resp_mask], "critic/returns": b["returns"][resp_mask],
                         "critic/values": b["values"][resp_mask], "response_length": resp_len,
                         "response_length_non_aborted": resp_len[live], "prompt_length": prompt_len}.items():
        want.update({f"{name}/mean": values.mean(), f"{name}/max": values.max(), f"{name}/min": values.min()})
    returns, values = b["returns"][resp_mask], b["values"][resp_mask]
    want["critic/vf_explained_var"] = 1 - np.var(returns - values, ddof=1) / (np.var(returns, ddof=1) + 1e-5)
    want["response_length/clip_ratio"] = np.mean(resp_len == 6)
    want["response_length_non_aborted/clip_ratio"] = np.mean(resp_len[live] == 6)
    want["prompt_length/clip_ratio"] = np.mean(prompt_len == 5)
    want["response/aborted_ratio"] = 2 / 9
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def verl_validation_reference(data_sources, uids, infos, seed=42):
    """verl's process_validation_metrics + _validate's naming, loop for loop: the global numpy RNG reseeded
    per bootstrap, np.random.choice per subset, majority by counting in a dict."""
    def bootstrap(data, size, reduce_fns):
        np.random.seed(seed)
        results = [[] for _ in reduce_fns]
        for _ in range(1000):
            subset = [data[i] for i in np.random.choice(len(data), size=size, replace=True)]
            for k, fn in enumerate(reduce_fns):
                results[k].append(fn(subset))
        return [(np.mean(r), np.std(r)) for r in results]

    def majority(subset):
        votes = defaultdict(list)
        for d in subset:
            votes[d["pred"]].append(d["val"])
        counts = {k: len(v) for k, v in votes.items()}
        return votes[max(counts, key=counts.get)][0]

    tree = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for i, (source, uid) in enumerate(zip(data_sources, uids)):
        for name, values in infos.items():
            tree[source][uid][name].append(values[i])
    summary = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for source, by_uid in tree.items():
        for uid, by_var in by_uid.items():
            for name, vals in by_var.items():
                if isinstance(vals[0], str):
                    continue
                n = len(vals)
                metric = {f"mean@{n}": np.mean(vals)}
                if n > 1:
                    metric[f"std@{n}"] = np.std(vals)
                    sizes, m = [], 2
                    while m < n:
                        sizes.append(m)
                        m *= 2
                    for m in sizes + [n]:
                        ((metric[f"best@{m}/mean"], metric[f"best@{m}/std"]),
                         (metric[f"worst@{m}/mean"], metric[f"worst@{m}/std"])) = \
                            bootstrap(vals, m, [np.max, np.min])
                        if "pred" in by_var:
                            votes = [{"val": v, "pred": p} for v, p in zip(vals, by_var["pred"])]
                            (metric[f"maj@{m}/mean"], metric[f"maj@{m}/std"]), = bootstrap(votes, m, [majority])
                for key, value in metric.items():
                    summary[source][name][key].append(value)
    out = {}
    for source, by_var in summary.items():
        core = "acc" if "acc" in by_var else "reward"
        for name, by_metric in by_var.items():
            n_max = max(int(key.split("@")[-1].split("/")[0]) for key in by_metric)
            for key, values in by_metric.items():
                section = ("val-core" if name == core and key.startswith(("mean", "maj", "best")) and f"@{n_max}" in key
                           else "val-aux")
                out[f"{section}/{source}/{name}/{key}"] = np.mean(values)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_validation_metrics_equal_verls(n):
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    prompts = 6
    sources = [("gsm8k" if p < 4 else "math") for p in range(prompts) for _ in range(n)]
    uids = [f"val-{p}" for p in range(prompts) for _ in range(n)]
    preds = [str(v) for v in rng.integers(0, 3, prompts * n)]
    infos = {"reward": rng.integers(0, 2, prompts * n).astype(float).tolist(),
             "acc": [p == "1" for p in preds],  # the scorer's own correctness: the core variable
             "pred": preds,
             "note": ["text"] * (prompts * n)}  # not numeric: not summarised
    got = M.validation_metrics(sources, uids, infos, response_lengths=[3] * len(uids))
    # verl 0.9.1 adds acc_success_only, acc over the samples whose rollout did not fail: here every one
    want = verl_validation_reference(sources, uids, {**{k: v for k, v in infos.items() if k != "note"},
                                                     "acc_success_only": infos["acc"]})
    want["val-aux/response_length/mean"] = 3.0
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert f"val-core/gsm8k/acc/mean@{n}" in got and f"val-aux/gsm8k/reward/mean@{n}" in got
    if n > 1:
        assert f"val-core/math/acc/best@{n}/mean" in got and f"val-core/math/acc/maj@{n}/mean" in got


def test_validation_metrics_by_hand():
    """n=1: mean@1 per source. n=2, prompt 0 scored [1, 1] and prompt 1 [0, 1] with no predictions (every
    vote ties, so a subset's first sample wins): a subset of prompt 1 has best 1 unless it drew 0 twice
    (p = 1/4), worst 0 unless it drew 1 twice, majority its first draw; prompt 0 gives 1 throughout."""
    got = M.validation_metrics(["a", "a", "b"], ["0", "1", "2"], {"reward": [1.0, 0.0, 1.0]}, [1, 2, 3])
    assert got == {"val-core/a/reward/mean@1": 0.5, "val-core/b/reward/mean@1": 1.0,
                   "val-aux/response_length/mean": 2.0}
    got = M.validation_metrics(["a"] * 4, ["0", "0", "1", "1"], {"reward": [1.0, 1.0, 0.0, 1.0], "pred": [None] * 4},
                               [1] * 4)
    assert got["val-core/a/reward/mean@2"] == 0.75 and got["val-aux/a/reward/std@2"] == 0.25
    assert got["val-core/a/reward/best@2/mean"] == pytest.approx((1 + 0.75) / 2, abs=0.03)
    assert got["val-aux/a/reward/worst@2/mean"] == pytest.approx((1 + 0.25) / 2, abs=0.03)
    assert got["val-core/a/reward/maj@2/mean"] == pytest.approx((1 + 0.5) / 2, abs=0.03)
