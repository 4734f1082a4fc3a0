"""The agent loop (verl 0.9.1's single_turn_agent and tool_agent): every trajectory of a batch, turn by turn.

    generate a turn -> parse its tool calls (rollout.multi_turn.format) -> run them (asyncio, at most
    max_parallel_calls per turn, each with a timeout) -> append the tool responses as the chat template
    renders the tool role, truncated to max_tool_response_length characters -> next turn; with an
    interaction, a turn without tool calls is answered by the interaction (a simulated user) instead
    -> until no tool is called, the interaction ends the episode, or a turn or length limit is hit.

Each round generates the next turn of every live trajectory in one engine call (vLLM batches them; the hf
engine pads them), with what is left of rollout.response_length as each one's budget. The tokens the model
generated are kept as generated, never re-tokenized ("continuous tokens", as verl 0.9.1): only the appended
messages are rendered, as the suffix the chat template adds after a synthetic prefix, so the rollout, the
old/ref log-probs and the update all see the same tokens. response_mask is 1 on the model's tokens only;
tool, user and template tokens are attended to but not trained on (rollout log-prob 0 there).

A tool that raises, hangs, returns megabytes, gets malformed JSON or an unknown name never stops the run:
the trajectory gets an error message as the tool's response, and the error is counted. (verl 0.9.1 drops a
malformed call block silently, ending the episode as if nothing were called; pyrl answers it.)
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

import numpy as np

from pyrl.sandbox import SandboxUnavailable
from pyrl.seeding import derive_seed
from pyrl.workers.rollout.base import RolloutEngine, SamplingSpec

log = logging.getLogger("pyrl")

SINGLE_TURN, TOOL_AGENT = "single_turn_agent", "tool_agent"
AGENT_LOOPS = (SINGLE_TURN, TOOL_AGENT)
TRUNCATE_SIDES = ("left", "right", "middle")
# the synthetic conversation an appended message is rendered after (verl 0.9.1's continuous-token builder)
_SYSTEM = {"role": "system", "content": "continuous token synthetic system"}
_USER = {"role": "user", "content": "continuous token synthetic user"}


def agent_name(name: str | None, default: str) -> str:
    """The loop a row runs: its agent_name, else rollout.agent.default_agent_loop (verl 0.9.1)."""
    return name or default


def selected_tools(tools: dict, extra_info) -> dict:
    """name -> tool a sample may call: those its extra_info.tool_selection names (verl 0.9.1), else all."""
    selection = (extra_info or {}).get("tool_selection") if isinstance(extra_info, dict) else None
    return {name: tools[name] for name in selection if name in tools} if selection else tools


def prompt_tools(schemas: list[dict] | None, default: str, item: dict) -> list[dict] | None:
    """The tools a data item's prompt is rendered with: the tool agent's (those its tool_selection names), none
    for a single-turn row (verl 0.9.1's single_turn_agent renders the prompt without tools)."""
    if not schemas or agent_name(item.get("agent_name"), default) != TOOL_AGENT:
        return None
    return list(selected_tools({s["function"]["name"]: s for s in schemas}, item.get("extra_info")).values())


def interaction_name(interaction_kwargs: dict, interactions: dict, place: str) -> str:
    """The interaction a sample talks to: interaction_kwargs.name, or the only one configured."""
    name = interaction_kwargs.get("name") or (next(iter(interactions)) if len(interactions) == 1 else None)
    if name not in interactions:
        raise ValueError(f"{place}: interaction_kwargs.name {name!r} is not one of the interactions "
                         f"{sorted(interactions)} (actor_rollout_ref.rollout.multi_turn.interaction_config_path)")
    return name


def uses_agent_loop(rollout_config, has_agent_name_column: bool) -> bool:
    """Whether a run's rollouts go through the agent loop: with multi-turn on, a tool agent by default, or an
    agent_name column in the data (the single-turn rows then end after one turn). Decided by the config and the
    data's columns, never by a shard's rows, so every rank's rollout carries the same columns."""
    return (rollout_config.multi_turn.enable or rollout_config.agent.default_agent_loop != SINGLE_TURN
            or has_agent_name_column)


# ---- tokens of appended messages ----
class ChatTokens:
    """Token ids of messages appended to a conversation, as the chat template renders them there: the tokens
    of [prefix + appended] after those of [prefix], for a synthetic prefix; plus the tokens the template puts
    after an assistant turn's end-of-turn token (Qwen's "\\n" after <|im_end|>), which a generated turn that
    stopped at that token lacks."""

    def __init__(self, tokenizer, chat_template: str | None = None, template_kwargs: dict | None = None):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.template_kwargs = dict(template_kwargs or {})
        self.eos_token_id = tokenizer.eos_token_id
        self.prefix_tokens: dict[str, list[int]] = {}
        closed = self.render([_SYSTEM, _USER, {"role": "assistant", "content": "x"}], False, None)
        ends = [i for i, token in enumerate(closed) if token == self.eos_token_id]
        self.turn_separator = closed[ends[-1] + 1:] if ends else []

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools or None,
                                                  add_generation_prompt=add_generation_prompt, tokenize=False,
                                                  chat_template=self.chat_template, **self.template_kwargs)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def delta(self, prefix: list[dict], appended: list[dict], tools: list[dict] | None) -> list[int]:
        """The tokens [prefix + appended] (with the generation prompt) adds after [prefix]."""
        key = json.dumps([prefix, tools], sort_keys=True)  # the synthetic prefixes repeat: rendered once each
        if key not in self.prefix_tokens:
            self.prefix_tokens[key] = self.render(prefix, False, tools)
        before = self.prefix_tokens[key]
        after = self.render(prefix + appended, True, tools)
        if after[:len(before)] != before:
            roles = [m.get("role") for m in appended]
            raise ValueError(f"agent loop: the chat template does not render {roles} messages as a suffix of the "
                             "conversation before them; it cannot be used turn by turn")
        return after[len(before):]

    def tool_responses(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        calls = [{"id": m.get("tool_call_id", f"call_{i}"), "type": "function",
                  "function": {"name": m.get("name", "tool"), "arguments": {}}} for i, m in enumerate(messages)]
        # reasoning_content: templates that drop an earlier turn's reasoning (Qwen3) render this turn the same way
        # with and without the messages after it, as verl 0.9.1's builder relies on
        assistant = {"role": "assistant", "content": "", "reasoning_content": "reasoning", "tool_calls": calls}
        return self.delta([_SYSTEM, _USER, assistant], messages, tools)

    def user_message(self, message: dict, tools: list[dict] | None) -> list[int]:
        return self.delta([_SYSTEM, _USER], [message], tools)  # verl 0.9.1's prefix for a user message


# ---- running tools with a deadline ----
class ToolRunner:
    """Runs tool coroutines on an event loop in a daemon thread, each under a deadline. A tool that blocks the
    loop itself (a synchronous sleep inside `async def execute`) cannot be cancelled: its calls are answered
    as timed out, and the stuck loop is abandoned for a fresh one, so the next round runs."""

    def __init__(self):
        self._start()

    def _start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pyrl-tools", daemon=True)
        self.thread.start()

    def run(self, coroutines: list, timeout_s: float) -> list:
        """Each coroutine's result, or the exception it raised (asyncio.TimeoutError past timeout_s)."""
        if not coroutines:
            return []

        async def bounded(coro):
            return await asyncio.wait_for(coro, timeout_s)

        futures = [asyncio.run_coroutine_threadsafe(bounded(c), self.loop) for c in coroutines]
        deadline = time.monotonic() + timeout_s + 1.0  # wait_for's own cancellation gets a second
        results, stuck = [], False
        for future in futures:
            try:
                results.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
            except (Exception, asyncio.CancelledError) as error:  # the tool's failure becomes its response
                if future.done():  # it raised, or wait_for timed it out (both TimeoutError: tell them apart)
                    results.append(error)
                else:  # still running past the deadline: the loop never got to cancel it
                    future.cancel()
                    stuck = True
                    results.append(asyncio.TimeoutError())
        if stuck:
            log.warning("agent loop: a tool blocked its event loop past multi_turn.tool_timeout_s=%s; the loop is "
                        "abandoned and a new one started", timeout_s)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._start()
        return results

    def call(self, coroutine, timeout_s: float = 60.0):
        result = self.run([coroutine], timeout_s)[0]
        if isinstance(result, BaseException):
            raise result
        return result


# ---- one trajectory ----
@dataclass
class Trajectory:
    """What the loop knows of one sample: its tokens so far and its counters (`agent_data` for tools)."""

    prompt_ids: list[int]
    agent_name: str
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
    tool_seconds: float = 0.0
    turn_scores: list[float] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    extra_fields: dict = field(default_factory=dict)  # a tool may keep what it likes here (verl's agent_data)
    pending_calls: list = field(default_factory=list)  # this turn's parsed calls, not yet run
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


@dataclass
class AgentLoopOutput:
    responses: list[list[int]]
    response_masks: list[list[int]]
    logprobs: list[list[float]] | None
    trajectories: list[Trajectory]


def truncate_text(text: str, limit: int, side: str) -> str:
    """verl 0.9.1's tool-response truncation (characters, with a marker on the cut side)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class AgentLoop:
    """Drives `engine` over a batch of prompts (see the module docstring). `tools`: BaseTool or FunctionTool
    objects; `interactions`: name -> BaseInteraction."""

    def __init__(self, engine: RolloutEngine, tokenizer, rollout_config, tools: list | None = None,
                 interactions: dict | None = None, chat_template: str | None = None,
                 template_kwargs: dict | None = None):
        # lazy: pyrl.tools (pydantic) loads only with an agent loop; the trainer imports this module for its columns
        from pyrl.workers.rollout.tool_parser import ToolParser

        self.engine, self.tokenizer = engine, tokenizer
        self.config = rollout_config.multi_turn
        self.response_length = rollout_config.response_length
        if self.config.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side: expected one of "
                             f"{TRUNCATE_SIDES}, got {self.config.tool_response_truncate_side!r}")
        self.tools = {tool.name: tool for tool in tools or []}
        self.tool_schemas = [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
                             for tool in self.tools.values()] or None
        self.interactions = dict(interactions or {})
        self.parser = ToolParser.get_tool_parser(self.config.format, tokenizer)
        # the tokens the format's model ends a calling turn with instead of EOS (gemma4's <tool_call|>, glm's
        # <|observation|>, kimi's <|im_end|>): the tool agent's turns stop there (every engine honours
        # SamplingSpec.stop_token_ids), as verl 0.9.1's ToolAgentLoop adds them to its requests
        self.stop_token_ids = tuple(sorted(set(self.parser.stop_token_ids)))
        self.chat = ChatTokens(tokenizer, chat_template, template_kwargs)
        self.runner = ToolRunner()

    # ---- the loop ----
    def run(self, prompt_ids: list[list[int]], rows: list[dict], spec: SamplingSpec) -> AgentLoopOutput:
        """prompt_ids: each prompt's tokens (a tool agent's rendered with its tools' schemas); rows: each
        prompt's agent_name, raw_prompt, tools_kwargs, interaction_kwargs and extra_info (missing: defaults; a
        missing agent_name is single_turn_agent). Returns spec.n trajectories per prompt, interleaved."""
        self.response_length = spec.max_tokens  # the run's budget (validation may set its own response_length)
        trajectories = [self._start(ids, row) for ids, row in zip(prompt_ids, rows) for _ in range(spec.n)]
        turn_spec = dataclasses.replace(spec, n=1)
        round_index = 0
        while live := [t for t in trajectories if not t.done]:
            tokens, logprobs = self._generate_turns(live, turn_spec, round_index)
            round_index += 1
            for i, t in enumerate(live):
                self._assistant_turn(t, tokens[i], None if logprobs is None else logprobs[i])
            callers = [t for t in live if not t.done and t.pending_calls]
            self._run_tools(callers)
            calling = {id(t) for t in callers}
            self._interact([t for t in live if not t.done and id(t) not in calling])
        for t in trajectories:
            if t.interaction is not None:
                name, instance = t.interaction
                self.runner.call(self.interactions[name].finalize_interaction(instance), self.config.tool_timeout_s)
        return AgentLoopOutput(responses=[t.response_ids for t in trajectories],
                               response_masks=[t.response_mask for t in trajectories],
                               logprobs=[t.response_logprobs for t in trajectories] if spec.logprobs else None,
                               trajectories=trajectories)

    def _generate_turns(self, live: list[Trajectory], turn_spec: SamplingSpec,
                        round_index: int) -> tuple[list[list[int]], list[list[float]] | None]:
        """The next turn of each live trajectory, in one engine call; in two when the parser has stop tokens and
        single-turn rows are live too: verl 0.9.1 stops only its tool agent's turns at them (its single_turn_agent
        ends at EOS), and a call's stop tokens are the same for all its prompts."""
        groups = [(live, ())]
        if self.stop_token_ids:
            tool_rows = [t for t in live if t.agent_name == TOOL_AGENT]
            groups = [(rows, stop) for rows, stop in ((tool_rows, self.stop_token_ids),
                                                      ([t for t in live if t.agent_name != TOOL_AGENT], ()))
                      if rows]
        tokens_of, logprobs_of = {}, {}
        for group_index, (rows, stop_token_ids) in enumerate(groups):
            # a second call gets its own seed: vLLM seeds a call's prompts by their places in it, which the first
            # call's prompts share
            coordinates = {"round": round_index, **({"call": group_index} if group_index else {})}
            seed = None if turn_spec.seed is None else derive_seed(turn_spec.seed, "turn", **coordinates)
            tokens, logprobs = self.engine.generate(
                [t.prompt_ids + t.response_ids for t in rows],
                dataclasses.replace(turn_spec, seed=seed, stop_token_ids=stop_token_ids),
                max_tokens=[self.response_length - len(t.response_ids) for t in rows])
            for i, t in enumerate(rows):
                tokens_of[id(t)] = tokens[i]
                if logprobs is not None:
                    logprobs_of[id(t)] = logprobs[i]
        return [tokens_of[id(t)] for t in live], [logprobs_of[id(t)] for t in live] if logprobs_of else None

    def _start(self, prompt_ids: list[int], row: dict) -> Trajectory:
        loop_name = row.get("agent_name") or SINGLE_TURN
        if loop_name not in AGENT_LOOPS:
            raise ValueError(f"agent loop: agent_name {loop_name!r} is not one of {AGENT_LOOPS}")
        t = Trajectory(prompt_ids=list(prompt_ids), agent_name=loop_name,
                       messages=copy.deepcopy(list(row.get("raw_prompt") or [])),
                       tools_kwargs=dict(row.get("tools_kwargs") or {}),
                       interaction_kwargs=dict(row.get("interaction_kwargs") or {}),
                       tools=selected_tools(self.tools, row.get("extra_info")))
        if loop_name == TOOL_AGENT and self.interactions:
            name = interaction_name(t.interaction_kwargs, self.interactions, "agent loop")
            instance = self.runner.call(self.interactions[name].start_interaction(t.request_id, **t.interaction_kwargs),
                                        self.config.tool_timeout_s)
            t.interaction = (name, instance or t.request_id)
        return t

    def _assistant_turn(self, t: Trajectory, tokens: list[int], logprobs: list[float] | None) -> None:
        """Appends a generated turn and decides what follows: tool calls, the interaction, or the end."""
        t.append(tokens, trained=True, logprobs=logprobs)
        t.assistant_turns += 1
        cfg = self.config
        if (t.agent_name == SINGLE_TURN or len(t.response_ids) >= self.response_length
                or (cfg.max_assistant_turns and t.assistant_turns >= cfg.max_assistant_turns)
                or (cfg.max_user_turns and t.user_turns >= cfg.max_user_turns)):
            t.done = True
            return
        content, calls = self.runner.call(self.parser.extract_tool_calls(tokens, [tool.tool_schema for tool in
                                                                                 t.tools.values()]))
        calls = calls[:cfg.max_parallel_calls]
        message = {"role": "assistant", "content": content or ""}
        if calls:
            message["tool_calls"] = [_openai_call(call) for call in calls]
        t.messages.append(message)
        t.pending_calls = calls
        if not calls and t.interaction is None:
            t.done = True

    def _run_tools(self, callers: list[Trajectory]) -> None:
        """Every pending call of every trajectory at once; then each trajectory's responses appended."""
        jobs = [(t, call) for t in callers for call in t.pending_calls]
        started = time.perf_counter()
        results = self.runner.run([self._call_tool(t, call) for t, call in jobs], self.config.tool_timeout_s)
        seconds = time.perf_counter() - started
        responses: dict[int, list[dict]] = {}
        for t in callers:  # each waited for the round's calls, all run at once (verl's tool_calls timer)
            t.tool_seconds += seconds
        for (t, call), result in zip(jobs, results):
            t.tool_calls += 1
            if isinstance(result, SandboxUnavailable):  # a machine setting, not the tool call's failure
                raise result
            if isinstance(result, BaseException):
                limit = self.config.max_tool_response_length  # an exception's message is not bounded either
                text = (f"Error: tool '{call.name}' timed out after {self.config.tool_timeout_s:g} s"
                        if isinstance(result, asyncio.TimeoutError) else
                        f"Error executing tool '{call.name}': {type(result).__name__}: "
                        f"{truncate_text(str(result), limit, self.config.tool_response_truncate_side)}")
                result = (text, 0.0, True)
            text, reward, failed = result
            t.tool_errors += int(failed)
            if reward is not None:  # a failed call's is 0.0, as verl's
                t.tool_rewards.append(float(reward))
            if not failed:  # verl truncates what a tool returned; its own error messages are short already
                text = truncate_text(text, self.config.max_tool_response_length,
                                     self.config.tool_response_truncate_side)
            message = {"role": "tool", "content": text}
            if getattr(call, "tool_call_id", None) is not None:
                message["tool_call_id"] = call.tool_call_id
            responses.setdefault(id(t), []).append(message)
        for t in callers:
            t.pending_calls = []
            self._append_context(t, responses[id(t)], self.chat.tool_responses(responses[id(t)], self.tool_schemas))

    async def _call_tool(self, t: Trajectory, call) -> tuple[str, float, bool]:
        """(response text, reward, failed). verl 0.9.1's _call_tool: unknown names and bad JSON are
        answered, not raised; a BaseTool runs create -> execute -> release."""
        # lazy: pyrl.tools (pydantic) loads only with an agent loop; the trainer imports this module for its columns
        from pyrl.tools.function_tool import FunctionTool, normalize_function_tool_return

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
            return response.text or "", reward, False
        kwargs = t.tools_kwargs.get(call.name, {})
        instance_id, _ = await tool.create(create_kwargs=kwargs.get("create_kwargs", {}))
        try:
            response, reward, _ = await tool.execute(instance_id, arguments, agent_data=t)
        finally:
            await tool.release(instance_id)
        return response.text or "", reward, False

    def _interact(self, trajectories: list[Trajectory]) -> None:
        """The interaction answers each trajectory whose turn called no tool; it may end the episode."""
        asking = [t for t in trajectories if t.interaction is not None]
        replies = self.runner.run([self.interactions[t.interaction[0]].generate_response(
            t.interaction[1], t.messages, **t.interaction_kwargs) for t in asking], self.config.tool_timeout_s)
        for t, reply in zip(asking, replies):
            if isinstance(reply, BaseException):
                raise RuntimeError(f"agent loop: interaction {t.interaction[0]!r} failed: "
                                   f"{type(reply).__name__}: {reply}") from reply
            terminate, text, score, _ = reply
            t.turn_scores.append(float(score))
            if terminate:
                t.done = True
                continue
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


