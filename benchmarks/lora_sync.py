"""LoRA weight sync, the two ways a rollout engine can get a trained adapter each step, side by side on one model:

  merged:  W + (alpha / r) B @ A for every adapted layer, pushed into a plain vLLM engine in memory (what pyrl does:
           pyrl.workers.lora.merged_state_items -> VLLMEngine.load_weights);
  adapter: the adapter saved in PEFT's format and handed to a vLLM engine started with enable_lora, as a new
           LoRARequest each step (verl's route with vLLM's LoRA support; the old adapter removed).

Each variant runs in its own process (one vLLM engine per process). Reported per step: the sync's seconds, the
generation's seconds for the same prompts (LoRA kernels cost the adapter route on every token), and whether the
greedy tokens equal the merged HF model's. Run: python benchmarks/lora_sync.py [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

RANK, ALPHA, PROMPTS, NEW_TOKENS, PROMPT_LEN = 16, 32, 64, 32, 16


def peft_policy(path: str, seed: int):
    """The base model with all-linear LoRA adapters whose B is non-zero (a trained adapter's effect)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def prompts(vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab - 1, (PROMPTS, PROMPT_LEN), generator=g).tolist()


def child(mode: str, path: str, steps: int) -> dict:
    """One variant: `steps` rounds of (new adapter weights, sync, generate); timings and the greedy tokens."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from pyrl.workers import lora

    model = peft_policy(path, seed=0)
    ids = [TokensPrompt(prompt_token_ids=p) for p in prompts(model.config.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    engine = dict(model=path, dtype="float32", max_model_len=PROMPT_LEN + NEW_TOKENS, enforce_eager=True,
                  enable_chunked_prefill=False, seed=0)
    llm = LLM(**engine, enable_lora=True, max_lora_rank=RANK, max_loras=1) if mode == "adapter" else LLM(**engine)
    adapter_root = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    sync_s, gen_s, tokens = [], [], None
    for step in range(steps + 1):  # step 0 warms up (first generate compiles and allocates)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn_like(p) * 0.002)  # an optimizer step's worth of change
        start = time.perf_counter()
        request = None
        if mode == "merged":
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": lora.merged_state_items(
                model.base_model.model, "", torch.float32)})
            llm.reset_prefix_cache()
        else:
            directory = os.path.join(adapter_root, f"step{step}")
            model.save_pretrained(directory)
            if step:
                llm.llm_engine.remove_lora(step)  # the previous step's adapter
            request = LoRARequest(f"step{step}", step + 1, directory)
            llm.llm_engine.add_lora(request)
        synced = time.perf_counter()
        outputs = llm.generate(ids, params, lora_request=request, use_tqdm=False)
        done = time.perf_counter()
        if step:
            sync_s.append(synced - start)
            gen_s.append(done - synced)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
    reference = model.merge_and_unload()
    with torch.no_grad():
        expected = reference.generate(torch.tensor(prompts(model.config.vocab_size)[:8]), max_new_tokens=NEW_TOKENS,
                                      do_sample=False, min_new_tokens=NEW_TOKENS)[:, PROMPT_LEN:].tolist()
    matching = sum(a == b for a, b in zip(tokens[:8], expected))
    return {"mode": mode, "sync_s": sum(sync_s) / steps, "gen_s": sum(gen_s) / steps, "greedy_match_of_8": matching,
            "params": sum(p.numel() for p in reference.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--child", choices=["merged", "adapter"])
    parser.add_argument("--path")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path, args.steps)))
        return
    from pyrl.models.tiny import BENCH_SPEC, tiny_model_path

    path = tiny_model_path(BENCH_SPEC)
    results = []
    for mode in ("merged", "adapter"):
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--path", path, "--steps", str(args.steps)],
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"model: {results[0]['params'] / 1e6:.1f}M parameters (pyrl BENCH_SPEC), LoRA r={RANK} alpha={ALPHA} "
          f"all-linear; {PROMPTS} prompts x {NEW_TOKENS} greedy tokens per step, {args.steps} steps")
    print(f"{'route':<9} {'sync s':>8} {'generate s':>11} {'step s':>8} {'greedy = HF merged':>19}")
    for r in results:
        print(f"{r['mode']:<9} {r['sync_s']:>8.3f} {r['gen_s']:>11.3f} {r['sync_s'] + r['gen_s']:>8.3f} "
              f"{r['greedy_match_of_8']:>17}/8")
    merged, adapter = results
    print("adapter / merged, per step: "
          f"{(adapter['sync_s'] + adapter['gen_s']) / (merged['sync_s'] + merged['gen_s']):.2f}x")


if __name__ == "__main__":
    main()
