"""pyrl's tool agent (verl 0.9.1's tool_agent), one trajectory, as a coroutine:

    generate a turn -> parse its tool calls (rollout.multi_turn.format) -> run them (at most max_parallel_calls,
    each with multi_turn.tool_timeout_s) -> append the tool responses as the chat template renders the tool role,
    truncated to max_tool_response_length characters -> next turn; with an interaction, a turn without tool calls
    is answered by the interaction (a simulated user) instead -> until no tool is called, the interaction ends the
    episode, or a turn or length limit is hit.

Each turn gets what is left of the response length as its budget, and the parser's stop tokens (glm, kimi,
gemma4). response_mask is 1 on the model's tokens only; tool, user and template tokens are attended to but not
trained on (rollout log-prob 0 there).

A tool that raises, hangs, returns megabytes, gets malformed JSON or an unknown name never stops the run: the
trajectory gets an error message as the tool's response, and the error is counted. (verl 0.9.1 drops a malformed
call block silently, ending the episode as if nothing were called; pyrl answers it.) Interactions are pyrl's
(verl 0.9.1's agent loops have none).
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

from pyrl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, AgentRuntime, register
from pyrl.sandbox import SandboxUnavailable
from pyrl.tools.function_tool import FunctionTool, normalize_function_tool_return
from pyrl.utils.profiler import simple_timer
from pyrl.workers.rollout.agent_loop import TRUNCATE_SIDES, interaction_name, openai_call, selected_tools, truncate_text
from pyrl.workers.rollout.tool_parser import ToolParser


class MediaToolResponse(ValueError):
    """A tool answered with images or videos, which a text-only loop cannot show: the run stops (verl's too)."""


@dataclass
class Trajectory:
    """One sample's tokens so far and its counters; tools get its AgentData view as agent_data."""

    prompt_ids: list[int]
    messages: list[dict]
    tools_kwargs: dict
    interaction_kwargs: dict
    request_id: str = field(default_factory=lambda: uuid4().hex)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    turn_scores: list[float] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # verl's generate_sequences and tool_calls seconds
    extra_fields: dict = field(default_factory=dict)
    pending_calls: list = field(default_factory=list)  # this turn's parsed calls, not yet run
    last_turn_ids: list[int] = field(default_factory=list)  # the last assistant turn's tokens
    tools: dict = field(default_factory=dict)  # name -> the tools this sample may call
    interaction: Any = None  # (name, instance id) of its interaction, if any
    done: bool = False

    def append(self, tokens: list[int], trained: bool, logprobs: list[float] | None = None) -> None:
        self.response_ids += tokens
        self.response_mask += [int(trained)] * len(tokens)
        self.response_logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)

    @property
    def num_turns(self) -> int:
        """verl's count: the prompt, each assistant turn and each user/tool turn."""
        return self.user_turns + self.assistant_turns + 1


