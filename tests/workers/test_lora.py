"""LoRA (PEFT) on the FSDP2 actor over 2 Ray processes: only the adapters train and are saved, the reference is the
base model with the adapters off, the rollout gets the merged weights, and one update equals a single-process
PEFT + plain-torch reference written out here (the PPO clipped loss by hand, torch's AdamW)."""

import json
import os

import pytest
import torch
from worker_helpers import hf_response_logprobs, make_config, random_batch, rollout_prompts

from pyrl.controller import ResourcePool, WorkerGroup
from pyrl.workers import lora
from pyrl.workers.actor import ActorRolloutRefWorker
from pyrl.workers.models import load_policy

ROWS, RANK, ALPHA, LR = 8, 4, 8, 0.01
LORA = [f"actor_rollout_ref.model.lora_rank={RANK}", f"actor_rollout_ref.model.lora_alpha={ALPHA}",
        f"actor_rollout_ref.actor.optim.lr={LR}", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.rollout.calculate_log_probs=true"]
CONFIG = make_config(*LORA)


@pytest.fixture(scope="module")
def group(ray_session):
    wg = WorkerGroup(ResourcePool([2]), ActorRolloutRefWorker, CONFIG.actor_rollout_ref, "actor_rollout_ref")
    wg.init_model()
    yield wg
    wg.kill()


def lora_update_reference(tiny_path, adapters: dict, batch, minis, clip=0.2, clip_c=3.0):
    """The LoRA params after one PPO update: PEFT's LoRA on the HF model, verl's vanilla clipped loss (dual clip
    for negative advantages) as a token mean over each mini-batch, grad-norm clip at 1, AdamW: plain torch."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32),
                           LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in adapters.items():
            params[f"base_model.model.{name}"].copy_(value)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999), weight_decay=0.01)
    width = batch.batch["responses"].shape[1]
    for rows in minis:
        mb = batch.select_idxs(rows).batch
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                       position_ids=mb["position_ids"]).logits[:, -width - 1:-1]
        logp = logits.log_softmax(-1).gather(-1, mb["responses"].unsqueeze(-1)).squeeze(-1)
        ratio, adv, mask = (logp - mb["old_log_probs"]).exp(), mb["advantages"], mb["response_mask"].float()
        clipped = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
        pg = torch.where(adv < 0, torch.minimum(clipped, -adv * clip_c), clipped)
        kl = mb["ref_log_prob"] - logp  # verl's low_var_kl, clamped at +-10
        kl = (kl.exp() - kl - 1).clamp(-10, 10)
        loss = ((pg + 0.001 * kl) * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
    return {name.removeprefix("base_model.model."): p.detach()
            for name, p in model.named_parameters() if p.requires_grad}


def adapters_of(digest: dict) -> dict:
    return {name: value for name, value in digest["params"].items() if ".lora_" in name}


def test_merged_weights_and_disabled_adapters_single_process(tiny_path):
    """merged_state_items equals PEFT's own merge_and_unload; with the adapters off the model is the base model."""
    import copy

    from transformers import AutoModelForCausalLM

    config = make_config(*LORA).actor_rollout_ref.model
    lm, policy = load_policy(config)
    peft_model = lora.add_adapters(lm, config, "CAUSAL_LM", "actor_rollout_ref.model")
    assert peft_model.base_model.model is lm
    with torch.no_grad():
        for name, p in policy.named_parameters():
            assert p.requires_grad == (".lora_" in name), name
            if "lora_B" in name:
                p.normal_()  # B starts at zero: give the adapters an effect
    merged = dict(lora.merged_state_items(policy, "lm."))
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(merged[name], value, atol=1e-6, rtol=0, msg=name)
    x = torch.randint(3, 280, (3, 7), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    with torch.no_grad():
        with lora.adapters_disabled(peft_model):
            off = lm(x).logits
        on = lm(x).logits
        torch.testing.assert_close(off, base(x).logits, atol=0, rtol=0)
    assert (on - off).abs().max() > 0.1


@pytest.mark.parametrize("keys, message", [
    ({"lora_rank": -1}, "lora_rank: expected >= 0"),
    ({"lora_rank": 0, "lora_adapter_path": "/x"}, "lora_adapter_path is set but"),
    ({"lora_alpha": 0}, "lora_alpha: expected > 0"),
    ({"lora_adapter_path": "/nonexistent"}, "not a PEFT adapter directory"),
])
def test_bad_lora_keys_are_named(keys, message):
    import dataclasses

    config = dataclasses.replace(make_config(*LORA).actor_rollout_ref.model, **keys)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        lora.check_lora_config(config, "actor_rollout_ref.model", "CAUSAL_LM")


@pytest.mark.parametrize("targets", [["embed_tokens", "q_proj"], ["lm_head"]])
def test_unsupported_targets_are_refused(targets):
    config = make_config(*LORA, f"actor_rollout_ref.model.target_modules=[{','.join(targets)}]").actor_rollout_ref.model
    lm, _ = load_policy(config)
    with pytest.raises(ValueError, match="actor_rollout_ref.model.target_modules: LoRA on"):
        lora.add_adapters(lm, config, "CAUSAL_LM", "actor_rollout_ref.model")


def test_update_equals_peft_reference_and_ref_stays_base(group, tiny_path):
    batch = random_batch(ROWS, seed=11)
    base_logp, _ = hf_response_logprobs(tiny_path, batch)
    mask = batch.batch["response_mask"].bool()
    old = group.compute_log_prob(batch).batch["old_log_probs"]
    torch.testing.assert_close(old[mask].double(), base_logp[mask], atol=1e-5, rtol=0)  # B = 0: the base model
    batch.union(group.compute_ref_log_prob(batch))
    g = torch.Generator().manual_seed(12)
    batch.batch["old_log_probs"] = old + 0.3 * torch.randn(ROWS, 6, generator=g)
    batch.batch["advantages"] = torch.randn(ROWS, 6, generator=g) * batch.batch["response_mask"]
    before = group.state_digest()[0]
    group.update_actor(batch)
    after = group.state_digest()[0]
    # frozen: every base weight; trained: every adapter (A moves from the second mini-batch on, once B != 0)
    for name, value in before["params"].items():
        moved = not torch.equal(after["params"][name], value)
        assert moved == (".lora_" in name), name
    assert set(after["optimizer"]) == {f"lm.{n}.{k}" for n in adapters_of(after)
                                       for k in ("step", "exp_avg", "exp_avg_sq")}
    # rank r holds rows [4r, 4r + 4) and mini-batch m is rows 4r + 2m, 4r + 2m + 1 of each rank
    expected = lora_update_reference(tiny_path, adapters_of(before), batch, [[0, 1, 4, 5], [2, 3, 6, 7]])
    for name, value in expected.items():
        torch.testing.assert_close(after["params"][name], value, atol=2e-5, rtol=0, msg=name)
    # the reference policy is the base model still, the actor is not
    ref_after = group.compute_ref_log_prob(batch).batch["ref_log_prob"]
    torch.testing.assert_close(ref_after[mask].double(), base_logp[mask], atol=1e-5, rtol=0)
    assert (group.compute_log_prob(batch).batch["old_log_probs"] - old)[mask].abs().max() > 1e-3


def test_rollout_generates_with_the_merged_weights(group):
    group.update_weights()
    out = group.generate_sequences(rollout_prompts(4, seed=5))
    logp = group.compute_log_prob(out).batch["old_log_probs"]
    mask = out.batch["response_mask"].bool()
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], logp[mask], atol=1e-4, rtol=0)