AGENT_LOOP_COLUMNS = ("__num_turns__", "tool_call_counts", "tool_error_counts", "tool_seconds")  # numeric ones


def trajectory_columns(trajectories: list[Trajectory]) -> dict:
    """Per-sample columns of the rollout batch: verl's __num_turns__, tool_call_counts, turn_scores and
    tool_rewards, and pyrl's tool_error_counts and tool_seconds (the trainer's metrics read them)."""
    def objects(values):
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    return {"__num_turns__": np.array([t.num_turns for t in trajectories], dtype=np.int32),
            "tool_call_counts": np.array([t.tool_calls for t in trajectories], dtype=np.int32),
            "tool_error_counts": np.array([t.tool_errors for t in trajectories], dtype=np.int32),
            "tool_seconds": np.array([t.tool_seconds for t in trajectories], dtype=np.float64),
            "turn_scores": objects([list(t.turn_scores) for t in trajectories]),
            "tool_rewards": objects([list(t.tool_rewards) for t in trajectories])}


def _openai_call(call) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except (json.JSONDecodeError, TypeError):
        arguments = call.arguments  # kept raw, as verl 0.9.1 keeps undecodable arguments
    out = {"type": "function", "function": {"name": call.name, "arguments": arguments}}
    if getattr(call, "tool_call_id", None) is not None:
        out["id"] = call.tool_call_id
    return out
