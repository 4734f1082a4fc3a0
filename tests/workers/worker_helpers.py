"""Batches, configs, process groups and float64 references shared by the worker tests."""

import contextlib
import os
from unittest import mock

import torch
import torch.distributed as dist

from pyrl.protocol import DataProto

PROMPT_WIDTH, RESPONSE_WIDTH = 8, 6


def make_config(*overrides: str):
    """The typed config with dotlist overrides (as on a command line), resolved into dataclasses."""
    from omegaconf import OmegaConf

    from pyrl.config import PPOConfig, resolve_teacher_entries

    base = OmegaConf.structured(PPOConfig)
    # float32 compute everywhere (a bf16-capable CPU would otherwise run the sharded groups and the rollout in bf16):
    # the tests compare against float32 single processes and float64 references
    fp32 = [f"{key}.dtype=float32" for key in ("actor_rollout_ref.actor.fsdp_config",
                                               "actor_rollout_ref.ref.fsdp_config",
                                               "critic.fsdp", "reward_model.fsdp_config")]
    defaults = fp32 + ["actor_rollout_ref.rollout.dtype=float32", f"data.max_prompt_length={PROMPT_WIDTH}",
                       f"data.max_response_length={RESPONSE_WIDTH}", "actor_rollout_ref.rollout.name=hf",
                       "actor_rollout_ref.model.path=pyrl:tiny"]
    cfg = OmegaConf.merge(base, OmegaConf.from_dotlist(defaults + list(overrides)))
    config = OmegaConf.to_object(cfg)
    resolve_teacher_entries(config)  # teacher entries added by an override, typed (as pyrl.ppo.resolve_settings)
    return config


def random_batch(rows: int, seed: int, vocab: int = 300) -> DataProto:
    """Left-padded prompts of 1..PROMPT_WIDTH tokens, right-padded responses of 0..RESPONSE_WIDTH tokens
    (row 1 empty), position ids counted from each row's first token, as a rollout returns them."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, PROMPT_WIDTH + 1, (rows,), generator=g)
    response_len = torch.randint(1, RESPONSE_WIDTH + 1, (rows,), generator=g)
    response_len[1] = 0
    prompt_len[0], response_len[0] = PROMPT_WIDTH, RESPONSE_WIDTH  # one full row
    cols = torch.arange(PROMPT_WIDTH)
    prompt_mask = (cols >= PROMPT_WIDTH - prompt_len[:, None]).long()
    response_mask = (torch.arange(RESPONSE_WIDTH) < response_len[:, None]).long()
    prompts = torch.randint(3, vocab, (rows, PROMPT_WIDTH), generator=g) * prompt_mask
    responses = torch.randint(3, vocab, (rows, RESPONSE_WIDTH), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], -1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], -1), "attention_mask": attention_mask,
        "position_ids": position_ids,
    }, meta_info={"temperature": 1.0})


def hf_response_logprobs(path: str, batch: DataProto, temperature: float = 1.0, model=None):
    """float64 reference: log_softmax of HF's own logits at the response positions, and the entropy."""
    from transformers import AutoModelForCausalLM

    model = model or AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    with torch.no_grad():
        logits = model(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                       position_ids=batch.batch["position_ids"]).logits.double() / temperature
    width = batch.batch["responses"].shape[1]
    logp_all = logits[:, -width - 1:-1].log_softmax(-1)
    logp = logp_all.gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def rollout_prompts(rows: int, seed: int) -> DataProto:
    """Left-padded prompts only, as the trainer hands them to generate_sequences."""
    batch = random_batch(rows, seed)
    return DataProto.from_dict({k: batch.batch[k][:, :PROMPT_WIDTH]
                                for k in ("input_ids", "attention_mask", "position_ids")})


def check_rollout_fields(out, prompts, n):
    rows, width = len(prompts) * n, RESPONSE_WIDTH
    assert set(out.batch) >= {"prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
                              "rollout_log_probs"}
    assert (out.batch["responses"].shape == (rows, width)
            and out.batch["input_ids"].shape == (rows, PROMPT_WIDTH + width))
    repeated = prompts.batch["input_ids"].repeat_interleave(n, 0)
    assert torch.equal(out.batch["prompts"], repeated)
    assert torch.equal(out.batch["input_ids"], torch.cat([repeated, out.batch["responses"]], -1))
    assert torch.equal(out.batch["attention_mask"][:, PROMPT_WIDTH:], out.batch["response_mask"])
    lengths = out.batch["response_mask"].sum(-1)
    assert (lengths >= 1).all()
    for i, length in enumerate(lengths.tolist()):  # the mask is a prefix; positions continue the prompt's
        assert out.batch["response_mask"][i, :length].all() and not out.batch["response_mask"][i, length:].any()
    pos = out.batch["position_ids"]
    assert torch.equal(pos[:, PROMPT_WIDTH:], pos[:, PROMPT_WIDTH - 1:PROMPT_WIDTH] + torch.arange(1, width + 1))
    assert (out.batch["rollout_log_probs"] <= 0).all()


def hf_greedy(model_dir, prompts, max_new_tokens):
    """transformers' own greedy responses from the model saved in model_dir, each cut after its first EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(input_ids=prompts.batch["input_ids"], attention_mask=prompts.batch["attention_mask"],
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos)
    rows = []
    for row in out[:, prompts.batch["input_ids"].shape[1]:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


@contextlib.contextmanager
def one_rank_process_group():
    """A gloo process group of this process alone, set up as a one-rank trainer's worker sets up its own (FSDP2
    wraps its models only on CUDA, with mixed precision or offload: pyrl.workers.fsdp.wraps_with_fsdp2); destroyed
    after, and the rendezvous variables it set removed."""
    from pyrl.controller.worker import Worker

    with mock.patch.dict(os.environ):  # setup_distributed sets MASTER_ADDR and MASTER_PORT
        worker = Worker()
        worker.setup_distributed(*worker.master_address(), "gloo")
        try:
            yield
        finally:
            dist.destroy_process_group()
