"""Starting policies for RL on the built-in tasks: the tiny model after a short supervised warm-start, stopped as
soon as greedy decoding gets a target share of the validation prompts right.

- toy_warm_start_path: the default run's (two-digit addition, pyrl.data.toy), 15% by default.
- tool_warm_start_path: the tool-use task's (pyrl.data.tool_calc, the tiny model's tools=True variant): trained on
  whole demonstrated conversations (question, calculator call, tool result, answer), the loss on the assistant
  turns only, in two stages (the skill, then a teacher who uses the calculator only sometimes), so that the
  policy calls the tool, correctly, for some of the prompts; success is measured end to end (the right call,
  then the right answer from the tool's result).
- tool_transfer_warm_start_path: the tool task's transfer variant: the same model and loss, demonstrations of the
  calculator on sums and differences only, never on products (the task's questions).

RL needs a policy that sometimes succeeds: from random weights the reward is 0 everywhere and GRPO has no
signal. The warm-start plays the role of pretraining; it stops at a low bar so that what an RL run shows
afterwards is RL's improvement. Both share one loop (supervised_warm_start). Deterministic from the seed,
cached like the tiny model (made in a temp dir, renamed into place)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings

from pyrl.models.tiny import TinyModelSpec, _write_once, default_cache_dir, tiny_model_path

log = logging.getLogger("pyrl")

VERSION = 3  # the toy warm-start's; bumped when its result changes (names its cache directory); 3: toy task v2
TOOL_VERSION = 1  # the tool warm-start's


def _chat_prompts(tokenizer, questions) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def greedy_reward(model, tokenizer, questions, truths, max_new_tokens: int = 8) -> float:
    """Mean toy reward of greedy answers (left-padded batch through HF generate)."""
    # lazy: torch and the torch-loading pyrl packages load only when a warm-start runs
    import torch

    from pyrl.protocol import left_padded
    from pyrl.rewards.toy import compute_score

    input_ids, mask = left_padded(_chat_prompts(tokenizer, questions), tokenizer.pad_token_id)
    width = input_ids.shape[1]
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    model.train()
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=False)
    return sum(compute_score(t, y) for t, y in zip(texts, truths)) / len(truths)


def supervised_warm_start(model, examples, evaluate, done, *, seed: int, max_steps: int, pad_token_id: int, name: str,
                          goal: str, score=None, progress: bool = True, batch_size: int = 128, lr: float = 3e-3,
                          eval_every: int = 25, log_every: int = 250) -> tuple[int, dict, bool]:
    """Supervised fine-tuning of `model` in place until done(evaluate(model)); returns (steps, metrics, reached).

    examples: (input_ids, labels) token lists of equal length, labels -100 where no loss is taken. Each step
    draws batch_size examples with replacement (a generator seeded by `seed`), right-pads them, and takes one
    AdamW step (lr, gradients clipped to norm 1). Every eval_every steps (and at max_steps) evaluate(model) ->
    {label: value}; training stops once done(metrics). If max_steps pass first, the model of the best
    score(metrics) seen (default: the first value) is kept, with a warning naming `goal`. Progress: a bar on a
    terminal, otherwise a log line every log_every steps."""
    # lazy: torch and tqdm load only when a warm-start runs
    import torch
    from tqdm import tqdm

    score = score or (lambda m: next(iter(m.values())))
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    metrics, step, reached, best = {}, 0, False, (float("-inf"), None, {})
    # a bar on a terminal; in a log file (CI, nohup) a plain line every log_every steps instead of redraws
    on_terminal = sys.stderr.isatty()
    bar = tqdm(total=max_steps, desc=f"{name} (SFT)", disable=not progress or not on_terminal, leave=False)
    for step in range(1, max_steps + 1):
        rows = torch.randint(len(examples), (batch_size,), generator=generator).tolist()
        width = max(len(examples[i][0]) for i in rows)
        input_ids = torch.full((batch_size, width), pad_token_id)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros_like(input_ids)
        for j, i in enumerate(rows):  # right padding
            ids, targets = examples[i]
            input_ids[j, :len(ids)], mask[j, :len(ids)] = torch.tensor(ids), 1
            labels[j, :len(ids)] = torch.tensor(targets)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.update()
        if step % eval_every == 0 or step == max_steps:
            metrics = evaluate(model)
            bar.set_postfix(loss=f"{loss.item():.3f}", **{f"val_{k}".replace(" ", "_"): f"{v:.3f}"
                                                          for k, v in metrics.items()})
            if progress and not on_terminal and step % log_every == 0:
                log.info("%s (SFT): step %d, loss %.3f, greedy validation %s (%s)", name, step, loss.item(),
                         ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()), goal)
            if done(metrics):
                reached = True
                break
            if score(metrics) > best[0]:
                best = (score(metrics), {k: v.clone() for k, v in model.state_dict().items()}, metrics)
    bar.close()
    if not reached:
        warnings.warn(f"{name}: {goal} not reached after {max_steps} steps (best validation: "
                      f"{', '.join(f'{k} {v:.3f}' for k, v in best[2].items())}); keeping the best model seen")
        model.load_state_dict(best[1])
        metrics = best[2]
    return step, metrics, reached


def _save(root: str, path: str, model, tokenizer, info: dict) -> None:
    """The model, its tokenizer and `info` (pyrl_warm_start.json) into `path`, through a temporary directory."""
    def write(tmp: str) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        with open(os.path.join(tmp, "pyrl_warm_start.json"), "w") as f:
            json.dump(info, f)

    _write_once(root, path, write)


def toy_warm_start_path(target_reward: float = 0.15, seed: int = 0, max_steps: int = 4000, cache_dir: str | None = None,
                        progress: bool = True) -> str:
    """The warm-started model's directory. Checked every 25 steps; the accuracy jumps within a few hundred
    steps once the model finds the digit alignment (~1,300 steps here), so the check catches it on the way
    up. If max_steps pass first, the best model seen is kept, with a warning."""
    # lazy: torch, transformers and pyrl.data (torch) load only when a warm-start runs
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyrl.data.toy import toy_answer, toy_pairs, toy_prompt

    root = cache_dir or default_cache_dir()
    base = tiny_model_path(TinyModelSpec(seed=seed), cache_dir=root)
    path = f"{base}-toy-sft-v{VERSION}-r{target_reward:g}"
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    train, val, _ = toy_pairs(seed)  # the test split is never looked at
    val_questions, val_truths = [toy_prompt(a, b) for a, b in val], [str(a + b) for a, b in val]
    prompts = _chat_prompts(tokenizer, [toy_prompt(a, b) for a, b in train])
    answers = [tokenizer(toy_answer(a, b) + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
               for a, b in train]
    examples = [(p + a, [-100] * len(p) + a) for p, a in zip(prompts, answers)]  # the loss on the answer only
    steps, metrics, _ = supervised_warm_start(
        model, examples, lambda m: {"reward": greedy_reward(m, tokenizer, val_questions, val_truths)},
        lambda metrics: metrics["reward"] >= target_reward, seed=seed, max_steps=max_steps,
        pad_token_id=tokenizer.pad_token_id, name="toy warm-start", goal=f"target {target_reward:g}", progress=progress)
    _save(root, path, model, tokenizer,
          {"steps": steps, "val_reward": metrics["reward"], "target_reward": target_reward, "seed": seed})
    return path


def assistant_mask(tokenizer, ids: list[int]) -> list[int]:
    """1 on the assistant turns' tokens of a rendered conversation: each turn's content through its closing
    <|im_end|> (eos); not the "<|im_start|>assistant\\n" header, not what other roles (tools) said."""
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    mask, i, n = [0] * len(ids), 0, len(header)
    while i < len(ids):
        if ids[i:i + n] != header:
            i += 1
            continue
        i += n
        while i < len(ids):
            mask[i] = 1
            i += 1
            if ids[i - 1] == tokenizer.eos_token_id:
                break
    return mask


def conversation_tokens(tokenizer, conversations, tools=None) -> list[tuple[list[int], list[int]]]:
    """(input_ids, assistant_mask) of each whole conversation, rendered by the chat template at once (as a
    multi-turn rollout that appends each turn's tokens to the last reproduces it)."""
    texts = [tokenizer.apply_chat_template(c, tools=tools, tokenize=False) for c in conversations]
    return [(ids, assistant_mask(tokenizer, ids)) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _turns(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


class ToolCallEvaluator:
    """Greedy end-to-end success on the tool task, exactly and without an agent loop, in two teacher-forced
    stages through HF generate: (a) from the prompt, is the first assistant turn the gold calculator call, token
    for token through <|im_end|>? (b) from the gold conversation through the tool's result and the next
    "<|im_start|>assistant\\n", does the turn end (eos) with the right answer and no further call? When (a)
    holds, a real rollout's context before the second turn IS the gold one, so success = (a) and (b), as an
    agent loop would score it with greedy decoding. Returns {"success", "tool-call rate", "answer rate"}
    ((a) and (b) alone). sampled() measures the same with sampling (temperature 1), as RL's rollouts see it.

    problems: operand pairs (a, b) of products, or (a, b, op) with op one of pyrl.data.tool_calc.OPERATIONS."""

    def __init__(self, tokenizer, problems, tools):
        # lazy: pyrl.data loads torch, only when a warm-start runs
        from pyrl.data.tool_calc import tool_calc_demonstration, tool_calc_result

        problems = [p if len(p) == 3 else (*p, "*") for p in problems]
        self.tokenizer, self.truths = tokenizer, [str(tool_calc_result(*p)) for p in problems]
        self.prompts, self.calls, self.prefixes, self.answer_len = [], [], [], 0
        for ids, mask in conversation_tokens(tokenizer, [tool_calc_demonstration(*p) for p in problems], tools):
            (s1, e1), (s2, e2) = _turns(mask)
            self.prompts.append(ids[:s1])
            self.calls.append(ids[s1:e1])
            self.prefixes.append(ids[:s2])
            self.answer_len = max(self.answer_len, e2 - s2)

    def _generate(self, model, contexts, max_new_tokens: int, sample: bool) -> list[list[int]]:
        # lazy: torch and the torch-loading pyrl packages load only when a warm-start runs
        import torch

        from pyrl.protocol import left_padded

        input_ids, mask = left_padded(contexts, self.tokenizer.pad_token_id)
        sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if sample else {"do_sample": False}
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
                                 **sampling)
        return out[:, input_ids.shape[1]:].tolist()

    def _rates(self, model, repeats: int = 1, sample: bool = False) -> dict:
        from pyrl.rewards.tool_calc import compute_score  # lazy: pyrl.rewards loads torch, only when a warm-start runs

        eos = self.tokenizer.eos_token_id
        was_training = model.training
        model.eval()
        outs = self._generate(model, self.prompts * repeats, max(map(len, self.calls)), sample)
        called = [out[:len(gold)] == gold for out, gold in zip(outs, self.calls * repeats)]
        answered = []
        for out, truth in zip(self._generate(model, self.prefixes * repeats, self.answer_len + 8, sample),
                              self.truths * repeats):
            text = self.tokenizer.decode(out[:out.index(eos) + 1]) if eos in out else ""
            answered.append(bool(text) and "<tool_call>" not in text and compute_score(text, truth) == 1.0)
        model.train(was_training)
        n = len(called)
        return {"success": sum(c and a for c, a in zip(called, answered)) / n, "tool-call rate": sum(called) / n,
                "answer rate": sum(answered) / n}

    def __call__(self, model) -> dict:
        return self._rates(model)

    def sampled(self, model, repeats: int = 4, seed: int = 0) -> dict:
        """The rates with sampling at temperature 1 (top_k 0, top_p 1), `repeats` samples per prompt; exact in
        distribution for the same reason as the greedy ones. The global RNG is left as it was."""
        import torch  # lazy: torch loads only when a warm-start runs

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self._rates(model, repeats, sample=True)


SKILL_SUCCESS = 0.9  # the tool warm-start's first stage ends at this greedy success (the skill is learned)
MAX_CALL_RATE = 0.5  # its second stage ends only once the greedy policy calls the tool for at most this share


def _tool_paths(cache_dir, seed: int, suffix: str) -> tuple[str, str, str]:
    """(cache root, the tiny tool model's directory, the warm-start's directory: the model's + "-" + suffix)."""
    root = cache_dir or default_cache_dir()
    base = str(tiny_model_path(TinyModelSpec(seed=seed, tools=True), cache_dir=root))
    return root, base, f"{base}-{suffix}"


def _tool_start(base: str):
    """(tokenizer, float32 model, tools, examples) for a tool warm-start from the model in `base`; examples(
    conversations) -> SFT examples with the loss on the assistant turns only."""
    # lazy: torch, transformers and pyrl.data (torch) load only when a warm-start runs
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyrl.data.tool_calc import calculator_schema

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tools = [calculator_schema()]

    def examples(conversations):
        return [(ids, [t if m else -100 for t, m in zip(ids, mask)])
                for ids, mask in conversation_tokens(tokenizer, conversations, tools)]

    return tokenizer, model, tools, examples


def tool_warm_start_path(target_success: float = 0.1, seed: int = 0, max_steps: int = 1000,
                         cache_dir: str | None = None, progress: bool = True, train_size: int = 20000,
                         val_size: int = 256) -> str:
    """The tool task's warm-started model's directory: the tiny model's tools=True variant after supervised
    training on demonstrations of pyrl.data.tool_calc's train split (whole conversations, the loss on the
    assistant turns only), in two stages, each checked on the validation split by ToolCallEvaluator:

    1. skill: every demonstration calls the calculator; until greedy success >= SKILL_SUCCESS (the model has
       learned to copy the operands into the call and the result into the answer; ~110 steps);
    2. habit: demonstrations of a teacher that calls the calculator only sometimes (pyrl.data.tool_calc.TOOL_USE_*:
       80% of the prompts whose first operand is >= 900, 20% of the others; otherwise a guessed answer), until
       greedy success >= target_success with a greedy tool-call rate <= MAX_CALL_RATE (~150 steps: the greedy
       policy then calls the tool for the first operands >= 900, about 15% of the prompts, and guesses elsewhere).

    Why not stop one stage of tool demonstrations at a low greedy success: the skill appears abruptly (greedy
    success 0 to 1 within ~10 steps) and a model caught on the way has flat distributions: at greedy success 0.21
    it succeeded in 0.05% of samples at temperature 1, so GRPO's groups would almost never hold a success. After
    stage 2 the model calls the tool in ~25-30% of samples and is right almost every time it does: RL has to
    learn to call it everywhere.

    At most max_steps per stage; if a stage's goal is not reached, its best model is kept, with a warning.
    pyrl_warm_start.json beside the weights records steps, greedy success, tool-call rate and answer rate, the
    same sampled, and the time taken."""
    # lazy: pyrl.data loads torch, only when a warm-start runs
    from pyrl.data.tool_calc import tool_calc_demonstration, tool_calc_mixed, tool_calc_pairs

    root, base, path = _tool_paths(cache_dir, seed, f"tool-sft-v{TOOL_VERSION}-r{target_success:g}")
    if (train_size, val_size) != (20000, 256):
        path += f"-train{train_size}-val{val_size}"
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    start = time.perf_counter()
    tokenizer, model, tools, examples = _tool_start(base)
    train, val, _ = tool_calc_pairs(seed, train_size, val_size)  # the test split is never looked at
    demos = examples([tool_calc_demonstration(a, b) for a, b in train])
    conversations, used = tool_calc_mixed(train, seed)
    guesses = iter(examples([c for c, tool in zip(conversations, used) if not tool]))
    mixed = [demo if tool else next(guesses) for demo, tool in zip(demos, used)]
    evaluate = ToolCallEvaluator(tokenizer, val, tools)
    common = dict(max_steps=max_steps, pad_token_id=tokenizer.pad_token_id, progress=progress, log_every=50)
    skill_steps, _, _ = supervised_warm_start(
        model, demos, evaluate, lambda m: m["success"] >= SKILL_SUCCESS, seed=seed, eval_every=5,
        name="tool warm-start 1/2, tool demonstrations", goal=f"success >= {SKILL_SUCCESS:g}", **common)

    def habit_done(m):
        return m["success"] >= target_success and m["tool-call rate"] <= MAX_CALL_RATE

    habit_steps, metrics, _ = supervised_warm_start(
        model, mixed, evaluate, habit_done, seed=seed + 1, eval_every=10,
        score=lambda m: m["success"] if m["tool-call rate"] <= MAX_CALL_RATE else -m["tool-call rate"],
        name="tool warm-start 2/2, mixed demonstrations",
        goal=f"success >= {target_success:g} with tool-call rate <= {MAX_CALL_RATE:g}", **common)
    sampled = evaluate.sampled(model, seed=seed)
    seconds = time.perf_counter() - start
    log.info("tool warm-start (SFT): %d + %d steps in %.0f s; greedy validation success %.3f, tool-call rate %.3f; "
             "sampled success %.3f, tool-call rate %.3f", skill_steps, habit_steps, seconds, metrics["success"],
             metrics["tool-call rate"], sampled["success"], sampled["tool-call rate"])
    _save(root, path, model, tokenizer, {
        "steps": skill_steps + habit_steps, "skill_steps": skill_steps, "habit_steps": habit_steps,
        "success": metrics["success"], "call_rate": metrics["tool-call rate"], "answer_rate": metrics["answer rate"],
        "sampled_success": sampled["success"], "sampled_call_rate": sampled["tool-call rate"],
        "sampled_answer_rate": sampled["answer rate"], "target_success": target_success, "seed": seed,
        "train_size": train_size, "val_size": val_size, "seconds": round(seconds, 1)})
    return path


TRANSFER_VERSION = 1  # the transfer warm-start's


def tool_transfer_warm_start_path(seed: int = 0, products: str = "absent", max_steps: int = 1000,
                                  cache_dir: str | None = None, progress: bool = True, train_size: int = 20000,
                                  val_size: int = 256) -> str:
    """The tool task's transfer variant (preset=tool_calc_transfer): the tiny tool model after supervised training
    on demonstrations of the calculator on sums and differences of the task's operands
    (pyrl.data.tool_calc.tool_transfer_problems), never on products, until greedy success on a validation set
    of sums and differences >= SKILL_SUCCESS (every such demonstration calls the tool). products:

    - "absent": no product in the training data at all (pyrl:tiny-tool-transfer-sft);
    - "guessed": a third of the examples are products answered without the calculator, by a wrong guess
      (pyrl:tiny-tool-transfer-guess-sft): the model has seen products and learned not to call the tool for them.

    (pyrl.data.tool_calc.tool_transfer_conversations.)

    What it does on products, the RL task, is measured and recorded, not trained: pyrl_warm_start.json holds the
    greedy and sampled success, tool-call rate and answer rate on the products' validation split, beside the same
    on sums and differences."""
    # lazy: pyrl.data loads torch, only when a warm-start runs
    from pyrl.data.tool_calc import (
        check_transfer_products,
        tool_calc_pairs,
        tool_transfer_conversations,
        tool_transfer_problems,
    )

    check_transfer_products(products)  # before the cache lookup: a misspelt value must not find another variant
    suffix = f"tool-transfer-sft-v{TRANSFER_VERSION}" + ("-guess" if products == "guessed" else "")
    if (train_size, val_size) != (20000, 256):
        suffix += f"-train{train_size}-val{val_size}"
    root, base, path = _tool_paths(cache_dir, seed, suffix)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    start = time.perf_counter()
    tokenizer, model, tools, examples = _tool_start(base)
    train, val = tool_transfer_problems(seed, train_size, val_size)
    conversations = tool_transfer_conversations(train, products, seed)
    evaluate = ToolCallEvaluator(tokenizer, val, tools)
    steps, metrics, _ = supervised_warm_start(
        model, examples(conversations), evaluate,
        lambda m: m["success"] >= SKILL_SUCCESS, seed=seed, eval_every=5, max_steps=max_steps,
        pad_token_id=tokenizer.pad_token_id, progress=progress, log_every=50,
        name=f"tool transfer warm-start (products {products}), sums and differences",
        goal=f"success >= {SKILL_SUCCESS:g}")
    on_products = ToolCallEvaluator(tokenizer, tool_calc_pairs(seed, val_size=val_size)[1], tools)
    greedy, sampled = on_products(model), on_products.sampled(model, seed=seed)
    seconds = time.perf_counter() - start
    log.info("tool transfer warm-start (SFT, products %s): %d steps in %.0f s; sums and differences: greedy success "
             "%.3f; products: greedy success %.3f, tool-call rate %.3f; sampled success %.3f, tool-call rate %.3f",
             products, steps, seconds, metrics["success"], greedy["success"], greedy["tool-call rate"],
             sampled["success"], sampled["tool-call rate"])
    _save(root, path, model, tokenizer, {
        "steps": steps, "seed": seed, "products": products, "seconds": round(seconds, 1),
        "sums_and_differences": metrics, "products_greedy": greedy, "products_sampled": sampled})
    return path
