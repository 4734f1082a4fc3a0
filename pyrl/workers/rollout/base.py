"""What both rollout engines share: the sampling settings, the engine interface and the one function
that turns generated token lists into verl's padded rollout fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from pyrl.protocol import DataProto


@dataclass(frozen=True)
class SamplingSpec:
    """One generate call's sampling. temperature 0 or do_sample False is greedy; top_k -1 / top_p 1 are off."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    max_tokens: int = 16
    ignore_eos: bool = False
    logprobs: bool = False
    seed: int | None = None  # set: the call's samples are drawn from this seed, whatever ran before (resumable)
    # tokens that end a sample as EOS does, kept in the response as vLLM keeps a stop token id, and stopping it even
    # with ignore_eos (vLLM's stop_token_ids); the agent loop's tool parser sets them (multi_turn.format)
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @classmethod
    def from_config(cls, rollout_config, meta_info: dict | None = None) -> "SamplingSpec":
        """The rollout config's sampling, overridden by the batch's meta_info keys of the same names
        (validation passes val_kwargs this way)."""
        meta = meta_info or {}
        spec = cls(
            n=int(meta.get("n", 1)),
            temperature=float(meta.get("temperature", rollout_config.temperature)),
            top_k=int(meta.get("top_k", rollout_config.top_k)),
            top_p=float(meta.get("top_p", rollout_config.top_p)),
            # verl 0.9.1's rollout reads do_sample nowhere (its temperature decides: 0 is greedy); a batch's own
            # do_sample=False is pyrl's internal greedy pass (ReMax's baseline, as verl's __do_sample__)
            do_sample=bool(meta.get("do_sample", True)),
            max_tokens=int(meta.get("response_length", rollout_config.response_length)),
            ignore_eos=bool(meta.get("ignore_eos", rollout_config.ignore_eos)),
            logprobs=bool(meta.get("calculate_log_probs", rollout_config.calculate_log_probs)),
            seed=None if meta.get("seed") is None else int(meta["seed"]),
        )
        spec.check("rollout")
        return spec

    def check(self, where: str) -> None:
        """Values every engine takes alike, or a clear error naming `where` (vLLM would refuse some, the hf engine
        quietly do something else with them)."""
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError(f"{where}: n and response_length must be >= 1, got n={self.n}, "
                             f"response_length={self.max_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise ValueError(f"{where}: expected temperature >= 0, 0 < top_p <= 1, top_k -1 (off) or >= 1; got "
                             f"temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}")


class RolloutEngine:
    """generate(prompt_ids, spec) -> (response token lists, their log-prob lists or None), n per prompt,
    interleaved (prompt 0's n samples first); load_weights pushes the actor's weights in place. Every engine honours
    all of the spec, spec.stop_token_ids included (the agent loop relies on it for the formats that need it)."""

    dtype: torch.dtype  # what the engine computes in (and the weights it is pushed)

    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec, max_tokens: list[int] | None = None,
                 seeds: list[int] | None = None):
        """max_tokens: a token budget per prompt instead of spec.max_tokens (the agent loop's turns each have
        what is left of the response). seeds (with spec.n 1): a seed per prompt instead of spec.seed, its sample
        drawn from that seed alone, whatever else the call holds (the agent loop's requests, batched as they
        come)."""
        raise NotImplementedError

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Returns the bytes loaded."""
        raise NotImplementedError

    def sleep(self, keep_weights: bool = False) -> None:
        """Free what generation holds (KV cache) while training runs; the next push or generation takes it back.
        keep_weights: the weights are the engine's own (no push brings them back): wake_up restores them."""

    def wake_up(self) -> None:
        """Undo sleep(keep_weights=True) before generating."""


def check_seeds(seeds: list[int] | None, prompt_ids: list, spec: SamplingSpec) -> None:
    if seeds is not None and (len(seeds) != len(prompt_ids) or spec.n != 1):
        raise ValueError(f"generate: seeds are one per prompt with n=1; got {len(seeds)} seeds for "
                         f"{len(prompt_ids)} prompts, n={spec.n}")


