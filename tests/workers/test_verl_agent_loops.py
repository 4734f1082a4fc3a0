"""verl 0.9.1's own agent-loop files run on pyrl with `verl` replaced by `pyrl` in their imports
(tests/workers/verl_agent_loops: single_turn_agent_loop.py and tool_agent_loop.py, registered as verl users
register theirs, through a rollout.agent.agent_loop_config_path YAML), and a loop of the tests' own
(verl_agent_loops/retrieval_agent_loop.py, registered with @register).

With the tiny tool-calling model on the hf engine, greedy: verl's tool_agent and single_turn_agent give the
tokens, masks, turn counts and log-probs of pyrl's own loops of those names, the tool agent calling the calculator
on some rows. The retrieval agent's trajectories are checked against the model itself (every generated token the
greedy choice after exactly the tokens before it, at its log-prob), against the chat template (its prompt, and
each appended passage as the template renders a user turn, mask 0), and through the columns and rm_scores the
trainer builds from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from worker_helpers import make_config

PROMPT, RESPONSE = 32, 64
CALCULATOR = str(Path(__file__).resolve().parents[2] / "configs" / "tools" / "calculator.yaml")
LOOPS_YAML = """\
- name: verl_single_turn_agent
  _target_: verl_agent_loops.single_turn_agent_loop.SingleTurnAgentLoop
- name: verl_tool_agent
  _target_: verl_agent_loops.tool_agent_loop.ToolAgentLoop
