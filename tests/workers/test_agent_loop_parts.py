"""The agent loop's parts that need no trained model: tool calls that fail in every way a tool can (answered,
counted, never raised), the deadline runner, verl 0.9.1's truncation, and turn-by-turn tokens against the
whole conversation's."""

from __future__ import annotations

import asyncio
import time

from omegaconf import OmegaConf

from pyrl.config import ActorRolloutRefConfig, RolloutConfig
from pyrl.experimental.agent_loop.agent_loop import AgentRuntime, DictConfigWrap, ToolListWrap
from pyrl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop, Trajectory
from pyrl.tools.function_tool import FunctionTool, _build_schema_from_fn
from pyrl.workers.rollout.agent_loop import ChatTokens, ToolRunner, truncate_text
from pyrl.workers.rollout.tool_parser import FunctionCall


def test_truncate_text_matches_verl_091():
    # transcribed from verl 0.9.1 ToolAgentLoop._call_tool
    def verl(text, limit, side):
        if text and len(text) > limit:
            if side == "left":
                return "(truncated)..." + text[-limit:]
            if side == "right":
                return text[:limit] + "...(truncated)"
            length = limit // 2
            return text[:length] + "...(truncated)..." + text[-length:]
        return text

    for text in ("", "abc", "x" * 256, "0123456789" * 100, "é" * 301):
        for limit in (1, 7, 256):
            for side in ("left", "right", "middle"):
                assert truncate_text(text, limit, side) == verl(text, limit, side)


def test_tool_runner_survives_raising_hanging_and_blocking_tools():
    runner = ToolRunner()

    async def ok():
        return 42

    async def raises():
        raise RuntimeError("boom")

    async def hangs():
        await asyncio.sleep(3600)

    async def blocks():  # a synchronous sleep: the event loop itself is stuck, cancellation cannot reach it
        time.sleep(3)
        return "late"

    async def check():
        start = time.monotonic()
        results = await runner.run([ok(), raises(), hangs()], timeout_s=0.5)
        assert (results[0] == 42 and isinstance(results[1], RuntimeError)
                and isinstance(results[2], asyncio.TimeoutError))
        assert time.monotonic() - start < 2.5
        stuck_loop = runner.loop
        start = time.monotonic()
        results = await runner.run([blocks(), ok()], timeout_s=0.3)
        assert all(isinstance(r, asyncio.TimeoutError) for r in results)
        assert time.monotonic() - start < 2.5
        assert runner.loop is not stuck_loop  # abandoned for a fresh loop; the next round runs at once
        assert await runner.run([ok()], timeout_s=1.0) == [42]
        assert await runner.call(ok(), timeout_s=1.0) == 42
        try:
            await runner.call(raises(), timeout_s=1.0)
        except RuntimeError as error:
            assert str(error) == "boom"
        else:
            raise AssertionError("call re-raises what the tool raised")

    asyncio.run(check())


def _function_tool(fn) -> FunctionTool:
    return FunctionTool(name="calculator", fn=fn, tool_schema=_build_schema_from_fn(fn, "calculator"),
                        is_async=asyncio.iscoroutinefunction(fn))


def _loop(tokenizer, tools, response_length=512, **multi_turn) -> ToolAgentLoop:
    """A ToolAgentLoop as the runner builds one (no server: the tests drive its parts); needs a running event loop."""
    config = ActorRolloutRefConfig()
    config.rollout = RolloutConfig(response_length=response_length, prompt_length=32)
    for key, value in {"tool_timeout_s": 0.5, **multi_turn}.items():
        setattr(config.rollout.multi_turn, key, value)
    trainer_config = OmegaConf.create({"actor_rollout_ref": OmegaConf.structured(config)})
    return ToolAgentLoop(trainer_config=DictConfigWrap(trainer_config), server_manager=None, tokenizer=tokenizer,
                         tools=ToolListWrap(tools), runtime=AgentRuntime(ChatTokens(tokenizer), ToolRunner()))


def _trajectory(loop: ToolAgentLoop, **fields) -> Trajectory:
    return Trajectory(prompt_ids=[1], messages=[], tools_kwargs={}, interaction_kwargs={}, tools=dict(loop.tools),
                      **fields)


async def _answer(loop: ToolAgentLoop, name: str, arguments: str):
    t = _trajectory(loop)
    return (await loop.runtime.tool_runner.run([loop._call_tool(t, FunctionCall(name=name, arguments=arguments))],
                                               loop.multi_turn.tool_timeout_s))[0]