def prompt_token_lists(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Left-padded [B, P] prompts -> their tokens without padding."""
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]


def assemble_rollout(prompts: DataProto, responses: list[list[int]], logprobs: list[list[float]] | None,
                     response_length: int, pad_token_id: int,
                     response_masks: list[list[int]] | None = None) -> DataProto:
    """prompts (rows already repeated n times, interleaved) + one generated token list per row -> verl's
    fields: responses right-padded to response_length, response_mask 1 on generated tokens (up to and
    including EOS; from `response_masks` when given: a multi-turn response's tool tokens are 0 there but
    attended), input_ids / attention_mask / position_ids over prompt + response."""
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    batch = len(responses)
    if batch != prompt_ids.shape[0]:
        raise ValueError(f"assemble_rollout: {batch} responses for {prompt_ids.shape[0]} prompt rows")
    out = torch.full((batch, response_length), pad_token_id, dtype=prompt_ids.dtype)
    mask = torch.zeros((batch, response_length), dtype=prompt_mask.dtype)
    rollout_logp = torch.zeros((batch, response_length), dtype=torch.float32)
    trained = mask if response_masks is None else torch.zeros_like(mask)
    for i, tokens in enumerate(responses):
        if len(tokens) > response_length:
            raise ValueError(f"assemble_rollout: row {i} has {len(tokens)} tokens, more than "
                             f"response_length={response_length}")
        out[i, :len(tokens)] = torch.as_tensor(tokens, dtype=prompt_ids.dtype)
        mask[i, :len(tokens)] = 1
        if response_masks is not None:
            trained[i, :len(tokens)] = torch.as_tensor(response_masks[i], dtype=trained.dtype)
        if logprobs is not None:
            rollout_logp[i, :len(tokens)] = torch.as_tensor(logprobs[i], dtype=torch.float32)
    if "position_ids" in prompts.batch:
        prompt_pos = prompts.batch["position_ids"]
    else:
        prompt_pos = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    response_pos = prompt_pos[:, -1:] + torch.arange(1, response_length + 1, dtype=prompt_pos.dtype)
    fields = {
        "prompts": prompt_ids,
        "responses": out,
        "response_mask": trained,
        "input_ids": torch.cat([prompt_ids, out], dim=-1),
        "attention_mask": torch.cat([prompt_mask, mask], dim=-1),
        "position_ids": torch.cat([prompt_pos, response_pos], dim=-1),
    }
    if logprobs is not None:
        fields["rollout_log_probs"] = rollout_logp
    return DataProto.from_dict(tensors=fields, non_tensors=dict(prompts.non_tensor_batch),
                               meta_info=dict(prompts.meta_info))


def make_engine(name: str, model_path: str, rollout_config, device: torch.device, tokenizer,
                group_name: str = "", own_workers: bool = False, config_overrides: dict | None = None,
                trust_remote_code: bool = False) -> RolloutEngine:
    """The engine actor_rollout_ref.rollout.name asks for. group_name: with tensor parallelism, the name of the
    ranks sharing the engine (pyrl.workers.rollout.tensor_parallel); own_workers: vLLM starts the TP workers itself
    (VLLMEngine); config_overrides: values over the model's config.json (the policy's model.override_config: the
    engine must run the model the trainer scores); trust_remote_code: the model's own code may run (the policy's
    model.trust_remote_code, as the actor loads it)."""
    if name == "vllm":
        from pyrl.workers.rollout.vllm_engine import VLLMEngine  # lazy: import cycle (it imports this module)

        return VLLMEngine(model_path, rollout_config, device, group_name, own_workers, config_overrides,
                          trust_remote_code)
    if name == "hf":
        from pyrl.workers.rollout.hf_engine import HFEngine  # lazy: import cycle (it imports this module)

        return HFEngine(model_path, rollout_config, device, tokenizer, config_overrides, trust_remote_code)
    raise ValueError(f"actor_rollout_ref.rollout.name: unknown engine {name!r}, expected 'vllm' or 'hf'")