def test_checkpoint_holds_the_adapters_only_and_merges(group, tiny_path, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from pyrl.model_merger import main as merger

    group.save_checkpoint(str(tmp_path / "ckpt"))
    saved = group.state_digest()[0]
    metadata = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    model_keys = [k for k in metadata if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys)  # no base weight in the shards
    with open(tmp_path / "ckpt" / "lora_adapter" / "adapter_config.json") as f:
        adapter = json.load(f)
    assert adapter["r"] == RANK and adapter["lora_alpha"] == ALPHA and os.path.samefile(
        adapter["base_model_name_or_path"], tiny_path)

    batch = random_batch(ROWS, seed=13)
    batch.batch["old_log_probs"] = group.compute_log_prob(batch).batch["old_log_probs"]
    batch.union(group.compute_ref_log_prob(batch))
    batch.batch["advantages"] = torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(14))
    group.update_actor(batch)
    group.load_checkpoint(str(tmp_path / "ckpt"))
    restored = group.state_digest()[0]
    for name, value in saved["params"].items():
        assert torch.equal(restored["params"][name], value), name
    for name, value in saved["optimizer"].items():
        assert torch.equal(torch.as_tensor(restored["optimizer"][name]), torch.as_tensor(value)), name

    # the merger writes base + (alpha / r) B @ A, computed here from the saved weights
    merger(["merge", "--backend", "fsdp", "--local_dir", str(tmp_path / "ckpt"), "--target_dir", str(tmp_path / "hf")])
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).state_dict()
    params = saved["params"]
    for name, value in base.items():
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.default.weight" in params:
            a, b = params[f"{module}.lora_A.default.weight"], params[f"{module}.lora_B.default.weight"]
            value = value + (ALPHA / RANK) * b @ a
        torch.testing.assert_close(merged[name], value, atol=1e-6, rtol=0, msg=name)
    assert os.path.isfile(tmp_path / "hf" / "lora_adapter" / "adapter_config.json")

    # model.lora_adapter_path starts a run from the saved adapter, trainable
    start = make_config(*LORA, f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'ckpt' / 'lora_adapter'}")
    single = ActorRolloutRefWorker(start.actor_rollout_ref, "actor")
    single.init_model()
    started = single.state_digest()["params"]
    assert adapters_of({"params": started}).keys() == adapters_of(saved).keys()
    for name, value in adapters_of(saved).items():
        assert torch.equal(started[name], value), name
    assert all(p.requires_grad == (".lora_" in n) for n, p in single.policy.named_parameters())