def test_bad_tool_calls_are_answered_not_raised(tool_tokenizer):
    def calculator(expression: str) -> str:
        """Evaluates an expression.

        Args:
            expression: the arithmetic expression
        """
        if expression == "raise":
            raise ZeroDivisionError("the tool crashed")
        if expression == "big":
            return "7" * 5_000_000
        if expression == "hang":
            time.sleep(2)
        return str(eval(expression, {}, {}))  # the test's own expressions only

    async def check():
        loop = _loop(tool_tokenizer, [_function_tool(calculator)], max_tool_response_length=32)
        assert await _answer(loop, "calculator", '{"expression": "6*7"}') == ("42", 0.0, False)
        text, _, failed = await _answer(loop, "python", '{"code": "1"}')
        assert failed and text == "Unknown function 'python'. Available tools: ['calculator']"
        text, _, failed = await _answer(loop, "calculator", '{"expression": "6*7"')
        assert failed and text.startswith("Invalid JSON in arguments for 'calculator'")
        t = _trajectory(loop)
        malformed = FunctionCall(name="", arguments='{"name": "calc', error="malformed tool call: not JSON (x)")
        assert (await loop.runtime.tool_runner.run([loop._call_tool(t, malformed)], 1.0))[0] == (
            "Error: malformed tool call: not JSON (x)", 0.0, True)
        text, _, failed = await _answer(loop, "calculator", '["6*7"]')
        assert failed and "expected a JSON object" in text
        result = await _answer(loop, "calculator", '{"expression": "raise"}')
        assert isinstance(result, ZeroDivisionError)  # the turn turns it into the trajectory's error message
        result = await _answer(loop, "calculator", '{"expression": "hang"}')
        assert isinstance(result, asyncio.TimeoutError)
        text, _, failed = await _answer(loop, "calculator", '{"expression": "big"}')
        assert not failed and len(text) == 5_000_000  # cut to max_tool_response_length when appended

    asyncio.run(check())


def test_a_turn_of_failing_calls_appends_error_messages_and_counts_them(tool_tokenizer):
    async def calculator(expression: str) -> str:
        """Evaluates an expression.

        Args:
            expression: the arithmetic expression
        """
        if expression == "hang":
            await asyncio.sleep(3600)
        if expression == "raise":
            raise ValueError("no")
        return "9" * 1000

    async def run_turn():
        loop = _loop(tool_tokenizer, [_function_tool(calculator)], max_tool_response_length=16,
                     max_parallel_calls=4)
        t = _trajectory(loop)
        t.pending_calls = [FunctionCall(name="calculator", arguments='{"expression": "%s"}' % e)
                           for e in ("hang", "raise", "ok")] + [FunctionCall(name="nope", arguments="{}")]
        await loop._run_tools(t)
        return t

    t = asyncio.run(run_turn())
    assert t.pending_calls == []  # the turn's calls are run once
    assert (t.tool_calls, t.tool_errors) == (4, 3)
    contents = [m["content"] for m in t.messages]
    assert contents[0] == "Error: tool 'calculator' timed out after 0.5 s"
    assert contents[1] == "Error executing tool 'calculator': no"
    assert contents[2] == "9" * 8 + "...(truncated)..." + "9" * 8
    assert contents[3].startswith("Unknown function 'nope'")
    assert set(t.response_mask) == {0} and len(t.response_ids) > 0  # attended, never trained
    assert t.user_turns == 1 and not t.done
    assert tool_tokenizer.decode(t.response_ids).count("<tool_response>") == 4


def test_tool_responses_past_the_budget_end_the_trajectory_unappended(tool_tokenizer):
    async def calculator(expression: str) -> str:
        """Evaluates an expression.

        Args:
            expression: the arithmetic expression
        """
        return "1" * 100

    async def run_turn():
        loop = _loop(tool_tokenizer, [_function_tool(calculator)], response_length=40,
                     max_tool_response_length=1000)
        t = _trajectory(loop)
        t.append([5, 6, tool_tokenizer.eos_token_id], trained=True)
        t.pending_calls = [FunctionCall(name="calculator", arguments='{"expression": "1"}')]
        await loop._run_tools(t)
        return t

    t = asyncio.run(run_turn())
    assert t.done and t.response_ids == [5, 6, tool_tokenizer.eos_token_id] and t.user_turns == 0  # as verl 0.9.1


