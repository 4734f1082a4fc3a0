"""Critic and reward-model workers on 2 Ray processes over gloo, against single-process / HF references."""

import pytest
import torch
from worker_helpers import make_config, random_batch

from pyrl.controller import ResourcePool, WorkerGroup
from pyrl.workers.critic import CriticWorker
from pyrl.workers.reward_model import RewardModelWorker

ROWS = 6
CRITIC = ["critic.optim.lr=0.001", "critic.ppo_mini_batch_size=2", "critic.cliprange_value=0.05"]
SHARDED = make_config(*CRITIC, "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=16")
SINGLE = make_config(*CRITIC, "critic.ppo_micro_batch_size_per_gpu=1")


@pytest.fixture(scope="module")
def critic_group(ray_session):
    wg = WorkerGroup(ResourcePool([2]), CriticWorker, SHARDED.critic)
    wg.init_model()
    yield wg
    wg.kill()


def test_values_and_update_match_single_process(critic_group):
    single = CriticWorker(SINGLE.critic)
    single.init_model()
    batch = random_batch(ROWS, seed=11)
    values = critic_group.compute_values(batch).batch["values"]
    single_values = single.compute_values(batch).batch["values"]
    torch.testing.assert_close(values, single_values, atol=1e-5, rtol=0)
    assert torch.all(values[batch.batch["response_mask"] == 0] == 0)

    # reference for the values themselves: HF's token classifier output on the state before each response token
    with torch.no_grad():
        logits = single.value_model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                                    position_ids=batch.batch["position_ids"]).logits[:, -7:-1, 0]
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(values[mask], logits[mask], atol=1e-5, rtol=0)

    batch.batch["values"] = values
    batch.batch["returns"] = (torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(2))
                              * batch.batch["response_mask"])
    # mini-batch m of the 2 ranks: rows {m, 3 + m}; the single process takes mini-batches of 2 in this order
    metrics = critic_group.update_critic(batch).meta_info["metrics"]
    single_metrics = single.update_critic(batch.select_idxs([0, 3, 1, 4, 2, 5])).meta_info["metrics"]
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
        assert metrics[key][0] == pytest.approx(single_metrics[key], rel=1e-4, abs=1e-6), key
    assert 0 < metrics["critic/vf_clipfrac"][0] < 1
    after = critic_group.compute_values(batch).batch["values"]
    torch.testing.assert_close(after, single.compute_values(batch).batch["values"], atol=1e-4, rtol=0)
    assert (after - values).abs().max() > 1e-3


def test_reward_model_scores_the_last_token(ray_session, tiny_path):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = make_config("reward_model.enable=true", "reward_model.micro_batch_size_per_gpu=2",
                      "reward_model.model.path=pyrl:tiny")
    wg = WorkerGroup(ResourcePool([2]), RewardModelWorker, cfg.reward_model, "pyrl:tiny")
    try:
        wg.init_model()
        batch = random_batch(4, seed=12)
        scores = wg.compute_rm_score(batch).batch["rm_scores"]
    finally:
        wg.kill()
    config = AutoConfig.from_pretrained(tiny_path)
    config.num_labels = 1
    torch.manual_seed(0)  # the worker's score head starts from this seed
    model = AutoModelForSequenceClassification.from_pretrained(tiny_path, config=config, dtype=torch.float32)
    with torch.no_grad():  # HF's own pooling: the last non-padding token
        expected = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                         position_ids=batch.batch["position_ids"]).logits[:, 0]
    lengths = batch.batch["response_mask"].sum(-1)
    for i, length in enumerate(lengths.tolist()):
        row = scores[i]
        if length == 0:
            assert torch.all(row == 0)  # no response: nothing to score
            continue
        assert row[length - 1].item() == pytest.approx(expected[i].item(), abs=1e-5)
        assert torch.count_nonzero(row) <= 1
    # the padded path (use_remove_padding=false, one process) scores the same
    padded = RewardModelWorker(make_config("reward_model.enable=true", "reward_model.model.path=pyrl:tiny",
                                           "reward_model.model.use_remove_padding=false").reward_model, "pyrl:tiny")
    padded.init_model()
    torch.testing.assert_close(padded.compute_rm_score(batch).batch["rm_scores"], scores, atol=1e-5, rtol=0)


def test_reward_model_override_config_reaches_the_model(tiny_path):
    """reward_model.model.override_config changes the model's config as the actor's and critic's do (it was read
    nowhere): one layer instead of two, and a different score."""
    config = make_config("reward_model.enable=true", "reward_model.model.path=pyrl:tiny").reward_model
    config.model.override_config = {"num_hidden_layers": 1}
    worker = RewardModelWorker(config, "pyrl:tiny")
    worker.init_model()
    assert worker.scorer.classifier.config.num_hidden_layers == 1 and len(worker.scorer.body.layers) == 1


def test_critic_packed_equals_padded():
    """Values, loss metrics, gradients (Adam's first moment) and weights after one step: packed == padded, with a
    hole in the loss mask (a response token attended to but not trained on)."""
    batch = random_batch(ROWS, seed=13)
    mask = batch.batch["response_mask"].clone()
    mask[0, 3] = 0
    batch.batch["response_mask"] = mask
    g = torch.Generator().manual_seed(5)
    batch.batch["values"] = torch.randn(ROWS, 6, generator=g) * 0.1 * mask
    batch.batch["returns"] = torch.randn(ROWS, 6, generator=g) * mask
    out = {}
    for packed in (True, False):
        worker = CriticWorker(make_config(*CRITIC, "critic.ppo_mini_batch_size=6",
                                          "critic.ppo_micro_batch_size_per_gpu=4",
                                          f"critic.model.use_remove_padding={packed}").critic)
        worker.init_model()
        values = worker.compute_values(batch).batch["values"]
        metrics = worker.update_critic(batch).meta_info["metrics"]
        state = {name: p.detach().clone() for name, p in worker.critic.named_parameters()}
        moments = {name: worker.optimizer.state[p]["exp_avg"].clone() for name, p in worker.critic.named_parameters()}
        out[packed] = values, metrics, state, moments
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-5, rtol=0)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
        assert out[True][1][key] == pytest.approx(out[False][1][key], rel=1e-4, abs=1e-6), key
    assert 0 < out[True][1]["perf/mfu/critic"] < 1
    for name, moment in out[False][3].items():
        torch.testing.assert_close(out[True][3][name], moment, atol=1e-7, rtol=1e-4, msg=name)
        torch.testing.assert_close(out[True][2][name], out[False][2][name], atol=1e-5, rtol=0, msg=name)
