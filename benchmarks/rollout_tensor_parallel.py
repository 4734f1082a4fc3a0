"""Rollout tensor parallelism on this machine: the same prompts through two rollout workers with an engine each
(rollout.tensor_model_parallel_size=1, each generating half) and through the same two workers sharing one engine
(tensor_model_parallel_size=2: each rank holds half of every layer, the leader generates for both). Reported: the
median seconds of a generate call after a warm-up, each rank's share of the engine's weights (computed, not
measured), and whether the two layouts' greedy tokens agree. Tensor parallelism is for models whose weights do not
fit one device: on a CPU machine its per-layer all-reduces cost time, and this shows how much.

Run: python benchmarks/rollout_tensor_parallel.py [--prompts 64] [--new-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time


def rollout_group(tp: int, model_path: str, args):
    from omegaconf import OmegaConf

    from pyrl.config import PPOConfig
    from pyrl.controller import ResourcePool, WorkerGroup
    from pyrl.workers.actor import ActorRolloutRefWorker

    overrides = [f"actor_rollout_ref.model.path={model_path}", "actor_rollout_ref.rollout.name=vllm",
                 f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
                 "actor_rollout_ref.rollout.dtype=float32",
                 "actor_rollout_ref.rollout.load_format=auto", "actor_rollout_ref.rollout.enforce_eager=true",
                 "actor_rollout_ref.rollout.free_cache_engine=false", f"data.max_prompt_length={args.prompt_len}",
                 f"data.max_response_length={args.new_tokens}"]
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PPOConfig), OmegaConf.from_dotlist(overrides)))
    group = WorkerGroup(ResourcePool([2]), ActorRolloutRefWorker, config.actor_rollout_ref, "rollout",
                        init_distributed=tp > 1, env={"OMP_NUM_THREADS": 1})
    group.init_model()
    return group


def prompts(args, vocab: int):
    import torch

    from pyrl.protocol import DataProto

    ids = torch.randint(3, vocab - 1, (args.prompts, args.prompt_len), generator=torch.Generator().manual_seed(0))
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    batch.meta_info.update(do_sample=False, ignore_eos=True)
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import ray
    from transformers import AutoConfig, AutoModelForCausalLM

    from pyrl.controller import init_ray
    from pyrl.models.tiny import BENCH_SPEC, tiny_model_path

    model_path = tiny_model_path(BENCH_SPEC)

    hf_config = AutoConfig.from_pretrained(model_path)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_path).parameters())
    batch = prompts(args, hf_config.vocab_size)
    init_ray(num_cpus=2)
    results, tokens = {}, {}
    for tp in (1, 2):
        group = rollout_group(tp, model_path, args)
        group.generate_sequences(batch)  # warm-up
        seconds = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            out = group.generate_sequences(batch)
            seconds.append(time.perf_counter() - start)
        tokens[tp] = out.batch["responses"]
        results[tp] = statistics.median(seconds)
        group.kill()
        print(f"tensor_model_parallel_size={tp}: {results[tp]:.2f} s per generate call (rounds: "
              f"{', '.join(f'{s:.2f}' for s in seconds)}), engine weights per rank "
              f"{params * 4 / tp / 2**20:.1f} MiB (computed: float32 / TP)",
              flush=True)
    ray.shutdown()
    same = (tokens[1] == tokens[2]).all(-1).float().mean().item()
    print(f"\n{args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens each, greedy, float32, "
          f"{params / 1e6:.1f}M-parameter Qwen2 (BENCH_SPEC), 2 worker processes of one thread")
    print("| layout | s / generate | weights per rank (computed) |")
    print("|---|---|---|")
    for tp in (1, 2):
        label = "2 engines (TP=1), a half of the prompts each" if tp == 1 else "1 engine over 2 ranks (TP=2)"
        print(f"| {label} | {results[tp]:.2f} | {params * 4 / tp / 2**20:.1f} MiB |")
    print(f"TP=2 / TP=1 time: {results[2] / results[1]:.2f}x; rows with equal greedy tokens: {same:.0%}")


if __name__ == "__main__":
    main()