"""
SAMPLING_PARAMS = dict(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)  # the actor's


@pytest.fixture(scope="module")
def model():
    """The tiny tool model (warm-started to call the calculator), its tokenizer, and one hf engine on CPU."""
    from transformers import AutoTokenizer

    from pyrl.models.hub import resolve_model_path
    from pyrl.workers.rollout.hf_engine import HFEngine

    path = resolve_model_path("pyrl:tiny-tool-sft")
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = rollout_config(path)
    return path, tokenizer, HFEngine(path, config.actor_rollout_ref.rollout, torch.device("cpu"), tokenizer)


@pytest.fixture(scope="module")
def loops_yaml(tmp_path_factory):
    path = tmp_path_factory.mktemp("agent_loops") / "agent_loops.yaml"
    path.write_text(LOOPS_YAML)
    return str(path)


def rollout_config(model_path: str, *overrides: str):
    return make_config(f"actor_rollout_ref.model.path={model_path}", f"data.max_prompt_length={PROMPT}",
                       f"data.max_response_length={RESPONSE}", "actor_rollout_ref.rollout.multi_turn.enable=true",
                       f"actor_rollout_ref.rollout.multi_turn.tool_config_path={CALCULATOR}",
                       "actor_rollout_ref.rollout.calculate_log_probs=true",
                       "actor_rollout_ref.rollout.load_format=auto", *overrides)


def make_runner(model, *overrides: str):
    """An AgentLoopRunner as the rollout worker builds it (pyrl/workers/actor.py), over the shared engine."""
    from pyrl.experimental.agent_loop.agent_loop import AgentLoopRunner
    from pyrl.tools.tool_registry import load_all_tools

    path, tokenizer, engine = model
    config = rollout_config(path, *overrides).actor_rollout_ref
    multi_turn = config.rollout.multi_turn
    tools = load_all_tools(multi_turn.tool_config_path, multi_turn.function_tool_path)
    return AgentLoopRunner(engine, tokenizer, config, tools, {}, {})


def spec(response_length: int = RESPONSE):
    from pyrl.workers.rollout.base import SamplingSpec

    return SamplingSpec(n=1, do_sample=False, max_tokens=response_length, logprobs=True)


def task_pairs(rows: int, tool_users: int) -> list[tuple[int, int]]:
    """The tool task's validation pairs: `tool_users` whose first operand makes the warm-started model call the
    calculator (TOOL_USE_FROM up), alternating with others (tests/workers/test_agent_loop.py's)."""
    from pyrl.data.tool_calc import TOOL_USE_FROM, tool_calc_pairs

    _, val, _ = tool_calc_pairs()
    users = [p for p in val if p[0] >= TOOL_USE_FROM][:tool_users]
    others = [p for p in val if p[0] < TOOL_USE_FROM][:rows - tool_users]
    return [p for pair in zip(users, others) for p in pair]


def messages(a: int, b: int) -> list[dict]:
    from pyrl.data.tool_calc import tool_calc_prompt

    return [{"role": "user", "content": tool_calc_prompt(a, b)}]


@pytest.fixture(scope="module")
def compared(model, loops_yaml):
    """The same 8 greedy prompts (4 tool users) through pyrl's tool_agent and single_turn_agent and verl's
    transcribed ones; rows carry raw_prompt (not raw_prompt_ids), so every loop renders its own prompt."""
    runner = make_runner(model, f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops_yaml}")
    pairs = task_pairs(8, tool_users=4)
    out = {}
    for name in ("tool_agent", "verl_tool_agent", "single_turn_agent", "verl_single_turn_agent"):
        rows = [{"agent_name": name, "raw_prompt": messages(a, b), "index": i, "extra_info": {"index": i}}
                for i, (a, b) in enumerate(pairs)]
        out[name] = runner.run(rows, dict(SAMPLING_PARAMS), spec()).outputs
    return pairs, out


def test_verl_loops_are_registered_from_the_yaml_beside_pyrls(compared):
    from pyrl.experimental.agent_loop.agent_loop import _agent_loop_registry

    assert _agent_loop_registry["verl_tool_agent"]["_target_"] == "verl_agent_loops.tool_agent_loop.ToolAgentLoop"
    assert (_agent_loop_registry["verl_single_turn_agent"]["_target_"]
            == "verl_agent_loops.single_turn_agent_loop.SingleTurnAgentLoop")
    # importing the transcriptions (hydra did, to build them) left pyrl's own loops registered under their names
    assert (_agent_loop_registry["tool_agent"]["_target_"]
            == "pyrl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop")
    assert (_agent_loop_registry["single_turn_agent"]["_target_"]
            == "pyrl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop")
    # and each name ran its own class: pyrl's tool agent reports its tool counters, verl's does not
    _, out = compared
    assert all("tool_call_counts" in o.extra_fields for o in out["tool_agent"])
    assert all("tool_call_counts" not in o.extra_fields for o in out["verl_tool_agent"])


@pytest.mark.parametrize("pyrl_name", ["tool_agent", "single_turn_agent"])
def test_verl_loop_gives_pyrls_trajectories(model, compared, pyrl_name):
    from pyrl.tools.tool_registry import load_all_tools

    _, tokenizer, _ = model
    pairs, out = compared
    ours, theirs = out[pyrl_name], out[f"verl_{pyrl_name}"]
    tools = load_all_tools(CALCULATOR, None) if pyrl_name == "tool_agent" else []
    schemas = [t.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for t in tools] or None
    for (a, b), mine, verl in zip(pairs, ours, theirs):
        # the prompt as the chat template renders the row (with the tools for the tool agent, as verl's does)
        text = tokenizer.apply_chat_template(messages(a, b), tools=schemas, add_generation_prompt=True, tokenize=False)
        assert verl.prompt_ids == mine.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert verl.response_ids == mine.response_ids
        assert verl.response_mask == mine.response_mask
        assert len(verl.response_ids) == len(verl.response_mask) == len(verl.response_logprobs) <= RESPONSE
        assert verl.num_turns == mine.num_turns
        torch.testing.assert_close(torch.tensor(verl.response_logprobs), torch.tensor(mine.response_logprobs),
                                   atol=2e-5, rtol=0)
        assert verl.extra_fields["turn_scores"] == mine.extra_fields["turn_scores"] == []
        assert verl.extra_fields["tool_rewards"] == mine.extra_fields["tool_rewards"]
        assert verl.reward_score is None
    if pyrl_name == "single_turn_agent":
        assert all(o.num_turns == 2 and set(o.response_mask) == {1} for o in theirs)
        return
    # the comparison means something only if verl's loop called the tool, got its answer and went on
    called = [o for o in theirs if o.num_turns >= 4]
    assert len(called) >= 2
    for o in called:
        text = tokenizer.decode(o.response_ids)
        assert "<tool_call>" in text and "<tool_response>" in text
        first_hole, last_trained = o.response_mask.index(0), len(o.response_mask) - 1 - o.response_mask[::-1].index(1)
        assert first_hole < last_trained  # model tokens after the tool's (mask 0)
        assert all(lp == 0.0 for lp, m in zip(o.response_logprobs, o.response_mask) if m == 0)
    assert any(o.num_turns == 2 for o in theirs)  # and rows that answered at once


# ---- a loop of our own ----
RETRIEVAL_RESPONSE, RETRIEVAL_TURN_TOKENS = 256, 40  # the response's length, each answer's cap (extra_info)


@pytest.fixture(scope="module")
def retrieval(model, tmp_path_factory):
    """Six greedy rows through the retrieval agent: a corpus with the gold fact of rows 0, 2, 4 and distractors;
    rows asking for 2 or 1 retrieval rounds. Answers of at most RETRIEVAL_TURN_TOKENS in a response of
    RETRIEVAL_RESPONSE: room for two rounds whatever the model says (a warm-started model built on another machine
    may not end an answer by itself)."""
    import verl_agent_loops.retrieval_agent_loop  # noqa: F401 (registers retrieval_agent)

    from pyrl.data.tool_calc import tool_calc_pairs

    pairs = tool_calc_pairs()[1][:6]
    corpus = [f"{a} times {b} is {a * b}." for a, b in pairs[::2]]
    corpus += ["The sky is blue.", "Seven is a prime number.", "Water boils at 100 degrees."]
    corpus_path = tmp_path_factory.mktemp("corpus") / "corpus.json"
    corpus_path.write_text(json.dumps(corpus))
    rows = [{"agent_name": "retrieval_agent", "raw_prompt": messages(a, b),
             "extra_info": {"corpus_path": str(corpus_path), "rounds": 2 if i < 4 else 1,
                            "max_turn_tokens": RETRIEVAL_TURN_TOKENS, "gold": i // 2 if i % 2 == 0 else -1}}
            for i, (a, b) in enumerate(pairs)]
    runner = make_runner(model, f"data.max_response_length={RETRIEVAL_RESPONSE}")
    return corpus, rows, runner.run(rows, dict(SAMPLING_PARAMS), spec(RETRIEVAL_RESPONSE)).outputs


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, mask value) of each run of equal mask values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((start, i, mask[start]))
            start = i
    return runs


def test_a_users_loop_sees_the_servers_tokens_with_its_context_masked(model, retrieval):
    from pyrl.workers.rollout.agent_loop import ChatTokens

    _, tokenizer, engine = model
    corpus, rows, outputs = retrieval
    chat = ChatTokens(tokenizer)
    whole_turns = 0  # context runs after an answer the model ended itself, checked token for token
    for row, o in zip(rows, outputs):
        text = tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False)
        assert o.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(o.response_ids) == len(o.response_mask) == len(o.response_logprobs) <= RETRIEVAL_RESPONSE
        retrieved, calls = o.extra_fields["retrieved"], o.extra_fields["calls"]
        assert len(retrieved) == row["extra_info"]["rounds"]  # every round fit in the response
        runs = segments(o.response_mask)
        generated, context = [r for r in runs if r[2] == 1], [r for r in runs if r[2] == 0]
        assert [r[2] for r in runs] == [1, 0] * len(retrieved) + [1]
        assert o.num_turns == 1 + len(generated) + len(context) == 2 + 2 * len(retrieved)
        full = o.prompt_ids + o.response_ids
        p = len(o.prompt_ids)
        # each generate call: sent exactly the tokens so far, and what the server returned is the generated run
        assert len(calls) == len(generated)
        for call, (start, end, _) in zip(calls, generated):
            assert call["prompt_ids"] == full[:p + start] and call["token_ids"] == o.response_ids[start:end]
        # each context run: the passage as the template renders a user turn after the turn's end-of-turn token
        # (after an answer the loop cut at max_turn_tokens, with no end-of-turn token, only that the passage is there)
        for (start, end, _), (turn_start, _, _), passage in zip(context, generated, retrieved):
            if start - turn_start < RETRIEVAL_TURN_TOKENS:
                whole_turns += 1
                assert o.response_ids[start - 1] == tokenizer.eos_token_id
                want = chat.turn_separator + chat.user_message({"role": "user", "content": corpus[passage]}, None)
                assert o.response_ids[start:end] == want
            assert corpus[passage] in tokenizer.decode(o.response_ids[start:end])
        assert all(lp == 0.0 for lp, m in zip(o.response_logprobs, o.response_mask) if m == 0)
        # against the model itself, on the whole sequence at once: every generated token is the greedy choice
        # after exactly the tokens before it, at the log-prob the loop got
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([full])).logits[0, p - 1:-1].double()
        logp = logits.log_softmax(-1)
        trained = torch.tensor(o.response_mask).bool()
        ids = torch.tensor(o.response_ids)
        chosen = logp.gather(-1, ids[:, None])[:, 0]
        assert (chosen[trained] >= logp.max(-1).values[trained] - 1e-5).all()
        torch.testing.assert_close(torch.tensor(o.response_logprobs, dtype=torch.float64)[trained], chosen[trained],
                                   atol=1e-4, rtol=0)
    assert whole_turns >= 3
    # the rows asking for the gold passage's words got it first; the others the corpus' first passage, then the next
    assert [o.extra_fields["retrieved"] for o in outputs] == [[0, 1], [0, 1], [1, 0], [0, 1], [2], [0]]