def test_turn_by_turn_tokens_equal_the_whole_conversation(tool_tokenizer):
    """verl's sanity check: the prompt, the model's turns as generated, and the appended tool responses give the
    tokens of tokenizing the whole conversation at once."""
    chat = ChatTokens(tool_tokenizer)
    tools = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}, "required": ["expression"]}}}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347*812"}}}
    conversation = [{"role": "user", "content": "347*812="},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "content": "281764"},
                    {"role": "assistant", "content": "<answer>281764</answer>"}]
    tokens = chat.render(conversation[:1], True, tools)
    eos = [tool_tokenizer.eos_token_id]
    for i, message in enumerate(conversation[1:], start=1):
        if message["role"] == "assistant":  # what the model generates: the turn's text and its end-of-turn token
            whole = chat.render(conversation[:i + 1], False, tools)
            turn = whole[len(tokens):len(whole) - len(chat.turn_separator)]
            assert turn[-1:] == eos
            tokens += turn
        else:
            tokens += chat.turn_separator + chat.tool_responses([message], tools)
    assert tokens + chat.turn_separator == chat.render(conversation, False, tools)


def test_tool_selection_limits_a_sample_to_the_tools_it_names(tool_tokenizer):
    """verl 0.9.1's extra_info.tool_selection: the prompt lists only those tools and only they can be called."""
    from pyrl.workers.rollout.agent_loop import prompt_tools, selected_tools

    async def calculator(expression: str) -> str:
        """Evaluates an expression.

        Args:
            expression: the arithmetic expression
        """
        return "1"

    async def check():
        loop = _loop(tool_tokenizer, [_function_tool(calculator)])
        assert selected_tools(loop.tools, {"tool_selection": ["search"]}) == {}
        assert (selected_tools(loop.tools, {"tool_selection": ["calculator"]}) == loop.tools
                == selected_tools(loop.tools, {}))
        t = _trajectory(loop)
        t.tools = selected_tools(loop.tools, {"tool_selection": ["search"]})
        text, _, failed = (await loop.runtime.tool_runner.run(
            [loop._call_tool(t, FunctionCall(name="calculator", arguments="{}"))], 1.0))[0]
        assert failed and text == "Unknown function 'calculator'. Available tools: []"
        # the loop's own start takes the row's selection: its trajectory may call only those
        t = await loop._start({"raw_prompt_ids": [1], "extra_info": {"tool_selection": ["search"]}})
        assert t.tools == {}
        t = await loop._start({"raw_prompt_ids": [1], "extra_info": {"tool_selection": ["calculator"]}})
        assert t.tools == loop.tools
        return loop.tool_schemas

    schemas = asyncio.run(check())
    assert prompt_tools(schemas, "tool_agent", {}) == schemas
    assert prompt_tools(schemas, "tool_agent", {"extra_info": {"tool_selection": ["search"]}}) == []
    assert prompt_tools(schemas, "single_turn_agent", {}) is None  # verl's single-turn loop renders no tools
    assert prompt_tools(schemas, "single_turn_agent", {"agent_name": "tool_agent"}) == schemas


