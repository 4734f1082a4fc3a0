"""Supervised fine-tuning (pyrl.trainer.sft_trainer, verl 0.9.1's entry and keys): the conversations' tokens and
loss masks by hand, the first step's loss against a float64 transcription of verl's sft_loss on the same batch
(two ranks, micro-batched), a resumed run equal to an uninterrupted one, the hf_model output trained on by
pyrl.ppo, and the refusals before any worker starts."""

import glob
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pyrl.data.sft_dataset import MultiTurnSFTDataset, sft_batch


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pyrl.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("pyrl:tiny", "model"))


def data_config(**overrides):
    base = dict(messages_key="messages", tools_key="tools", enable_thinking_key="enable_thinking",
                enable_thinking_default=None, max_length=1024, truncation="error", apply_chat_template_kwargs={},
                ignore_input_ids_mismatch=False, shuffle=False, seed=0)
    return SimpleNamespace(**{**base, **overrides})


def conversations_file(path, conversations, extra=None) -> str:
    rows = [{"messages": c, **(extra[i] if extra else {})} for i, c in enumerate(conversations)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+7="},
        {"role": "assistant", "content": "<answer>19</answer>"}, {"role": "user", "content": "and 1+1="},
        {"role": "assistant", "content": "<answer>2</answer>"}]


def test_turns_and_loss_mask_by_hand(tokenizer, tmp_path):
    """The tiny template renders `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n` per message: the loss is on each
    assistant message's content, <|im_end|> and newline, never on its header or another role's tokens."""
    dataset = MultiTurnSFTDataset(conversations_file(tmp_path / "c.parquet", [CHAT]), tokenizer, data_config())
    ids, mask = dataset[0]
    expected_ids, expected_mask = [], []
    for message in CHAT:
        header = tokenizer(f"<|im_start|>{message['role']}\n", add_special_tokens=False)["input_ids"]
        body = tokenizer(f"{message['content']}<|im_end|>\n", add_special_tokens=False)["input_ids"]
        expected_ids += header + body
        expected_mask += [0] * len(header) + [int(message["role"] == "assistant")] * len(body)
    assert ids == expected_ids and mask == expected_mask
    assert ids == tokenizer(tokenizer.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]


def test_a_tool_conversation_trains_the_calls_and_answers_not_the_results(tmp_path):
    """The tool task's demonstrations (the tools column in the chat template of message 0) with the tool-calling
    tiny model's hermes-style template: the mask equals pyrl.models.warm_start.assistant_mask on the whole rendered
    conversation (written apart: it finds each assistant header and trains through its <|im_end|>), plus the
    newline after that <|im_end|>, which verl's per-turn mask trains."""
    from transformers import AutoTokenizer

    from pyrl.data.tool_calc import calculator_schema, tool_calc_demonstration
    from pyrl.models import resolve_model_path
    from pyrl.models.warm_start import assistant_mask

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("pyrl:tiny-tool", "model"))
    chats = [tool_calc_demonstration(12, 34), tool_calc_demonstration(905, 3)]
    path = conversations_file(tmp_path / "t.parquet", chats, [{"tools": [calculator_schema()]}] * 2)
    dataset = MultiTurnSFTDataset(path, tokenizer, data_config())
    for i, chat in enumerate(chats):
        ids, mask = dataset[i]
        whole = tokenizer(tokenizer.apply_chat_template(chat, tools=[calculator_schema()], tokenize=False),
                          add_special_tokens=False)["input_ids"]
        # verl trains the newline the template puts after an assistant's <|im_end|> too
        expected = assistant_mask(tokenizer, whole)
        for j in range(1, len(whole)):
            if expected[j - 1] and not expected[j] and whole[j - 1] == tokenizer.eos_token_id:
                expected[j] = 1
        assert ids == whole and mask == expected
        assert "<tool_call>" in tokenizer.decode([t for t, m in zip(ids, mask) if m])