class AgentData:
    """What a tool's execute() gets as agent_data: verl 0.9.1's AgentData attributes with their meanings there.
    prompt_ids is the whole context so far (the prompt and every turn), response_ids the last assistant turn's
    tokens, tool_calls that turn's calls (FunctionCall); no images, videos or audio (pyrl's loops are text-only).
    extra_fields, metrics, messages and the lists are the trajectory's own: a tool's writes to extra_fields reach
    the loop's output, as in verl."""

    def __init__(self, t: Trajectory):
        self.messages, self.metrics, self.request_id = t.messages, t.metrics, t.request_id
        self.tools_kwargs, self.extra_fields = t.tools_kwargs, t.extra_fields
        # a text row's, as verl's loop sets them (multi_modal_data.get("images"), ...)
        self.image_data, self.video_data, self.audio_data, self.mm_processor_kwargs = None, None, None, {}
        self.mm_processor_output, self.routed_experts = None, None
        self.prompt_ids = t.prompt_ids + t.response_ids
        self.response_ids = list(t.last_turn_ids)
        self.response_mask, self.response_logprobs = t.response_mask, t.response_logprobs
        self.turn_scores, self.tool_rewards = t.turn_scores, t.tool_rewards
        self.user_turns, self.assistant_turns = t.user_turns, t.assistant_turns
        self.tool_calls = list(t.pending_calls)


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    def __init__(self, *args, tools=None, runtime: AgentRuntime | None = None, **kwargs):
        super().__init__(*args, runtime=runtime, **kwargs)
        # pyrl's own section where the runner passes it (a DictConfig copy's reads are nobody's)
        self.multi_turn = cfg = runtime.multi_turn if runtime and runtime.multi_turn else self.rollout_config.multi_turn
        if cfg.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side: expected one of "
                             f"{TRUNCATE_SIDES}, got {cfg.tool_response_truncate_side!r}")
        self.response_length = self.rollout_config.response_length
        tool_list = tools.tools if tools else []
        self.tools = {tool.name: tool for tool in tool_list}
        self.tool_schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
                             for tool in tool_list] or None
        self.runtime = runtime
        self.interactions = runtime.interactions if runtime else {}
        self.parser = ToolParser.get_tool_parser(cfg.format, self.tokenizer)
        # the tokens the format's model ends a calling turn with instead of EOS (gemma4's <tool_call|>, glm's
        # <|observation|>, kimi's <|im_end|>): every turn stops there too, as verl 0.9.1's ToolAgentLoop asks
        self.stop_token_ids = sorted(set(self.parser.stop_token_ids))
        self.chat = self.continuous_token_builder.chat

    async def run(self, sampling_params: dict, **kwargs) -> AgentLoopOutput:
        t = await self._start(kwargs)
        try:
            while not t.done:
                await self._generate_turn(t, sampling_params)
                if t.done:
                    break
                if t.pending_calls:
                    await self._run_tools(t)
                else:
                    await self._interact(t)
        finally:
            if t.interaction is not None:
                name, instance = t.interaction
                await self.runtime.tool_runner.call(self.interactions[name].finalize_interaction(instance),
                                                    self.multi_turn.tool_timeout_s)
        return AgentLoopOutput(
            prompt_ids=t.prompt_ids, response_ids=t.response_ids, response_mask=t.response_mask,
            response_logprobs=t.response_logprobs if sampling_params.get("logprobs") else None,
            num_turns=t.num_turns, metrics=t.metrics,
            extra_fields={**t.extra_fields, "turn_scores": t.turn_scores, "tool_rewards": t.tool_rewards,
                          "tool_call_counts": t.tool_calls, "tool_error_counts": t.tool_errors})

    async def _start(self, row: dict) -> Trajectory:
        messages = copy.deepcopy(list(row.get("raw_prompt") or []))
        tools = selected_tools(self.tools, row.get("extra_info"))
        prompt_ids = row.get("raw_prompt_ids")
        if prompt_ids is None:
            schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools.values()]
            prompt_ids = await self.ct_build_initial_tokens(messages, tools=schemas or None)
        t = Trajectory(prompt_ids=[int(token) for token in prompt_ids], messages=messages,
                       tools_kwargs=dict(row.get("tools_kwargs") or {}),
                       interaction_kwargs=dict(row.get("interaction_kwargs") or {}), tools=tools)
        if self.interactions:
            name = interaction_name(t.interaction_kwargs, self.interactions, "agent loop")
            instance = await self.runtime.tool_runner.call(
                self.interactions[name].start_interaction(t.request_id, **t.interaction_kwargs),
                self.multi_turn.tool_timeout_s)
            t.interaction = (name, instance or t.request_id)
        return t

    async def _generate_turn(self, t: Trajectory, sampling_params: dict) -> None:
        """Generates a turn within what is left of the response, and decides what follows: tool calls, the
        interaction, or the end."""
        params = {**sampling_params, "max_tokens": self.response_length - len(t.response_ids)}
        if self.stop_token_ids:
            params["stop_token_ids"] = sorted(set(params.get("stop_token_ids") or []) | set(self.stop_token_ids))
        with simple_timer("generate_sequences", t.metrics):
            output = await self.server_manager.generate(request_id=t.request_id,
                                                        prompt_ids=t.prompt_ids + t.response_ids,
                                                        sampling_params=params)
        tokens = list(output.token_ids)
        t.append(tokens, trained=True, logprobs=output.log_probs)
        t.last_turn_ids = tokens
        t.assistant_turns += 1
        cfg = self.multi_turn
        if (len(t.response_ids) >= self.response_length
                or (cfg.max_assistant_turns and t.assistant_turns >= cfg.max_assistant_turns)
                or (cfg.max_user_turns and t.user_turns >= cfg.max_user_turns)):
            t.done = True
            return
        content, calls = await self.parser.extract_tool_calls(tokens, [tool.tool_schema for tool in t.tools.values()])
        calls = calls[:cfg.max_parallel_calls]
        message = {"role": "assistant", "content": content or ""}
        if calls:
            message["tool_calls"] = [openai_call(call) for call in calls]
        t.messages.append(message)
        t.pending_calls = calls
        if not calls and t.interaction is None:
            t.done = True

    async def _run_tools(self, t: Trajectory) -> None:
        """This turn's calls, at once; then their responses appended."""
        cfg = self.multi_turn
        started = time.perf_counter()
        agent_data = AgentData(t)  # the state the turn's calls see, as verl's tools see it
        results = await self.runtime.tool_runner.run([self._call_tool(t, call, agent_data)
                                                      for call in t.pending_calls], cfg.tool_timeout_s)
        t.metrics["tool_calls"] = t.metrics.get("tool_calls", 0.0) + time.perf_counter() - started
        messages, names = [], []
        for call, result in zip(t.pending_calls, results):
            t.tool_calls += 1
            if isinstance(result, (SandboxUnavailable, MediaToolResponse)):  # a setting, not the call's failure
                raise result
            if isinstance(result, BaseException):  # verl 0.9.1's words; the response budget bounds its length
                text = (f"Error: tool '{call.name}' timed out after {cfg.tool_timeout_s:g} s"
                        if isinstance(result, asyncio.TimeoutError)
                        else f"Error executing tool '{call.name}': {result}")
                result = (text, 0.0, True)
            text, reward, failed = result
            t.tool_errors += int(failed)
            if reward is not None:  # a failed call's is 0.0, as verl's
                t.tool_rewards.append(float(reward))
            if not failed:  # verl truncates what a tool returned; its own error messages are short already
                text = truncate_text(text, cfg.max_tool_response_length, cfg.tool_response_truncate_side)
            message = {"role": "tool", "content": text}
            if getattr(call, "tool_call_id", None) is not None:
                message["tool_call_id"] = call.tool_call_id
            messages.append(message)
            names.append(call.name)
        t.pending_calls = []
        self._append_context(t, messages, self.chat.tool_responses(messages, self.tool_schemas, names))

    async def _call_tool(self, t: Trajectory, call, agent_data: AgentData | None = None) -> tuple[str, float, bool]:
        """(response text, reward, failed). verl 0.9.1's _call_tool: unknown names and bad JSON are answered, not
        raised; a BaseTool runs create -> execute -> release."""
        if getattr(call, "error", None):
            return f"Error: {call.error}", 0.0, True
        tool = t.tools.get(call.name)
        if tool is None:
            return f"Unknown function '{call.name}'. Available tools: {list(t.tools)}", 0.0, True
        try:
            arguments = json.loads(call.arguments)
        except (json.JSONDecodeError, TypeError) as error:
            return f"Invalid JSON in arguments for '{call.name}': {error}", 0.0, True
        if not isinstance(arguments, dict):
            return f"Invalid arguments for '{call.name}': expected a JSON object, got {call.arguments}", 0.0, True
        if isinstance(tool, FunctionTool):
            response, reward, _ = normalize_function_tool_return(await tool.call(arguments))
        else:
            kwargs = t.tools_kwargs.get(call.name, {})
            instance_id, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
            try:
                response, reward, _ = await tool.execute(instance_id, arguments,
                                                         agent_data=agent_data or AgentData(t))
            finally:
                await tool.release(instance_id)
        if response.image or response.video:  # verl 0.9.1 raises too: a text model's loop has no processor
            raise MediaToolResponse(f"tool {call.name!r} returned images or videos, which pyrl's text-only loops "
                                    "cannot show the model (verl 0.9.1 needs a vision-language model's processor)")
        return response.text or "", reward, False

    async def _interact(self, t: Trajectory) -> None:
        """The interaction answers a turn that called no tool; it may end the episode."""
        name, instance = t.interaction
        try:
            reply = await self.runtime.tool_runner.call(
                self.interactions[name].generate_response(instance, t.messages, **t.interaction_kwargs),
                self.multi_turn.tool_timeout_s)
        except Exception as error:
            raise RuntimeError(f"agent loop: interaction {name!r} failed: {type(error).__name__}: {error}") from error
        terminate, text, score, _ = reply
        if score is not None:  # a turn the interaction does not score (verl's interactions may answer None)
            t.turn_scores.append(float(score))
        if terminate:
            t.done = True
            return
        message = {"role": "user", "content": text}
        self._append_context(t, [message], self.chat.user_message(message, self.tool_schemas))

    def _append_context(self, t: Trajectory, messages: list[dict], tokens: list[int]) -> None:
        """Appends non-model tokens (mask 0); past the response budget the trajectory ends without them, as
        verl's."""
        if t.response_ids and t.response_ids[-1] == self.chat.eos_token_id:
            tokens = self.chat.turn_separator + tokens
        t.messages.extend(messages)
        if len(t.response_ids) + len(tokens) >= self.response_length:
            t.done = True
            return
        t.append(tokens, trained=False)
        t.user_turns += 1
