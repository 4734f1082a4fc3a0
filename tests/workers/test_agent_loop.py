"""The tool agent loop with a model that calls tools: pyrl's tiny tool model, warm-started to call the calculator
on the tool task. Through the rollout workers (vllm and hf engines, greedy): the same tokens, masks and
log-probs; the multi-turn batch's log-probs and policy loss against float64 references that mask the tool
tokens; in-process: tools that fail every way, and an interaction that answers the model."""

from __future__ import annotations

import importlib.resources
import re
import textwrap

import numpy as np
import pytest
import torch
from worker_helpers import hf_response_logprobs, make_config

from pyrl.controller import ResourcePool, WorkerGroup
from pyrl.data.tool_calc import TOOL_USE_FROM, tool_calc_pairs, tool_calc_prompt
from pyrl.protocol import DataProto, left_padded
from pyrl.workers.actor import ActorRolloutRefWorker

PROMPT, RESPONSE = 32, 64
CALCULATOR = str(importlib.resources.files("pyrl.configs").joinpath("tools/calculator.yaml"))


@pytest.fixture(scope="module")
def tool_model():
    from pyrl.models.hub import resolve_model_path

    return resolve_model_path("pyrl:tiny-tool-sft")


def tool_config(tool_model, engine: str, *overrides: str):
    return make_config(f"actor_rollout_ref.model.path={tool_model}", f"actor_rollout_ref.rollout.name={engine}",
                       f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}",
                       "actor_rollout_ref.rollout.multi_turn.enable=true",
                       f"actor_rollout_ref.rollout.multi_turn.tool_config_path={CALCULATOR}",
                       "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                       "actor_rollout_ref.rollout.calculate_log_probs=true",
                       "actor_rollout_ref.rollout.load_format=auto",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=16", *overrides)


