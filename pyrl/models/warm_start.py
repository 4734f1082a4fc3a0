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
afterwards is RL's improvement. Each is one or two runs of pyrl's SFT trainer (pyrl.trainer.sft_trainer, its
keys in sft_until) in a Python process of their own, stopped by an evaluation after each checkpoint. Deterministic
from the seed on one machine (another CPU's rounding takes another trajectory: the toy recipe meets its target for
trainer seeds 0-4, the tool recipe on both machines tried; benchmarks/RESULTS.md), cached like the tiny model
(made in a temp dir, renamed into place, one maker at a time)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

from pyrl.models.tiny import TinyModelSpec, _write_once, default_cache_dir, tiny_model_path

log = logging.getLogger("pyrl")

VERSION = 5  # the toy warm-start's; bumped when its result changes (names its cache directory); 3: toy task v2;
# 4: made by pyrl's SFT trainer (was a loop of its own); 5: lr 1e-3 (3e-3 met the target on some machines only)
TOOL_VERSION = 2  # the tool warm-start's; 2: made by pyrl's SFT trainer


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


def conversations_file(path: str, conversations, tools=None) -> str:
    """The conversations as an SFT data file (data.messages_key "messages", data.tools_key "tools")."""
    # lazy: pyarrow loads only when a warm-start runs
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"messages": c, **({"tools": tools} if tools else {})}
                                         for c in conversations]), path)
    return path


def sft_until(name: str, goal: str, *, base: str, train_file: str, evaluate, done, work_dir: str, seed: int,
              max_steps: int, eval_every: int, save_every: int | None = None, score=None, batch_size: int = 128,
              lr: float = 3e-3, lr_scheduler: str = "constant", min_lr_ratio: float = 0.0, log_every: int = 250,
              progress: bool = True) -> tuple[str, int, dict, bool]:
    """A run of pyrl's SFT trainer (python -m pyrl.trainer.sft_trainer, run_sft) in this process, from the model in
    `base` on the conversations of `train_file` (the loss on the assistant turns), until done(evaluate(model)).

    The trainer's keys: data.train_batch_size=batch_size (drawn in shuffled epochs, trainer.seed=seed), AdamW at
    optim.lr=lr with optim.lr_scheduler_type=lr_scheduler (constant, or cosine down to min_lr_ratio x lr at
    max_steps) (weight decay 0.01, gradients clipped to norm 1: verl's defaults), float32, one CPU worker (the same
    model on every machine), trainer.total_training_steps=max_steps, a checkpoint with its hf_model every save_every
    steps (trainer.save_freq; default eval_every), no gradient checkpointing (a tiny model).

    Every eval_every steps and at max_steps (SFTTrainer.fit's after_save) evaluate(model) -> {label: value} on the
    checkpoint's Hugging Face model; once done(metrics) the run stops and the earliest checkpoint since the last
    evaluation that is done is kept (save_every < eval_every finds a goal crossed between evaluations, at the cost of
    a save, not an evaluation, per save_every steps). If max_steps pass first, the model of the best score(metrics)
    evaluated (default: the first value) is kept, with a warning naming `goal`. Returns (the kept model's directory
    under work_dir, its step, its metrics, reached). Progress: a log line every log_every steps."""
    # lazy: torch, transformers and the trainer load only when a warm-start runs
    import torch
    from transformers import AutoModelForCausalLM

    from pyrl.trainer import checkpoints
    from pyrl.trainer.sft_trainer import compose_sft_config, run_sft

    save_every = save_every or eval_every
    if eval_every % save_every:
        raise ValueError(f"{name}: eval_every={eval_every} is not a multiple of save_every={save_every}")
    score = score or (lambda m: next(iter(m.values())))
    run_dir = os.path.join(work_dir, "run")
    overrides = [f"model.path={base}", f"data.train_files={train_file}", f"data.train_batch_size={batch_size}",
                 f"optim.lr={lr}", f"optim.lr_scheduler_type={lr_scheduler}", f"optim.min_lr_ratio={min_lr_ratio}",
                 "engine.dtype=float32", "model.enable_gradient_checkpointing=false", "trainer.device=cpu",
                 "trainer.n_gpus_per_node=0", "trainer.n_cpu_workers_per_node=1",
                 f"trainer.total_training_steps={max_steps}", f"trainer.total_epochs={max_steps}",  # room for them
                 f"trainer.save_freq={save_every}",
                 f"trainer.max_ckpt_to_keep={eval_every // save_every + 1}", "trainer.resume_mode=disable",
                 f"trainer.seed={seed}", f"trainer.default_local_dir={run_dir}", "trainer.logger=[]",
                 "checkpoint.save_contents=[model,optimizer,extra,hf_model]"]
    config = compose_sft_config(overrides)
    kept = os.path.join(work_dir, "kept")
    state = {"score": float("-inf"), "metrics": {}, "steps": 0, "reached": False}

    def measure(step: int) -> dict:
        hf_dir = os.path.join(checkpoints.step_dir(run_dir, step), "huggingface")
        return evaluate(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32))

    def keep(step: int, metrics: dict, reached: bool) -> None:
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(os.path.join(checkpoints.step_dir(run_dir, step), "huggingface"), kept)
        state.update(score=score(metrics), metrics=metrics, reached=reached, steps=step)

    def after_save(step: int, step_dir: str) -> bool:
        if step % eval_every and step != max_steps:
            return False  # saved for a look back, should the next evaluation find the goal crossed
        metrics = measure(step)
        reached = bool(done(metrics))
        if progress and (step % log_every == 0 or reached or step == max_steps):
            log.info("%s (SFT trainer): step %d, greedy validation %s (%s)", name, step,
                     ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()), goal)
        if reached:
            previous = (step - 1) // eval_every * eval_every  # the last evaluation's step
            for earlier in range(previous + save_every, step, save_every):
                if os.path.isdir(checkpoints.step_dir(run_dir, earlier)):
                    found = measure(earlier)
                    if done(found):
                        if progress:
                            log.info("%s (SFT trainer): the goal was first met at step %d: %s", name, earlier,
                                     ", ".join(f"{k} {v:.3f}" for k, v in found.items()))
                        keep(earlier, found, True)
                        return True
            keep(step, metrics, True)
            return True
        if score(metrics) > state["score"]:
            keep(step, metrics, False)
        return False

    run_sft(config, after_save)
    if not state["reached"]:
        state["steps"] = max_steps
        warnings.warn(f"{name}: {goal} not reached after {max_steps} steps (best validation: "
                      f"{', '.join(f'{k} {v:.3f}' for k, v in state['metrics'].items())}); keeping the best model seen",
                      WarmStartWarning)
    return kept, state["steps"], state["metrics"], state["reached"]