def test_trajectory_columns_and_their_metrics_by_hand():
    """Each loop's counters and timers reach the batch's columns (a user's loop that reports none gets zeros), and
    the trainer's metrics are their min / max / mean, the slowest trajectory's being the one with the most seconds
    of generation and tools together (verl 0.9.1's agent_loop/slowest)."""
    import numpy as np

    from pyrl.experimental.agent_loop.agent_loop import AgentLoopOutput
    from pyrl.trainer.metrics import agent_loop_metrics
    from pyrl.workers.rollout.agent_loop import trajectory_columns

    def output(turns, generate_s, tool_s, **extra):
        return AgentLoopOutput(prompt_ids=[1], response_ids=[2], response_mask=[1], num_turns=turns,
                               metrics={"generate_sequences": generate_s, "tool_calls": tool_s}, extra_fields=extra)

    outputs = [output(4, 0.5, 2.0, tool_call_counts=1, tool_error_counts=1, turn_scores=[0.5], tool_rewards=[1.0]),
               output(2, 3.0, 0.0),  # a user's loop: no counters
               output(6, 1.0, 1.75, tool_call_counts=2)]
    columns = trajectory_columns(outputs)
    assert columns["__num_turns__"].tolist() == [4, 2, 6]
    assert columns["tool_call_counts"].tolist() == [1, 0, 2] and columns["tool_error_counts"].tolist() == [1, 0, 0]
    assert columns["tool_seconds"].tolist() == [2.0, 0.0, 1.75]
    assert columns["generate_seconds"].tolist() == [0.5, 3.0, 1.0]
    assert list(columns["turn_scores"]) == [[0.5], [], []] and list(columns["tool_rewards"]) == [[1.0], [], []]
    assert list(columns["tool_extra_fields"]) == [o.extra_fields for o in outputs]  # verl's: each loop's, whole
    metrics = agent_loop_metrics(columns)
    assert metrics["num_turns/mean"] == 4.0 and metrics["tool_call_counts/max"] == 2
    assert metrics["training/num_turns/mean"] == 4.0  # verl 0.9.1's default trainer's name too
    assert metrics["timing_s/agent_loop/generate_sequences/max"] == 3.0
    assert metrics["timing_s/agent_loop/tool_calls/mean"] == np.mean([2.0, 0.0, 1.75])
    # totals 2.5, 3.0, 2.75: the second is the slowest
    assert metrics["timing_s/agent_loop/slowest/generate_sequences"] == 3.0
    assert metrics["timing_s/agent_loop/slowest/tool_calls"] == 0.0
    assert metrics["tool_calls/sample_ratio"] == 2 / 3 and metrics["tool_calls/error_ratio"] == 1 / 3


def test_loop_scores_reach_the_reward_step_for_the_whole_batch(tool_tokenizer):
    """AgentLoopOutput.reward_score travels as a column (every rank's rollout has it, None where the loop did not
    score) and becomes rm_scores in the reward step, for the batch as a whole: all rows scored -> on each
    response's last token (an empty response's: the last column, as verl's rm_scores[-1]), the reward function
    never called; none -> the reward function; some -> the reward function scores the others (verl 0.9.1's
    _compute_score); with a reward model's rm_scores too -> refused."""
    import numpy as np
    import pytest
    import torch

    from pyrl.protocol import DataProto
    from pyrl.rewards.managers import RewardManager

    def objects(values):
        column = np.empty(len(values), dtype=object)
        column[:] = values
        return column

    def batch(scores, lengths=(3, 0, 2), width=4, infos=({}, {}, {})):
        responses = torch.full((len(lengths), width), 9)
        mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
        return DataProto.from_dict(
            tensors={"prompts": torch.ones(len(lengths), 2, dtype=torch.long), "responses": responses,
                     "attention_mask": torch.cat([torch.ones(len(lengths), 2, dtype=torch.long), mask], -1),
                     "response_mask": mask},
            non_tensors={"agent_loop_reward_score": objects(scores), "data_source": np.array(["x"] * len(lengths)),
                         "tool_extra_fields": objects([{"reward_extra_info": info} if info else {} for info in infos]),
                         "reward_model": np.array([{"ground_truth": "1"}] * len(lengths), dtype=object)})

    calls = []

    def compute_score(**kwargs):
        calls.append(kwargs)
        return 0.25

    manager = RewardManager(tool_tokenizer, compute_score)
    scores, extra, _ = manager(batch([1.0, 2.0, 3.0]))
    want = torch.zeros(3, 4)
    want[0, 2], want[1, 3], want[2, 1] = 1.0, 2.0, 3.0
    assert torch.equal(scores, want) and extra == {} and calls == []
    # a loop's extra_fields["reward_extra_info"] is the batch's reward_extra_info (verl's _postprocess)
    infos = ({"acc": 1.0, "found": "a"}, {"acc": 0.0, "found": None}, {"found": "c", "acc": 1.0})
    _, extra, _ = manager(batch([1.0, 2.0, 3.0], infos=infos))
    assert extra == {"acc": [1.0, 0.0, 1.0], "found": ["a", None, "c"]}
    with pytest.raises(ValueError, match=r"row 1's extra_fields\['reward_extra_info'\] lacks \['found'\]"):
        manager(batch([1.0, 2.0, 3.0], infos=(infos[0], {"acc": 0.0}, infos[2])))
    scores, _, _ = manager(batch([None, None, None]))
    assert len(calls) == 3 and scores[0, 2] == 0.25
    calls.clear()
    scores, extra, _ = manager(batch([1.0, None, 0.5], lengths=(3, 2, 2), infos=({"found": "a"}, {}, {"found": "c"})))
    want = torch.zeros(3, 4)
    want[0, 2], want[1, 1], want[2, 1] = 1.0, 0.25, 0.5  # row 1 by the reward function, the others by their loops
    assert torch.equal(scores, want) and len(calls) == 1
    assert extra == {"found": ["a", None, "c"], "acc": [None, 0.25, None]}  # each row's from where it was scored
    both = batch([1.0, 2.0, 3.0])
    both.batch["rm_scores"] = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="a reward model scored them too"):
        manager(both)


