"""The hf engine: transformers `generate` (KV cache) on the policy's weights. Where the actor holds them whole in
the engine's dtype and device (one rank, no LoRA), the engine's parameters are the actor's tensors themselves
(`use_weights`: no second copy, nothing to push; verl's HFRollout too generates with the module it is handed, the
actor's); otherwise an unsharded copy that takes the actor's weights in place each step (`load_weights`). Slower
than vLLM; needs nothing but transformers."""

from __future__ import annotations

import contextlib
import copy
from typing import Iterable

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from pyrl.protocol import left_padded
from pyrl.workers.precision import runnable_dtype
from pyrl.workers.rollout.base import RolloutEngine, SamplingSpec, check_seeds


class HFEngine(RolloutEngine):
    def __init__(self, model_path: str, config, device: torch.device, tokenizer, config_overrides: dict | None = None,
                 trust_remote_code: bool = False):
        self.dtype = runnable_dtype(config.dtype, "rollout.dtype", device)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.dtype, trust_remote_code=trust_remote_code, **(config_overrides or {})
        ).to(device).eval()
        # only the token ids of the model's generation_config.json: its sampling settings (a shipped
        # repetition_penalty, no_repeat_ngram_size, min_p, ...) would sample from another distribution than the
        # trainer scores, and transformers' generate fills every setting a call leaves unset from the model's. verl's
        # engines sample with the rollout's temperature, top_k, top_p and repetition_penalty 1.0
        shipped = self.model.generation_config
        self.model.generation_config = GenerationConfig(
            bos_token_id=shipped.bos_token_id, eos_token_id=shipped.eos_token_id, pad_token_id=shipped.pad_token_id)
        self.device = device
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.generator = torch.Generator(device=device).manual_seed(config.seed)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec, max_tokens: list[int] | None = None,
                 seeds: list[int] | None = None):
        check_seeds(seeds, prompt_ids, spec)
        input_ids, attention_mask = left_padded(prompt_ids, self.pad_token_id)  # left padding, as the prompts came
        width = input_ids.shape[1]
        # per-prompt budgets: generate to the largest and cut each row at its own (greedy, the tokens vLLM's
        # per-request max_tokens gives)
        budgets = [b for b in max_tokens for _ in range(spec.n)] if max_tokens else None
        config = copy.deepcopy(self.model.generation_config)
        config.update(max_new_tokens=max(max_tokens) if max_tokens else spec.max_tokens, num_return_sequences=spec.n,
                      pad_token_id=self.pad_token_id,
                      do_sample=not spec.greedy, output_scores=spec.logprobs, return_dict_in_generate=True)
        # with a seed per prompt, each row samples from its own generator (SeededSampling) by greedy decoding; it
        # keeps the sampled tokens' log-probs itself
        seeded = None if seeds is None or spec.greedy else SeededSampling(seeds, spec, self.device)
        if spec.greedy or seeded is not None:
            config.update(do_sample=False, temperature=None, top_k=None, top_p=None,
                          output_scores=spec.logprobs and seeded is None)
        else:
            config.update(temperature=spec.temperature, top_k=spec.top_k if spec.top_k > 0 else 0, top_p=spec.top_p)
        eos = config.eos_token_id
        eos_ids = [] if eos is None or spec.ignore_eos else [eos] if isinstance(eos, int) else list(eos)
        # stop tokens end a row as EOS does, and are kept in it (vLLM's stop_token_ids: ignore_eos leaves them on)
        eos_ids += [token for token in spec.stop_token_ids if token not in eos_ids]
        if spec.ignore_eos or spec.stop_token_ids:  # a list, even empty: generate reads None as "the model's EOS"
            config.update(eos_token_id=eos_ids)
        if spec.seed is not None:  # the samples do not depend on the engine's history
            self.generator.manual_seed(spec.seed)
        # greedy and per-row-seeded decoding draw nothing from torch's global generators, which the fork would
        # save and restore from the engine's thread while other threads may use them
        draws = not spec.greedy and seeded is None
        with _forked_rng(self.device, self.generator) if draws else contextlib.nullcontext():
            out = self.model.generate(input_ids=input_ids.to(self.device),
                                      attention_mask=attention_mask.to(self.device), generation_config=config,
                                      logits_processor=LogitsProcessorList([seeded] if seeded else []))
        generated = out.sequences[:, width:].cpu()
        step_logprobs = None
        if spec.logprobs and seeded is not None:
            step_logprobs = torch.stack(seeded.chosen_log_probs, dim=1).cpu()
        elif spec.logprobs:  # the processed scores (after temperature / top-k / top-p), as vLLM's processed_logprobs
            scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)
            step_logprobs = scores.gather(-1, generated.to(scores.device).unsqueeze(-1)).squeeze(-1).cpu()
        responses, logprobs = [], [] if spec.logprobs else None
        for i, row in enumerate(generated.tolist()):
            if budgets is not None:
                row = row[:budgets[i]]
            end = next((t + 1 for t, token in enumerate(row) if token in eos_ids), len(row))
            responses.append(row[:end])
            if spec.logprobs:
                logprobs.append(step_logprobs[i, :end].tolist())
        return responses, logprobs

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under each name
        loaded = 0
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"hf engine: the pushed weight {name!r} is not a parameter of the rollout model")
            params[name].copy_(tensor)
            loaded += tensor.numel() * tensor.element_size()
        return loaded

    def use_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Make the engine's parameters these tensors themselves, not copies: the actor's own whole weights, which
        its optimizer updates in place, so the engine generates with the current weights and the process holds
        one copy of them. Called again at each push, so that a tensor the actor replaced is taken up."""
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under each name
        named = dict(named_tensors)
        if named.keys() != params.keys():
            raise KeyError(f"hf engine: the actor's weights and the rollout model's differ in names: "
                           f"{sorted(named.keys() ^ params.keys())[:5]}")
        for name, tensor in named.items():
            param = params[name]
            if (tensor.shape, tensor.dtype, tensor.device) != (param.shape, param.dtype, param.device):
                raise ValueError(f"hf engine: the actor's {name!r} is {tuple(tensor.shape)} {tensor.dtype} on "
                                 f"{tensor.device}, the rollout model's {tuple(param.shape)} {param.dtype} on "
                                 f"{param.device}: it cannot be used in place")
            param.data = tensor.detach()


class SeededSampling(LogitsProcessor):
    """Sampling with a generator per row, for greedy decoding to run: each row's logits are divided by the
    temperature and cut to top-k, then top-p (transformers' warpers, in their order), their log-softmax kept (the
    processed log-probs), and Gumbel noise from the row's own generator added. The argmax of log p + Gumbel noise
    is a sample from p (the Gumbel-max trick), so a row's tokens depend on its seed alone, not on the rows it is
    batched with. With spec.logprobs it keeps each step's sampled tokens' log-probs (never the whole [rows, vocab]
    distributions)."""

    def __init__(self, seeds: list[int], spec: SamplingSpec, device: torch.device):
        self.spec = spec
        self.generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]
        self.chosen_log_probs: list[torch.Tensor] = []  # one [rows] per step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float() / self.spec.temperature
        if 0 < self.spec.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.spec.top_k).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.spec.top_p < 1:
            ascending, order = torch.sort(scores, descending=False)
            cut = ascending.softmax(-1).cumsum(-1) <= 1 - self.spec.top_p
            cut[..., -1:] = False  # the most likely token always stays
            scores = scores.masked_fill(cut.scatter(-1, order, cut), float("-inf"))
        log_probs = scores.log_softmax(-1)
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=generator, device=scores.device)
                               for generator in self.generators])
        perturbed = log_probs + -torch.log(-torch.log(uniform.clamp_min(torch.finfo(uniform.dtype).tiny)))
        if self.spec.logprobs:  # greedy decoding takes this argmax
            chosen = perturbed.argmax(-1, keepdim=True)
            self.chosen_log_probs.append(log_probs.gather(-1, chosen).squeeze(-1))
        return perturbed


class _forked_rng:
    """Sample from the engine's own generator, so the worker's torch RNG stream is left as it was."""

    def __init__(self, device, generator):
        self.device, self.generator = device, generator

    def __enter__(self):
        devices = [self.device] if self.device.type == "cuda" else []
        self.fork = torch.random.fork_rng(devices=devices)
        self.fork.__enter__()
        state = self.generator.get_state()
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def __exit__(self, *exc):
        state = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()
        self.generator.set_state(state)
        return self.fork.__exit__(*exc)