def _finish(kept: str, out: str, info: dict) -> None:
    """The kept model (with its tokenizer and generation config, as the trainer's hf_model has them) and `info`
    (pyrl_warm_start.json) into `out`."""
    shutil.copytree(kept, out, dirs_exist_ok=True)
    with open(os.path.join(out, "pyrl_warm_start.json"), "w") as f:
        json.dump(info, f)


WARNINGS_FILE = ".pyrl_warnings.json"  # what a warm-start's own process warned, handed back to its caller


def _in_own_process(maker: str, kwargs: dict, out: str) -> None:
    """MAKERS[maker](out, work, **kwargs) in a fresh Python process (main), then its warnings
    repeated here. The SFT trainer starts a local Ray instance and its workers there, apart from whatever Ray the
    caller runs (a run's driver, a test session's cluster); RAY_ADDRESS is not passed on, so it never joins one."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    command = [sys.executable, "-c", "import sys; from pyrl.models.warm_start import main; main(sys.argv)", maker,
               json.dumps(kwargs), out]
    code = subprocess.run(command, env=env).returncode
    if code:
        raise RuntimeError(f"pyrl's {maker} warm-start (a run of pyrl.trainer.sft_trainer in its own process) failed "
                           f"with exit code {code}; its output is above. Command: {' '.join(command)}")
    path = os.path.join(out, WARNINGS_FILE)
    with open(path) as f:
        messages = json.load(f)
    os.remove(path)
    for message in messages:
        warnings.warn(message, WarmStartWarning, stacklevel=3)


def toy_warm_start_path(target_reward: float = 0.15, seed: int = 0, max_steps: int = 1000, cache_dir: str | None = None,
                        progress: bool = True) -> str:
    """The warm-started model's directory: pyrl's SFT trainer on the toy task's conversations
    (pyrl:toy_addition_sft's train split: each question and its right answer), from the tiny model: batches of 128,
    AdamW 1e-3 with a cosine decay to 10% over max_steps, greedy decoding on the validation split every 25 steps, a
    checkpoint every 5. The accuracy climbs fast once the model finds the digit alignment (0.05-0.1 at step 150-200,
    0.3-0.5 by 225-300 for trainer seeds 0-4), so the checkpoints between the last two evaluations are evaluated too
    and the first at the target is kept. (At 3e-3 the climb came at step 350 on one machine, after 1,000 steps or
    never on another: benchmarks/RESULTS.md.) If max_steps pass first, the best model seen is kept, with a warning."""
    root = cache_dir or default_cache_dir()
    base = tiny_model_path(TinyModelSpec(seed=seed), cache_dir=root)
    path = f"{base}-toy-sft-v{VERSION}-r{target_reward:g}"
    if not os.path.isfile(os.path.join(path, "config.json")):
        _write_once(root, path, lambda out: _in_own_process("toy", {
            "target_reward": target_reward, "seed": seed, "max_steps": max_steps, "base": base, "root": root,
            "progress": progress}, out))
    return path


def _make_toy(out: str, work: str, *, target_reward: float, seed: int, max_steps: int, base: str, root: str,
              progress: bool) -> None:
    # lazy: transformers and pyrl.data (torch) load only when a warm-start runs
    from transformers import AutoTokenizer

    from pyrl.data.toy import toy_pairs, toy_prompt, toy_sft_task_files

    tokenizer = AutoTokenizer.from_pretrained(base)
    _, val, _ = toy_pairs(seed)  # the test split is never looked at
    val_questions, val_truths = [toy_prompt(a, b) for a, b in val], [str(a + b) for a, b in val]
    kept, steps, metrics, _ = sft_until(
        "toy warm-start", f"target {target_reward:g}", base=base,
        train_file=toy_sft_task_files(seed, cache_dir=root).train,
        evaluate=lambda m: {"reward": greedy_reward(m, tokenizer, val_questions, val_truths)},
        done=lambda metrics: metrics["reward"] >= target_reward, work_dir=work, seed=seed, max_steps=max_steps,
        eval_every=25, save_every=5, lr=1e-3, lr_scheduler="cosine", min_lr_ratio=0.1, progress=progress)
    _finish(kept, out, {"steps": steps, "val_reward": metrics["reward"], "target_reward": target_reward,
                        "seed": seed})


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


def tool_warm_start_path(target_success: float = 0.1, seed: int = 0, max_steps: int = 1000,
                         cache_dir: str | None = None, progress: bool = True, train_size: int = 20000,
                         val_size: int = 256, batch_size: int = 128) -> str:
    """The tool task's warm-started model's directory: the tiny model's tools=True variant after two runs of pyrl's
    SFT trainer on demonstrations of pyrl.data.tool_calc's train split (whole conversations, the loss on the
    assistant turns only), each checked on the validation split by ToolCallEvaluator:

    1. skill: every demonstration calls the calculator; until greedy success >= SKILL_SUCCESS (the model has
       learned to copy the operands into the call and the result into the answer; 110-115 steps at seed 0: the
       counts move with float32 rounding, e.g. 115 + 70 on 2026-11-28, 110 + 240 once the head's weight gradient was
       added in place, benchmarks/RESULTS.md);
    2. habit, from stage 1's model with a fresh optimizer: demonstrations of a teacher that calls the calculator only
       sometimes (pyrl.data.tool_calc.TOOL_USE_*: 80% of the prompts whose first operand is >= 900, 20% of the
       others; otherwise a guessed answer), until greedy success >= target_success with a greedy tool-call rate
       <= MAX_CALL_RATE (70-240 steps at seed 0: the greedy policy then calls the tool for the first operands >= 900,
       about 15% of the prompts, and guesses elsewhere).

    Why not stop one stage of tool demonstrations at a low greedy success: the skill appears abruptly (greedy
    success 0 to 1 within ~10 steps) and a model caught on the way has flat distributions: at greedy success 0.21
    it succeeded in 0.05% of samples at temperature 1, so GRPO's groups would almost never hold a success. After
    stage 2 the model calls the tool in ~20% of samples and is right almost every time it does: RL has to learn to
    call it everywhere.

    batch_size conversations per step. At most max_steps per stage; if a stage's goal is not reached, its best
    model is kept, with a warning.
    pyrl_warm_start.json beside the weights records steps, greedy success, tool-call rate and answer rate, the
    same sampled, and the time taken."""
    root, base, path = _tool_paths(cache_dir, seed, f"tool-sft-v{TOOL_VERSION}-r{target_success:g}")
    if (train_size, val_size, batch_size) != (20000, 256, 128):
        path += f"-train{train_size}-val{val_size}-batch{batch_size}"
    if not os.path.isfile(os.path.join(path, "config.json")):
        _write_once(root, path, lambda out: _in_own_process("tool", {
            "target_success": target_success, "seed": seed, "max_steps": max_steps, "base": base,
            "progress": progress, "train_size": train_size, "val_size": val_size, "batch_size": batch_size}, out))
    return path


def _make_tool(out: str, work: str, *, target_success: float, seed: int, max_steps: int, base: str, progress: bool,
               train_size: int, val_size: int, batch_size: int) -> None:
    # lazy: transformers and pyrl.data (torch) load only when a warm-start runs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyrl.data.tool_calc import calculator_schema, tool_calc_demonstration, tool_calc_mixed, tool_calc_pairs

    start = time.perf_counter()
    tokenizer, tools = AutoTokenizer.from_pretrained(base), [calculator_schema()]
    train, val, _ = tool_calc_pairs(seed, train_size, val_size)  # the test split is never looked at
    evaluate = ToolCallEvaluator(tokenizer, val, tools)
    common = dict(evaluate=evaluate, max_steps=max_steps, progress=progress, log_every=50, batch_size=batch_size)
    skill, skill_steps, _, _ = sft_until(
        "tool warm-start 1/2, tool demonstrations", f"success >= {SKILL_SUCCESS:g}", base=base,
        train_file=conversations_file(os.path.join(work, "skill.parquet"),
                                      [tool_calc_demonstration(a, b) for a, b in train], tools),
        done=lambda m: m["success"] >= SKILL_SUCCESS, work_dir=os.path.join(work, "skill"), seed=seed, eval_every=5,
        **common)

    def habit_done(m):
        return m["success"] >= target_success and m["tool-call rate"] <= MAX_CALL_RATE

    kept, habit_steps, metrics, _ = sft_until(
        "tool warm-start 2/2, mixed demonstrations",
        f"success >= {target_success:g} with tool-call rate <= {MAX_CALL_RATE:g}", base=skill,
        train_file=conversations_file(os.path.join(work, "habit.parquet"), tool_calc_mixed(train, seed)[0], tools),
        done=habit_done, work_dir=os.path.join(work, "habit"), seed=seed + 1, eval_every=10,
        score=lambda m: m["success"] if m["tool-call rate"] <= MAX_CALL_RATE else -m["tool-call rate"], **common)
    sampled = evaluate.sampled(AutoModelForCausalLM.from_pretrained(kept), seed=seed)
    seconds = time.perf_counter() - start
    log.info("tool warm-start (SFT trainer): %d + %d steps in %.0f s; greedy validation success %.3f, tool-call "
             "rate %.3f; sampled success %.3f, tool-call rate %.3f", skill_steps, habit_steps, seconds,
             metrics["success"], metrics["tool-call rate"], sampled["success"], sampled["tool-call rate"])
    _finish(kept, out, {
        "steps": skill_steps + habit_steps, "skill_steps": skill_steps, "habit_steps": habit_steps,
        "success": metrics["success"], "call_rate": metrics["tool-call rate"], "answer_rate": metrics["answer rate"],
        "sampled_success": sampled["success"], "sampled_call_rate": sampled["tool-call rate"],
        "sampled_answer_rate": sampled["answer rate"], "target_success": target_success, "seed": seed,
        "train_size": train_size, "val_size": val_size, "seconds": round(seconds, 1)})


TRANSFER_VERSION = 2  # the transfer warm-start's; 2: made by pyrl's SFT trainer


def tool_transfer_warm_start_path(seed: int = 0, products: str = "absent", max_steps: int = 1000,
                                  cache_dir: str | None = None, progress: bool = True, train_size: int = 20000,
                                  val_size: int = 256, batch_size: int = 128) -> str:
    """The tool task's transfer variant (preset=tool_calc_transfer): the tiny tool model after a run of pyrl's SFT
    trainer on demonstrations of the calculator on sums and differences of the task's operands
    (pyrl.data.tool_calc.tool_transfer_problems), never on products, until greedy success on a validation set
    of sums and differences >= SKILL_SUCCESS (every such demonstration calls the tool). products:

    - "absent": no product in the training data at all (pyrl:tiny-tool-transfer-sft);
    - "guessed": a third of the examples are products answered without the calculator, by a wrong guess
      (pyrl:tiny-tool-transfer-guess-sft): the model has seen products and learned not to call the tool for them.

    (pyrl.data.tool_calc.tool_transfer_conversations.)

    What it does on products, the RL task, is measured and recorded, not trained: pyrl_warm_start.json holds the
    greedy and sampled success, tool-call rate and answer rate on the products' validation split, beside the same
    on sums and differences."""
    from pyrl.data.tool_calc import check_transfer_products  # lazy: pyrl.data loads torch

    check_transfer_products(products)  # before the cache lookup: a misspelt value must not find another variant
    suffix = f"tool-transfer-sft-v{TRANSFER_VERSION}" + ("-guess" if products == "guessed" else "")
    if (train_size, val_size, batch_size) != (20000, 256, 128):
        suffix += f"-train{train_size}-val{val_size}-batch{batch_size}"
    root, base, path = _tool_paths(cache_dir, seed, suffix)
    if not os.path.isfile(os.path.join(path, "config.json")):
        _write_once(root, path, lambda out: _in_own_process("tool_transfer", {
            "seed": seed, "products": products, "max_steps": max_steps, "base": base, "progress": progress,
            "train_size": train_size, "val_size": val_size, "batch_size": batch_size}, out))
    return path


def _make_transfer(out: str, work: str, *, seed: int, products: str, max_steps: int, base: str, progress: bool,
                   train_size: int, val_size: int, batch_size: int) -> None:
    # lazy: transformers and pyrl.data (torch) load only when a warm-start runs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyrl.data.tool_calc import (
        calculator_schema,
        tool_calc_pairs,
        tool_transfer_conversations,
        tool_transfer_problems,
    )

    start = time.perf_counter()
    tokenizer, tools = AutoTokenizer.from_pretrained(base), [calculator_schema()]
    train, val = tool_transfer_problems(seed, train_size, val_size)
    kept, steps, metrics, _ = sft_until(
        f"tool transfer warm-start (products {products}), sums and differences", f"success >= {SKILL_SUCCESS:g}",
        base=base, train_file=conversations_file(os.path.join(work, "train.parquet"),
                                                 tool_transfer_conversations(train, products, seed), tools),
        evaluate=ToolCallEvaluator(tokenizer, val, tools), done=lambda m: m["success"] >= SKILL_SUCCESS,
        work_dir=os.path.join(work, "run"), seed=seed, eval_every=5, max_steps=max_steps, progress=progress,
        log_every=50, batch_size=batch_size)
    model = AutoModelForCausalLM.from_pretrained(kept)
    on_products = ToolCallEvaluator(tokenizer, tool_calc_pairs(seed, val_size=val_size)[1], tools)
    greedy, sampled = on_products(model), on_products.sampled(model, seed=seed)
    seconds = time.perf_counter() - start
    log.info("tool transfer warm-start (SFT trainer, products %s): %d steps in %.0f s; sums and differences: greedy "
             "success %.3f; products: greedy success %.3f, tool-call rate %.3f; sampled success %.3f, tool-call rate "
             "%.3f", products, steps, seconds, metrics["success"], greedy["success"], greedy["tool-call rate"],
             sampled["success"], sampled["tool-call rate"])
    _finish(kept, out, {"steps": steps, "seed": seed, "products": products, "seconds": round(seconds, 1),
                        "sums_and_differences": metrics, "products_greedy": greedy, "products_sampled": sampled})


class WarmStartWarning(UserWarning):
    """A warm-start's goal not reached (its best model kept): handed from its own process to the caller."""


MAKERS = {"toy": _make_toy, "tool": _make_tool, "tool_transfer": _make_transfer}


def main(argv: list[str]) -> None:
    """argv [_, MAKER, KWARGS_JSON, OUT]: MAKERS[MAKER] writes the warm-started model into the
    directory OUT (_in_own_process runs it), its WarmStartWarnings into OUT/WARNINGS_FILE."""
    maker, kwargs, out = argv[1], json.loads(argv[2]), argv[3]
    logging.basicConfig(level=logging.INFO if kwargs.get("progress", True) else logging.WARNING,
                        format="[pyrl] %(message)s")
    with (tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out)), prefix=".tmp-sft-") as work,
          warnings.catch_warnings(record=True) as caught):
        warnings.simplefilter("always", WarmStartWarning)
        MAKERS[maker](out, work, **kwargs)
    with open(os.path.join(out, WARNINGS_FILE), "w") as f:
        json.dump([str(w.message) for w in caught if issubclass(w.category, WarmStartWarning)], f)
    for w in caught:  # the others as Python would have shown them
        if not issubclass(w.category, WarmStartWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)