def test_tool_responses_are_labelled_with_their_calls_names(tool_tokenizer):
    """A template that labels a tool response with its call's name, as gpt-oss's does (`functions.` + the
    assistant turn's last tool call's name), sees the real call's name, as verl 0.9.1's gpt-oss builder writes it."""
    template = ("{% set ns = namespace(name='') %}{% for m in messages %}"
                "{% if m.role == 'assistant' and m.tool_calls %}"
                "{% set ns.name = m.tool_calls[-1].function.name %}<call>"
                "{% elif m.role == 'tool' %}<from functions.{{ ns.name }}>{{ m.content }}<end>"
                "{% else %}<{{ m.role }}>{{ m.content }}<end>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    chat = ChatTokens(tool_tokenizer, chat_template=template)
    tokens = chat.tool_responses([{"role": "tool", "content": "42"}], None, ["calculator"])
    assert "functions.calculator" in tool_tokenizer.decode(tokens)


def test_tools_see_verls_agent_data(tool_tokenizer):
    """A BaseTool's execute() gets agent_data with verl 0.9.1's AgentData attributes and meanings: prompt_ids the
    whole context so far, response_ids the last assistant turn, tool_calls that turn's calls; extra_fields it
    writes reach the trajectory."""
    from pyrl.tools.base_tool import BaseTool
    from pyrl.tools.schemas import ToolResponse

    seen = {}

    class Recorder(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            data = kwargs["agent_data"]
            seen.update(prompt_ids=list(data.prompt_ids), response_ids=list(data.response_ids),
                        calls=[call.name for call in data.tool_calls], images=data.image_data,
                        turns=(data.assistant_turns, data.user_turns))
            data.extra_fields["session"] = "kept"
            return ToolResponse(text="ok"), 0.5, {}

    schema = {"type": "function", "function": {"name": "recorder", "description": "records",
                                               "parameters": {"type": "object", "properties": {}}}}

    async def check():
        loop = _loop(tool_tokenizer, [Recorder({}, schema)])
        t = _trajectory(loop)
        t.append([7, 8], trained=True)  # an earlier turn, then its tool's answer
        t.append([9], trained=False)
        t.append([10, 11, 12], trained=True)
        t.last_turn_ids, t.assistant_turns = [10, 11, 12], 2
        t.pending_calls = [FunctionCall(name="recorder", arguments="{}")]
        await loop._run_tools(t)
        assert seen == {"prompt_ids": [1, 7, 8, 9, 10, 11, 12], "response_ids": [10, 11, 12], "calls": ["recorder"],
                        "images": None, "turns": (2, 0)}
        assert t.extra_fields["session"] == "kept" and t.tool_rewards == [0.5]

    asyncio.run(check())


def test_a_tool_answering_with_an_image_stops_the_run(tool_tokenizer):
    """A text-only loop cannot show a tool's image to the model: verl 0.9.1 raises, and so does pyrl, instead of
    dropping it and answering with the text alone."""
    import pytest

    from pyrl.experimental.agent_loop.tool_agent_loop import MediaToolResponse
    from pyrl.tools.schemas import ToolResponse

    def camera(angle: str):
        """Takes a picture.

        Args:
            angle: where to look
        """
        return ToolResponse(text="a picture", image=["<image bytes>"])

    async def check():
        loop = _loop(tool_tokenizer, [FunctionTool(name="calculator", fn=camera,
                                                   tool_schema=_build_schema_from_fn(camera, "calculator"),
                                                   is_async=False)])
        t = _trajectory(loop)
        t.pending_calls = [FunctionCall(name="calculator", arguments='{"angle": "up"}')]
        with pytest.raises(MediaToolResponse, match="returned images or videos"):
            await loop._run_tools(t)

    asyncio.run(check())