def test_a_template_that_renders_turns_differently_in_context(tokenizer, tmp_path):
    """A template numbering its turns renders message 2 alone as turn 1: stop naming the row, or with
    ignore_input_ids_mismatch keep the per-turn tokens."""
    numbered = ("{% for m in messages %}<|im_start|>{{ loop.index }} {{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = conversations_file(tmp_path / "c.parquet", [CHAT[1:3], CHAT[1:3]])
    dataset = MultiTurnSFTDataset(path, tokenizer, data_config(), chat_template=numbered)
    with pytest.raises(ValueError, match=r"row 0: the conversation's turns tokenized one by one .* differ"):
        dataset[0]
    kept = MultiTurnSFTDataset(path, tokenizer, data_config(ignore_input_ids_mismatch=True), chat_template=numbered)
    ids, mask = kept[1]
    alone = [tokenizer(tokenizer.apply_chat_template([m], tokenize=False, chat_template=numbered),
                       add_special_tokens=False)["input_ids"] for m in CHAT[1:3]]
    assert ids == alone[0] + alone[1] and sum(mask) > 0


def test_rows_tokenized_in_batches_are_each_rows_own(tokenizer, tmp_path):
    """The trainer tokenizes 64 rows at a time (MultiTurnSFTDataset.__getitems__ renders them, then tokenizes every
    text in one call), here in two worker processes and in this one: each row's tokens are its whole conversation
    rendered, in row order, over chunks of mixed lengths and a partial last one; in a chunk, a row the template
    renders differently in context is named by its own index."""
    from pyrl.trainer.sft_trainer import tokenized

    chats = [[{"role": m["role"], "content": m["content"].replace("7", str(i))} for m in CHAT[:(2, 3, 5)[i % 3]]]
             for i in range(135)]
    dataset = MultiTurnSFTDataset(conversations_file(tmp_path / "c.parquet", chats), tokenizer, data_config())
    for workers in (0, 2):
        rows = tokenized(dataset, workers)
        assert [ids for ids, _ in rows] == [
            tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
            for chat in chats]
        assert [mask for _, mask in rows] == [dataset[i][1] for i in range(len(chats))]
    numbered = ("{% for m in messages %}<|im_start|>{{ loop.index }} {{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    mixed = MultiTurnSFTDataset(conversations_file(tmp_path / "m.parquet", [CHAT[1:2], CHAT[1:3], CHAT[1:2]]),
                                tokenizer, data_config(), chat_template=numbered)
    with pytest.raises(ValueError, match=r"row 1: the conversation's turns tokenized one by one"):
        mixed.__getitems__([0, 1, 2])


def test_truncation_keeps_or_stops(tokenizer, tmp_path):
    path = conversations_file(tmp_path / "c.parquet", [CHAT])
    full, full_mask = MultiTurnSFTDataset(path, tokenizer, data_config())[0]
    with pytest.raises(ValueError, match="row 0: the conversation has .* over data.max_length=10"):
        MultiTurnSFTDataset(path, tokenizer, data_config(max_length=10))[0]
    assert MultiTurnSFTDataset(path, tokenizer, data_config(max_length=10, truncation="right"))[0] == \
        (full[:10], full_mask[:10])
    assert MultiTurnSFTDataset(path, tokenizer, data_config(max_length=10, truncation="left"))[0] == \
        (full[-10:], full_mask[-10:])


def test_the_batch_layout_scores_each_token_after_the_first(tokenizer):
    """The actor's batch: token 0 the prompt, the rest the response; response_mask = the loss mask shifted."""
    batch = sft_batch([([5, 6, 7], [0, 1, 1]), ([8, 9], [0, 1])], pad_token_id=0)
    assert batch.batch["prompts"].tolist() == [[5], [8]]
    assert batch.batch["responses"].tolist() == [[6, 7], [9, 0]]
    assert batch.batch["response_mask"].tolist() == [[1, 1], [1, 0]]
    assert batch.batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


# ---- whole runs ----

RUN = ["model.path=pyrl:tiny", "trainer.n_gpus_per_node=0", "trainer.n_cpu_workers_per_node=2",
       "data.train_files=pyrl:toy_addition_sft", "data.train_batch_size=16",
       "engine.dtype=float32", "model.enable_gradient_checkpointing=false", "optim.lr=3e-3",
       "trainer.logger=[jsonl]", "data.use_dynamic_bsz=false", "data.micro_batch_size_per_gpu=3"]


def run_sft(args, cwd, timeout=600):
    return subprocess.run([sys.executable, "-m", "pyrl.trainer.sft_trainer", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def sft_here(args) -> dict:
    """The same run as `python -m pyrl.trainer.sft_trainer ARGS`, in this process, on the session's Ray (a fresh
    process costs ~10 CPU-seconds more: imports, tokenizer, Ray's start); the refusals below go through the command
    line, which turns their errors into its last line."""
    from pyrl.trainer.sft_trainer import compose_sft_config
    from pyrl.trainer.sft_trainer import run_sft as run_sft_here

    return run_sft_here(compose_sft_config(args))


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def nll_token_mean(model_dir: str, samples) -> float:
    """verl's sft_loss, transcribed in float64: -sum(log p(token) x mask) / sum(mask) over the conversations."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    total, count = 0.0, 0
    for ids, mask in samples:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
        token_logp = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        weights = torch.tensor(mask[1:], dtype=torch.float64)
        total += float(-(token_logp * weights).sum())
        count += int(weights.sum())
    return total / count


def test_the_losses_are_verls_sft_loss(tokenizer, tmp_path, ray_session):
    """Step 1 on two ranks in micro-batches of 3 (16 rows: 8 per rank) reports the token mean of -log p over the
    assistant tokens of the first batch's 16 conversations (trainer.seed's shuffle) under the initial weights; its
    validation (5 conversations: a count the two ranks do not split, made up with rows that carry no loss) the same
    under the weights after the step (the step's hf_model export); both computed here in float64."""
    from pyrl.data import toy_sft_task_files
    from pyrl.data.dataset import StatefulSampler
    from pyrl.models import resolve_model_path

    val = tmp_path / "val.parquet"
    pq.write_table(pq.read_table(toy_sft_task_files().val).slice(0, 5), val)
    sft_here([*RUN, "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path}/run",
              f"data.val_files={val}", "checkpoint.save_contents=[model,optimizer,extra,hf_model]"])
    first = metrics(f"{tmp_path}/run")[0]
    train = MultiTurnSFTDataset(toy_sft_task_files().train, tokenizer, data_config())
    first_batch = StatefulSampler(len(train), 16, True, seed=1).next_batch()  # trainer.seed's default
    expected = nll_token_mean(resolve_model_path("pyrl:tiny", "model"), [train[i] for i in first_batch])
    assert first["train/loss"] == pytest.approx(expected, rel=1e-5)
    held = MultiTurnSFTDataset(str(val), tokenizer, data_config())
    after = nll_token_mean(f"{tmp_path}/run/global_step_1/huggingface", [held[i] for i in range(5)])
    assert first["val/loss"] == pytest.approx(after, rel=1e-5)


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, ray_session):
    """4 steps at once, or 2 steps, then the same command for 4: the same losses at steps 3 and 4 (the weights,
    the optimizer and the sampler come back); the checkpoint's huggingface/ is a whole model (hf_model). The
    resuming run goes through the command line."""
    sft_here([*RUN, "trainer.total_training_steps=4", f"trainer.default_local_dir={tmp_path}/whole"])
    resumed = [*RUN, "trainer.save_freq=2", f"trainer.default_local_dir={tmp_path}/resumed",
               "checkpoint.save_contents=[model,optimizer,extra,hf_model]"]
    sft_here([*resumed, "trainer.total_training_steps=2"])
    second = run_sft([*resumed, "trainer.total_training_steps=4"], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr + second.stdout
    got = metrics(f"{tmp_path}/resumed")
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for a, b in zip(metrics(f"{tmp_path}/whole"), got):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-6), (a, b)
    assert os.path.exists(f"{tmp_path}/resumed/global_step_4/huggingface/model.safetensors")


def test_the_hf_model_output_trains_with_pyrl_ppo(tmp_path, ray_session):
    """SFT, then RL from its output directory as is."""
    from trainer_helpers import compose

    from pyrl.ppo import run_ppo

    sft_here([*RUN, "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path}/sft",
              "checkpoint.save_contents=[model,optimizer,extra,hf_model]"])
    model = f"{tmp_path}/sft/global_step_2/huggingface"
    run_ppo(compose("preset=toy", f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=hf",
                    "trainer.n_gpus_per_node=0", "data.train_batch_size=8",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=2",
                    "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
                    "trainer.logger=[jsonl]", f"trainer.default_local_dir={tmp_path}/ppo"))
    assert metrics(f"{tmp_path}/ppo")[0]["step"] == 1


def test_lora_trains_the_adapters_and_exports_a_merged_model(tmp_path, ray_session):
    """model.lora_rank: the loss falls over 4 steps, and huggingface/ is a plain model (no adapter keys) whose
    weights differ from the start only in the adapted layers' merged products, its tokenizer rendering with
    model.custom_chat_template (as verl saves it); the whole weights are written there only, not also beside the
    actor's shards."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from pyrl.models import resolve_model_path
    from pyrl.trainer.sft_trainer import compose_sft_config
    from pyrl.trainer.sft_trainer import run_sft as run_sft_here

    config = compose_sft_config([*RUN, "trainer.total_training_steps=4", "model.lora_rank=4", "model.lora_alpha=8",
                                 f"trainer.default_local_dir={tmp_path}/lora",
                                 "checkpoint.save_contents=[model,optimizer,extra,hf_model]"])
    base = resolve_model_path("pyrl:tiny", "model")
    config.model.custom_chat_template = AutoTokenizer.from_pretrained(base).chat_template + "{# pyrl's test #}"
    run_sft_here(config)
    exported = f"{tmp_path}/lora/global_step_4/huggingface"
    assert AutoTokenizer.from_pretrained(exported).chat_template == config.model.custom_chat_template
    assert not glob.glob(f"{tmp_path}/lora/global_step_4/actor/huggingface/*.safetensors")
    losses = [m["train/loss"] for m in metrics(f"{tmp_path}/lora")]
    assert losses[-1] < losses[0]
    merged = load_file(f"{exported}/model.safetensors")
    start = load_file(os.path.join(base, "model.safetensors"))
    assert not [k for k in merged if "lora" in k]
    if "lm_head.weight" not in start:  # a tied head, written out by the export: the embedding itself
        assert torch.equal(merged.pop("lm_head.weight"), merged["model.embed_tokens.weight"])
    assert set(merged) == set(start)
    changed = {k for k in merged if not torch.equal(merged[k], start[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed), sorted(changed)


@pytest.mark.parametrize("args, message", [
    (["engine.ulysses_sequence_parallel_size=2"], "engine.ulysses_sequence_parallel_size=2 is not supported"),
    (["data.pad_mode=right"], "data.pad_mode='right' is not supported"),
    (["trainer.test_freq=5"], "trainer.test_freq=5 validates, and data.val_files is empty"),
    (["trainer.save_freq=0"], "trainer.save_freq=0: expected a positive step count"),
    (["+data.colour=blue"], "data.colour"),
    (["checkpoint.save_contents=[model]"], "checkpoints always hold model, optimizer and extra"),
    (["optim.lr=nan"], "optim.lr=nan: expected a number"),
    (["optim.lr=-1"], "optim.lr=-1.0: expected >= 0"),
    (["data.max_length=1"], "data.max_length=1: expected >= 2"),
    (["+model.override_config.no_such_field=1"], "model.override_config: ['no_such_field'] are not fields of"),
    (["+model.override_config.vocab_size=100"], "model.path's vocab_size is 100"),
])
def test_refusals_before_any_worker(tmp_path, args, message):
    proc = run_sft(["model.path=pyrl:tiny", "data.train_files=pyrl:toy_addition_sft", *args], tmp_path, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


@pytest.mark.parametrize("override, message", [
    ("optim.clip_grad=0", "optim.clip_grad=0.0: expected > 0"),
    ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio=1.5: expected 0 <= value <= 1"),
    ("trainer.total_epochs=0", "trainer.total_epochs=0: expected >= 1"),
    ("trainer.total_training_steps=0", "trainer.total_training_steps=0: expected null or >= 1"),
    ("nccl_timeout=0", "nccl_timeout=0: expected >= 1"),
    ("optim.warmup_style=linear", "optim.warmup_style: expected constant or cosine"),
    ("model.lora_rank=-4", "model.lora_rank: expected >= 0"),
    ("model.lora_adapter_path=/tmp/adapter", "model.lora_adapter_path is set but model.lora_rank is 0"),
    ("engine.dtype=float16", "engine.dtype='float16' is not supported (float16 training needs loss scaling"),
    ("engine.model_dtype=fp16", "engine.model_dtype='fp16' is not supported"),
    ("+engine.mixed_precision.param_dtype=fp16", "engine.mixed_precision.param_dtype='fp16' is not supported"),
    ("trainer.device=npu", "trainer.device='npu' is not supported"),
])
def test_values_the_start_checks_refuse(override, message):
    """check_sft_config, in this process (the command line's own refusals are above): values verl 0.9.1 would
    train on with something else (no gradient, an LR below zero, the whole model instead of the adapter)."""
    from pyrl.trainer.sft_trainer import check_sft_config, compose_sft_config

    with pytest.raises(Exception, match=re.escape(message)):
        check_sft_config(compose_sft_config(["model.path=pyrl:tiny", override]))


def test_deprecated_warmup_style_sets_the_schedule():
    """optim.warmup_style=cosine is verl's deprecated spelling of lr_scheduler_type=cosine: taken, with a warning."""
    from pyrl.trainer.sft_trainer import check_sft_config, compose_sft_config, ppo_config_of

    config = compose_sft_config(["model.path=pyrl:tiny", "optim.warmup_style=cosine"])
    check_sft_config(config)
    assert ppo_config_of(config).actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"


@pytest.mark.parametrize("schedule", [[], ["optim.total_training_steps=50"]], ids=["run_steps", "own_lr_span"])
def test_more_steps_than_the_epochs_hold_is_refused_before_any_worker(schedule):
    """verl 0.9.1 stops after trainer.total_epochs whatever trainer.total_training_steps says (9,488 conversations
    in batches of 16: 593 steps an epoch, 1,779 in 3); pyrl says so before any worker starts, with an LR schedule
    span of its own (optim.total_training_steps) too."""
    from pyrl.trainer import workers

    started = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(workers, "build_workers", lambda *a: started.append(a))
        with pytest.raises(ValueError, match=re.escape("trainer.total_training_steps=2000 is more than "
                                                       "trainer.total_epochs=3 epochs of 593 steps")) as error:
            sft_here(["model.path=pyrl:tiny", "data.train_files=pyrl:toy_addition_sft", "data.train_batch_size=16",
                      "trainer.total_training_steps=2000", "trainer.total_epochs=3", "trainer.n_gpus_per_node=0",
                      *schedule])
    assert "set trainer.total_epochs=4 or fewer steps" in str(error.value) and not started
