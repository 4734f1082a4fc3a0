"""Rollout with slow tools: each trajectory a coroutine (pyrl's agent loops) against the lock-step rollout (every
round's turns generated together, then every tool call, then the next round: the engine waits for the round's
slowest tool). Same engine, same prompts, same tool latencies (drawn per trajectory and turn from a seeded
log-normal, median 50 ms, sigma 1.2, cut at 2 s), greedy; the script counts the rows whose tokens differ
between the modes.

The agent is a loop of this script's (registered as verl users register theirs): `--turns` rounds of generate
`--turn-tokens` tokens -> call a tool that takes its latency -> append its answer as a tool message, then a last
turn. Rounds interleave the two modes (rotated order); each reports median (min-max) seconds over `--repeats`.

    python benchmarks/agent_rollout_async.py [--engine hf|vllm] [--trajectories 64] [--turns 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spread import ratio, rotated, show  # noqa: E402

from pyrl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register  # noqa: E402

MEDIAN_S, SIGMA, CUT_S = 0.05, 1.2, 2.0


def latency(index: int, turn: int, seed: int) -> float:
    """The tool's seconds for a trajectory's turn: log-normal (median 50 ms), the same in both modes."""
    draw = np.random.default_rng([seed, index, turn]).standard_normal()
    return min(CUT_S, MEDIAN_S * math.exp(SIGMA * draw))


@register("slow_tool_agent")
class SlowToolAgentLoop(AgentLoopBase):
    """Generates, calls a tool with a log-normal latency, appends its answer; `turns` times, then a last turn."""

    TURNS, TURN_TOKENS, SEED = 4, 8, 0

    async def run(self, sampling_params: dict, **kwargs) -> AgentLoopOutput:
        index = int(kwargs["index"])
        messages = list(kwargs["raw_prompt"])
        prompt_ids = await self.ct_build_initial_tokens(messages)
        runtime, mask, tool_s = list(prompt_ids), [], 0.0
        params = {**sampling_params, "max_tokens": self.TURN_TOKENS, "ignore_eos": True}
        for turn in range(self.TURNS + 1):
            output = await self.server_manager.generate(request_id=f"{index}-{turn}", prompt_ids=runtime,
                                                        sampling_params=params)
            merged, mask, _ = await self.ct_merge_assistant_token(runtime, output.token_ids, mask)
            runtime = merged.token_ids
            if turn == self.TURNS:
                break
            seconds = latency(index, turn, self.SEED)
            await asyncio.sleep(seconds)  # the tool: a search, a code run, a slow API
            tool_s += seconds
            before = messages + [{"role": "assistant", "content": self.tokenizer.decode(output.token_ids)}]
            after = before + [{"role": "tool", "content": f"result {turn} after {seconds * 1000:.0f} ms"}]
            merged, mask, _ = await self.ct_merge_context_msg(before, after, runtime, mask)
            runtime, messages = merged.token_ids, after
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=runtime[len(prompt_ids):], response_mask=mask,
                               num_turns=2 * self.TURNS + 2, metrics={"tool_calls": tool_s})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="the tool latencies' seed")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    SlowToolAgentLoop.TURNS, SlowToolAgentLoop.TURN_TOKENS, SlowToolAgentLoop.SEED = (args.turns, args.turn_tokens,
                                                                                     args.seed)

    import torch
    from transformers import AutoTokenizer

    from pyrl.config import ActorRolloutRefConfig, RolloutConfig
    from pyrl.experimental.agent_loop.agent_loop import AgentLoopRunner
    from pyrl.models.hub import resolve_model_path
    from pyrl.workers.rollout import make_engine
    from pyrl.workers.rollout.base import SamplingSpec

    path = resolve_model_path("pyrl:tiny-tool-sft")
    tokenizer = AutoTokenizer.from_pretrained(path)
    response = (args.turns + 1) * args.turn_tokens + args.turns * 32
    config = RolloutConfig(name=args.engine, dtype="float32", prompt_length=64, response_length=response,
                           enforce_eager=True, load_format="auto", max_num_seqs=1024)
    engine = make_engine(args.engine, path, config, torch.device("cpu"), tokenizer)
    runners = {mode: AgentLoopRunner(engine, tokenizer, ActorRolloutRefConfig(rollout=config), [],
                                     lockstep=mode == "lock-step")
               for mode in ("lock-step", "per-trajectory")}
    rows = [{"agent_name": "slow_tool_agent", "index": i,
             "raw_prompt": [{"role": "user", "content": f"Look up item {i} and report."}]}
            for i in range(args.trajectories)]
    spec = SamplingSpec(do_sample=False, max_tokens=response)
    tool_s = [sum(latency(i, turn, args.seed) for turn in range(args.turns)) for i in range(args.trajectories)]
    rounds_s = sum(max(latency(i, turn, args.seed) for i in range(args.trajectories)) for turn in range(args.turns))
    print(f"engine {args.engine}, {args.trajectories} trajectories x {args.turns} tool calls, {args.turn_tokens} "
          f"tokens a turn, torch threads {torch.get_num_threads()}; tool seconds: a trajectory's sum max "
          f"{max(tool_s):.2f}, mean {np.mean(tool_s):.2f}; the rounds' slowest calls sum to {rounds_s:.2f}")

    runners["per-trajectory"].run(rows[:2], {}, spec)  # warm-up
    times = {mode: [] for mode in runners}
    tokens, stats = {}, {}
    for round_index in range(args.repeats):
        for mode in rotated(list(runners), round_index):
            start = time.perf_counter()
            out = runners[mode].run(rows, {}, spec)
            times[mode].append(time.perf_counter() - start)
            tokens[mode] = [o.response_ids for o in out.outputs]
            stats[mode] = out
    differ = sum(a != b for a, b in zip(tokens["lock-step"], tokens["per-trajectory"]))
    print("| mode | seconds, median (min-max) | engine calls | engine idle |")
    print("|---|---|---|---|")
    for mode in runners:
        print(f"| {mode} | {show(times[mode])} | {stats[mode].engine_calls} | "
              f"{stats[mode].engine_idle_fraction:.2f} |")
    # the hf engine pads each call's rows to its longest: rows batched differently can differ in the last float
    # bits of their logits, which flips a greedy choice between near-equal tokens (vLLM does not pad)
    print(f"per-trajectory / lock-step: {ratio(times['per-trajectory'], times['lock-step'])}; "
          f"rows whose greedy tokens differ between the modes: {differ} of {len(rows)}")


if __name__ == "__main__":
    main()
