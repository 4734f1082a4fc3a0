"""Rollout engines: `vllm` (in-process vllm.LLM) and `hf` (transformers generate). Both take left-padded
prompts and return the same fields (verl's): prompts, responses (right-padded), response_mask,
input_ids, attention_mask, position_ids and, when asked, rollout_log_probs."""

from pyrl.workers.rollout.base import RolloutEngine, SamplingSpec, assemble_rollout, make_engine

__all__ = ["RolloutEngine", "SamplingSpec", "assemble_rollout", "make_engine"]