def test_whole_model_checkpoint_into_a_lora_run_is_refused(group, tmp_path, ray_session):
    from pyrl.controller import WorkerError

    whole = WorkerGroup(ResourcePool([1]), ActorRolloutRefWorker, make_config().actor_rollout_ref, "actor")
    try:
        whole.init_model()
        whole.save_checkpoint(str(tmp_path / "whole"))
    finally:
        whole.kill()
    with pytest.raises(WorkerError, match="a whole-model checkpoint, but the run is LoRA"):
        group.load_checkpoint(str(tmp_path / "whole"))


def test_critic_starts_from_a_value_adapter_and_refuses_an_actor_adapter(tiny_path, tmp_path):
    """critic.model.lora_adapter_path: a TOKEN_CLS adapter (a critic's) trains its value head; an actor's adapter
    (CAUSAL_LM) would leave the new head random and frozen, and is refused naming the key."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from pyrl.workers.critic import CriticWorker

    keys = ["critic.model.lora_rank=4", "critic.model.lora_alpha=8", "algorithm.adv_estimator=gae"]
    value_model = AutoModelForTokenClassification.from_pretrained(tiny_path, num_labels=1, dtype=torch.float32)
    get_peft_model(value_model, lora.adapter_config(make_config(*keys).critic.model, "TOKEN_CLS")).save_pretrained(
        str(tmp_path / "critic"))
    actor = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    get_peft_model(actor, lora.adapter_config(make_config(*keys).critic.model, "CAUSAL_LM")).save_pretrained(
        str(tmp_path / "actor"))

    critic = CriticWorker(make_config(*keys, f"critic.model.lora_adapter_path={tmp_path / 'critic'}").critic)
    critic.init_model()
    trained = {name for name, p in critic.critic.named_parameters() if p.requires_grad}
    assert any(".lora_" in n for n in trained) and any(".score." in n for n in trained)
    assert all(".lora_" in n or ".score." in n for n in trained)
    wrong = make_config(*keys, f"critic.model.lora_adapter_path={tmp_path / 'actor'}")
    with pytest.raises(ValueError, match="critic.model.lora_adapter_path: the adapter was saved with task_type "
                                         "CAUSAL_LM, expected TOKEN_CLS"):
        lora.check_lora_config(wrong.critic.model, "critic.model", "TOKEN_CLS")  # at start, in the driver
    with pytest.raises(ValueError, match="critic.model.lora_adapter_path: the adapter was saved with task_type"):
        CriticWorker(wrong.critic).init_model()


def test_an_adapter_saved_without_a_task_type_loads_as_the_actors(tiny_path, tmp_path):
    """An adapter_config.json with task_type null (PEFT's plain LoraConfig): verl 0.9.1 loads it into the actor,
    and so does pyrl, as a CAUSAL_LM adapter with its saved weights, trainable; the critic refuses it (no head)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    saved = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    saved.save_pretrained(str(tmp_path / "plain"))
    keys = ["actor_rollout_ref.model.lora_rank=4", f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'plain'}"]
    model_config = make_config(*keys).actor_rollout_ref.model
    lora.check_lora_config(model_config, "actor_rollout_ref.model", "CAUSAL_LM")
    fresh = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    peft_model = lora.add_adapters(fresh, model_config, "CAUSAL_LM", "actor_rollout_ref.model")
    assert getattr(peft_model.peft_config["default"].task_type, "value", None) == "CAUSAL_LM"
    loaded = dict(peft_model.named_parameters())
    for name, value in saved.named_parameters():
        if ".lora_" in name:
            assert loaded[name].requires_grad and torch.equal(loaded[name], value), name
    critic = make_config("critic.model.lora_rank=4", f"critic.model.lora_adapter_path={tmp_path / 'plain'}",
                         "algorithm.adv_estimator=gae").critic.model
    with pytest.raises(ValueError, match="saved with task_type None, expected TOKEN_CLS"):
        lora.check_lora_config(critic, "critic.model", "TOKEN_CLS")