def test_a_users_loop_reaches_the_trainers_columns_and_rm_scores(model, retrieval):
    from pyrl.workers.rollout.agent_loop import agent_loop_reward_extra_info, agent_loop_rm_scores, trajectory_columns

    _, tokenizer, _ = model
    corpus, rows, outputs = retrieval
    columns = trajectory_columns(outputs)
    assert columns["__num_turns__"].tolist() == [o.num_turns for o in outputs]
    assert columns["tool_call_counts"].tolist() == [len(o.extra_fields["retrieved"]) for o in outputs]
    assert columns["turn_scores"].tolist() == [o.extra_fields["turn_scores"] for o in outputs]
    assert columns["tool_error_counts"].tolist() == [0] * 6 and columns["tool_rewards"].tolist() == [[]] * 6
    # reward_score: 1 where the gold passage was appended (read back from the tokens), on the last response token
    want = [float(row["extra_info"]["gold"] >= 0 and corpus[row["extra_info"]["gold"]] in tokenizer.decode(
        [t for t, m in zip(o.response_ids, o.response_mask) if m == 0])) for row, o in zip(rows, outputs)]
    assert want == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert list(columns["agent_loop_reward_score"]) == want
    scores = agent_loop_rm_scores(columns["agent_loop_reward_score"], [len(o.response_ids) for o in outputs],
                                  RETRIEVAL_RESPONSE)
    assert scores.shape == (6, RETRIEVAL_RESPONSE)
    expected = torch.zeros(6, RETRIEVAL_RESPONSE)
    for i, o in enumerate(outputs):
        expected[i, len(o.response_ids) - 1] = want[i]
    assert torch.equal(scores, expected)
    # its reward_extra_info reaches the reward step's (validation's per-source metrics, the rollout dumps)
    assert agent_loop_reward_extra_info(columns["tool_extra_fields"]) == {
        "acc": want, "passages": [len(o.extra_fields["retrieved"]) for o in outputs]}


# ---- errors ----
def test_an_unknown_agent_name_is_refused_naming_it(model):
    runner = make_runner(model)
    with pytest.raises(ValueError, match="no_such_agent.*not registered"):
        runner.run([{"agent_name": "no_such_agent", "raw_prompt": messages(1, 2)}], dict(SAMPLING_PARAMS), spec())


@pytest.mark.parametrize("entry", ["- name: broken\n  module: verl_agent_loops.tool_agent_loop\n",
                                   "- _target_: verl_agent_loops.tool_agent_loop.ToolAgentLoop\n"],
                         ids=["no _target_", "no name"])
def test_a_yaml_entry_without_name_or_target_is_refused_naming_the_key(model, tmp_path, entry):
    path = tmp_path / "agent_loops.yaml"
    path.write_text(LOOPS_YAML + entry)
    with pytest.raises(ValueError, match=r"agent_loop_config_path.*entry 2 needs a name and a _target_"):
        make_runner(model, f"actor_rollout_ref.rollout.agent.agent_loop_config_path={path}")
