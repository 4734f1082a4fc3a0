"""What the agent loop costs: one rollout batch of the tool task (prompts whose operands make the warm-started
tool model call the calculator) through the tool agent loop, against one single-turn generate call of the same
size (the same prompts and samples, every response decoded to the loop's mean response length with EOS ignored).
Both on one in-process engine; medians of `--repeats` after a warm-up.

    python benchmarks/agent_loop_cost.py [--engine vllm|hf] [--prompts 32] [--n 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import statistics
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    import torch
    from transformers import AutoTokenizer

    from pyrl.config import ActorRolloutRefConfig, RolloutConfig
    from pyrl.data.tool_calc import TOOL_USE_FROM, tool_calc_pairs, tool_calc_prompt
    from pyrl.experimental.agent_loop.agent_loop import AgentLoopRunner
    from pyrl.models.hub import resolve_model_path
    from pyrl.tools.tool_registry import load_all_tools
    from pyrl.workers.rollout import make_engine
    from pyrl.workers.rollout.base import SamplingSpec

    path = resolve_model_path("pyrl:tiny-tool-sft")
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = RolloutConfig(name=args.engine, dtype="float32", prompt_length=32, response_length=64, enforce_eager=True,
                           load_format="auto", max_num_seqs=1024)
    engine = make_engine(args.engine, path, config, torch.device("cpu"), tokenizer)
    tools = load_all_tools(str(importlib.resources.files("pyrl.configs").joinpath("tools/calculator.yaml")), None)
    schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools]
    loop = AgentLoopRunner(engine, tokenizer, ActorRolloutRefConfig(rollout=config), tools)
    train, _, _ = tool_calc_pairs()
    pairs = [p for p in train if p[0] >= TOOL_USE_FROM][:args.prompts]
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": tool_calc_prompt(a, b)}],
                                                       tools=schemas, add_generation_prompt=True,
                                                       tokenize=False),
                         add_special_tokens=False)["input_ids"] for a, b in pairs]
    rows = [{"agent_name": "tool_agent", "raw_prompt_ids": ids} for ids in prompts for _ in range(args.n)]

    def timed(fn):
        fn()  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times), result

    multi_s, out = timed(lambda: loop.run(rows, {}, SamplingSpec(max_tokens=64, seed=1)).outputs)
    lengths = [len(t.response_ids) for t in out]
    generated = sum(sum(t.response_mask) for t in out)
    width = round(statistics.mean(lengths))
    single_s, _ = timed(lambda: engine.generate(prompts, SamplingSpec(n=args.n, max_tokens=width, seed=1,
                                                                      ignore_eos=True)))
    samples = len(out)
    print(f"engine {args.engine}, {len(prompts)} prompts x {args.n} samples, torch threads {torch.get_num_threads()}")
    print(f"tool agent loop: {multi_s:.3f} s ({samples} trajectories, mean response "
          f"{statistics.mean(lengths):.1f} tokens of which {generated / samples:.1f} generated, "
          f"{sum(t.extra_fields['tool_call_counts'] for t in out)} tool calls)")
    print(f"single turn, {width} tokens each: {single_s:.3f} s")
    print(f"ratio agent loop / single turn: {multi_s / single_s:.2f}")


if __name__ == "__main__":
    main()