def task_pairs(rows: int, tool_users: int) -> list[tuple[int, int]]:
    """Validation pairs: `tool_users` whose first operand makes the warm-started model call the calculator
    (it calls it, greedily, only from TOOL_USE_FROM up; RL teaches the rest), then others, alternating."""
    _, val, _ = tool_calc_pairs()
    users = [p for p in val if p[0] >= TOOL_USE_FROM][:tool_users]
    others = [p for p in val if p[0] < TOOL_USE_FROM][:rows - tool_users]
    mixed = [p for pair in zip(users, others) for p in pair]
    return mixed + users[len(mixed) // 2:] + others[len(mixed) // 2:]


def task_prompts(tokenizer, rows: int, schemas, tool_users: int) -> DataProto:
    """The tool task's validation prompts, rendered with the tools as the trainer's dataset renders them."""
    pairs = task_pairs(rows, tool_users)
    messages = [[{"role": "user", "content": tool_calc_prompt(a, b)}] for a, b in pairs]
    ids = [tokenizer(tokenizer.apply_chat_template(m, tools=schemas, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"] for m in messages]
    input_ids, mask = left_padded(ids, tokenizer.pad_token_id, PROMPT)
    raw = np.empty(rows, dtype=object)
    raw[:] = messages
    truth = np.array([{"ground_truth": str(a * b)} for a, b in pairs], dtype=object)
    return DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": mask},
                               non_tensors={"raw_prompt": raw, "reward_model": truth})


@pytest.fixture(scope="module")
def rollouts(tool_model, ray_session):
    """The same 16 greedy prompts through the vllm and the hf rollout workers, and through two ranks sharing one vllm
    engine (rollout.tensor_model_parallel_size=2: the group's leader runs every turn of all 16, its follower each
    engine call with it)."""
    from transformers import AutoTokenizer

    from pyrl.tools.tool_registry import load_all_tools

    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    schemas = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
               for t in load_all_tools(CALCULATOR, None)]
    prompts = task_prompts(tokenizer, 16, schemas, tool_users=8)
    prompts.meta_info.update(do_sample=False, calculate_log_probs=True)
    out = {}
    for engine in ("vllm", "vllm-tp2", "hf"):
        if engine.startswith("vllm"):
            pytest.importorskip("vllm")
        tp = 2 if engine == "vllm-tp2" else 1
        config = tool_config(tool_model, engine.removesuffix("-tp2"),
                             f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}")
        wg = WorkerGroup(ResourcePool([tp]), ActorRolloutRefWorker, config.actor_rollout_ref, "actor_rollout")
        wg.init_model()
        out[engine] = wg.generate_sequences(prompts)
        if engine == "hf":
            out["worker"] = wg  # the hf group stays up for the log-prob and update checks
        else:
            wg.kill()
    yield tokenizer, out
    out["worker"].kill()


@pytest.mark.parametrize("engine", ["vllm", "vllm-tp2"])
def test_vllm_and_hf_give_the_same_multi_turn_trajectories(rollouts, engine):
    tokenizer, out = rollouts
    vllm, hf = out[engine], out["hf"]
    assert torch.equal(vllm.batch["responses"], hf.batch["responses"])
    assert torch.equal(vllm.batch["response_mask"], hf.batch["response_mask"])
    assert torch.equal(vllm.batch["attention_mask"], hf.batch["attention_mask"])
    trained = hf.batch["response_mask"].bool()
    torch.testing.assert_close(vllm.batch["rollout_log_probs"][trained], hf.batch["rollout_log_probs"][trained],
                               atol=2e-4, rtol=0)
    assert (hf.batch["rollout_log_probs"][~trained] == 0).all()
    for key in ("__num_turns__", "tool_call_counts", "tool_error_counts"):
        assert np.array_equal(vllm.non_tensor_batch[key], hf.non_tensor_batch[key])
    # the test means something only if the model called the tool, got an answer and went on
    calls = hf.non_tensor_batch["tool_call_counts"]
    assert (calls > 0).sum() >= 4 and (hf.non_tensor_batch["__num_turns__"] >= 4).sum() >= 4
    text = tokenizer.decode(hf.batch["responses"][int(np.argmax(calls))])
    assert "<tool_call>" in text and "<tool_response>" in text
    # holes: tool tokens inside the response are attended (attention 1) and not trained (mask 0)
    width = hf.batch["responses"].shape[1]
    attended = hf.batch["attention_mask"][:, -width:].bool()
    holes = attended & ~trained
    assert holes.any() and (trained <= attended).all()
    first_hole_rows = holes.any(-1)
    last_trained = width - 1 - trained.flip(-1).int().argmax(-1)
    assert (holes.int().argmax(-1)[first_hole_rows] < last_trained[first_hole_rows]).all()  # model tokens after them


def test_multi_turn_log_probs_and_loss_equal_float64_references_that_mask_tool_tokens(rollouts, tool_model):
    _, out = rollouts
    batch, wg = out["hf"], out["worker"]
    want_logp, _ = hf_response_logprobs(tool_model, batch)
    got = wg.compute_log_prob(batch).batch["old_log_probs"]
    attended = batch.batch["attention_mask"][:, -batch.batch["responses"].shape[1]:].bool()
    torch.testing.assert_close(got[attended].double(), want_logp[attended], atol=2e-5, rtol=1e-5)  # fp32 vs fp64

    # one update step's loss: ratio 1 (old = current), so token-mean pg_loss = -sum(A * mask) / sum(mask) with the
    # tool tokens' advantages deliberately large: counting them would change the loss
    mask = batch.batch["response_mask"].double()
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    advantages = advantages + 10.0 * (attended.double() - mask)
    update = DataProto.from_dict(tensors={**{k: batch.batch[k] for k in batch.batch.keys()},
                                          "old_log_probs": got, "advantages": advantages.float()})
    update.meta_info["temperature"] = 1.0
    metrics = wg.update_actor(update).meta_info["metrics"]
    want = -(advantages * mask).sum() / mask.sum()
    assert np.mean(metrics["actor/pg_loss"]) == pytest.approx(want.item(), abs=1e-5)


def _in_process_loop(tool_model, tools, interactions=None, response_length=RESPONSE, **multi_turn):
    from transformers import AutoTokenizer

    from pyrl.experimental.agent_loop.agent_loop import AgentLoopRunner
    from pyrl.workers.rollout.hf_engine import HFEngine

    config = tool_config(tool_model, "hf").actor_rollout_ref
    config.rollout.response_length = response_length
    for key, value in multi_turn.items():
        setattr(config.rollout.multi_turn, key, value)
    tokenizer = AutoTokenizer.from_pretrained(tool_model)
    engine = HFEngine(tool_model, config.rollout, torch.device("cpu"), tokenizer)
    runner = AgentLoopRunner(engine, tokenizer, config, tools, interactions)
    return runner, tokenizer


def _run(runner, tokenizer, rows: int, **row):
    from pyrl.workers.rollout.base import SamplingSpec

    schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in runner.tools]
    prompts = task_prompts(tokenizer, rows, schemas, tool_users=rows)
    ids = [r[m.bool()].tolist() for r, m in zip(prompts.batch["input_ids"], prompts.batch["attention_mask"])]
    return runner.run([{"agent_name": "tool_agent", "raw_prompt": messages, "raw_prompt_ids": prompt, **row}
                       for messages, prompt in zip(prompts.non_tensor_batch["raw_prompt"], ids)],
                      dict(temperature=0.0, logprobs=True),
                      SamplingSpec(n=1, do_sample=False, logprobs=True,
                                   max_tokens=runner.trainer_config.actor_rollout_ref.rollout.response_length)).outputs


def _runs(mask: list[int], value: int) -> list[tuple[int, int]]:
    """[start, end) of each run of `value` in a response mask: the model's turns (1), the appended ones (0)."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [None]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_tools_that_fail_never_stop_the_rollout(tool_model, tmp_path):
    """The model calls `calculator`; here that name runs a function that raises, hangs, or returns megabytes,
    by the first operand's residue. Every trajectory still finishes, with the error as the tool's answer."""
    from pyrl.tools.tool_registry import load_all_tools

    path = tmp_path / "bad_tools.py"
    path.write_text(textwrap.dedent('''
        import time
        from pyrl.tools.function_tool import function_tool

        @function_tool
        def calculator(expression: str) -> str:
            """Evaluates an arithmetic expression.

            Args:
                expression: the expression
            """
            first = int("".join(c for c in expression.split("*")[0] if c.isdigit()) or 0)
            if first % 3 == 0:
                raise RuntimeError("calculator crashed")
            if first % 3 == 1:
                time.sleep(5)  # past tool_timeout_s; short, as a sync function's thread cannot be killed
            return "7" * 3_000_000
    '''))
    # room for the error messages in the response (a tool response past the budget ends the trajectory unappended;
    # the response's tokens are where the tool's answers are seen)
    response_length = 2 * RESPONSE
    runner, tokenizer = _in_process_loop(tool_model, load_all_tools(None, str(path)), tool_timeout_s=1.0,
                                         max_tool_response_length=40, response_length=response_length)
    outputs = _run(runner, tokenizer, 12)
    called = [o for o in outputs if o.extra_fields["tool_call_counts"]]
    assert len(called) >= 4
    # the tool responses as the template renders them in the response (attended, not trained)
    texts = [text for o in called for text in re.findall(
        r"<tool_response>(.*?)</tool_response>",
        "".join(tokenizer.decode(o.response_ids[a:b], skip_special_tokens=False)
                for a, b in _runs(o.response_mask, 0)), re.S)]
    assert any(text == "Error executing tool 'calculator': calculator crashed" for text in texts)
    assert any(text == "Error: tool 'calculator' timed out after 1 s" for text in texts)
    assert "7" * 20 + "...(truncated)..." + "7" * 20 in texts  # 3 MB cut to max_tool_response_length, as verl
    assert all(text.startswith("Error") or text == "7" * 20 + "...(truncated)..." + "7" * 20 for text in texts)
    assert sum(o.extra_fields["tool_error_counts"] for o in called) == sum(text.startswith("Error") for text in texts)
    assert sum(o.extra_fields["tool_call_counts"] for o in called) == len(texts)
    for o in outputs:
        assert len(o.response_ids) == len(o.response_mask) == len(o.response_logprobs) <= response_length


def test_an_interaction_answers_turns_without_tool_calls(tool_model, tmp_path):
    """guess_number as the simulated user: each answer the model gives is judged; a wrong one gets "higher" or
    "lower" as a user turn (mask 0) and the model goes on, until max_user_turns."""
    from pyrl.interactions.guess_number import GuessNumberInteraction
    from pyrl.tools.tool_registry import load_all_tools

    runner, tokenizer = _in_process_loop(tool_model, load_all_tools(CALCULATOR, None),
                                         {"guess_number": GuessNumberInteraction({"name": "guess_number"})},
                                         max_user_turns=3)
    outputs = _run(runner, tokenizer, 4, interaction_kwargs={"name": "guess_number", "target": -1})  # never guessed
    for o in outputs:
        appended = [tokenizer.decode(o.response_ids[a:b], skip_special_tokens=False)
                    for a, b in _runs(o.response_mask, 0)]
        # each appended turn is the tools' responses or the user's, as the template renders them
        users = [re.fullmatch(r"\n?<\|im_start\|>user\n(.*)<\|im_end\|>\n<\|im_start\|>assistant\n", text, re.S)
                 for text in appended if "<tool_response>" not in text]
        assert all(users) and all(m.group(1) in ("lower", "Please give your guess as <answer>N</answer>.")
                                  for m in users)
        scores = o.extra_fields["turn_scores"]
        assert scores and set(scores) == {0.0}
        assert len(users) <= len(scores)  # every user turn is an interaction's reply
        user_turns, assistant_turns = len(appended), len(_runs(o.response_mask, 1))
        assert user_turns <= 3 and o.num_turns == user_turns + assistant_turns + 1
        assert sum(o.response_mask) < len(o.response_mask)  # the user turns are in the response, untrained
