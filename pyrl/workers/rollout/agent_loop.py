"""What the agent loops share (pyrl/experimental/agent_loop: verl 0.9.1's contract, pyrl's single_turn_agent and
tool_agent): which loop a row runs, the tokens of appended messages, tools run under a deadline, tool-response
truncation, and the rollout batch's per-trajectory columns. The trainer imports this module for its columns; the
loops themselves (pydantic, hydra) load only with an agent loop.

The tokens the model generated are kept as generated, never re-tokenized ("continuous tokens", as verl 0.9.1):
only the appended messages are rendered, as the suffix the chat template adds after a synthetic prefix, so the
rollout, the old/ref log-probs and the update all see the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import numpy as np
import torch

log = logging.getLogger("pyrl")

SINGLE_TURN, TOOL_AGENT = "single_turn_agent", "tool_agent"
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

    def tool_responses(self, messages: list[dict], tools: list[dict] | None,
                       names: list[str] | None = None) -> list[int]:
        """The tokens of tool `messages` answering calls of `names` (a template that labels a response with its call's
        name, gpt-oss's, reads it from the assistant turn's tool_calls), rendered after a synthetic call turn."""
        names = names or [m.get("name", "tool") for m in messages]
        calls = [{"id": m.get("tool_call_id", f"call_{i}"), "type": "function",
                  "function": {"name": name, "arguments": {}}} for i, (m, name) in enumerate(zip(messages, names))]
        # reasoning_content: templates that drop an earlier turn's reasoning (Qwen3) render this turn the same way
        # with and without the messages after it, as verl 0.9.1's builder relies on
        assistant = {"role": "assistant", "content": "", "reasoning_content": "reasoning", "tool_calls": calls}
        return self.delta([_SYSTEM, _USER, assistant], messages, tools)

    def user_message(self, message: dict, tools: list[dict] | None) -> list[int]:
        return self.delta([_SYSTEM, _USER], [message], tools)  # verl 0.9.1's prefix for a user message


# ---- running tools with a deadline ----
class ToolRunner:
    """Runs tool coroutines on an event loop in a daemon thread of its own, each under a deadline, for an agent
    loop's coroutine to await. A tool that blocks that loop itself (a synchronous sleep inside `async def
    execute`) cannot be cancelled: its calls are answered as timed out, and the stuck loop is abandoned for a fresh
    one, so the other trajectories' tools go on (and the agent loops' own event loop is never blocked by a tool)."""

    def __init__(self):
        self._start()

    def _start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="pyrl-tools", daemon=True)
        self.thread.start()

    async def run(self, coroutines: list, timeout_s: float) -> list:
        """Each coroutine's result, or the exception it raised (asyncio.TimeoutError past timeout_s)."""
        if not coroutines:
            return []

        async def bounded(coro):
            return await asyncio.wait_for(coro, timeout_s)

        loop = self.loop
        futures = [asyncio.run_coroutine_threadsafe(bounded(c), loop) for c in coroutines]
        waiting = [asyncio.wrap_future(future) for future in futures]
        # wait_for's own cancellation gets a second
        done, _ = await asyncio.wait(waiting, timeout=timeout_s + 1.0)
        results, stuck = [], False
        for future, waited in zip(futures, waiting):
            if waited in done:  # it returned, raised, or wait_for timed it out
                results.append(asyncio.CancelledError() if waited.cancelled() else
                               waited.exception() or waited.result())
            else:  # still running past the deadline: the loop never got to cancel it
                future.cancel()
                waited.cancel()
                stuck = True
                results.append(asyncio.TimeoutError())
        if stuck and loop is self.loop:  # the first caller to see the loop stuck replaces it
            log.warning("agent loop: a tool blocked its event loop past multi_turn.tool_timeout_s=%s; the loop is "
                        "abandoned and a new one started", timeout_s)
            loop.call_soon_threadsafe(loop.stop)
            self._start()
        return results

    async def call(self, coroutine, timeout_s: float = 60.0):
        result = (await self.run([coroutine], timeout_s))[0]
        if isinstance(result, BaseException):
            raise result
        return result


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


AGENT_LOOP_COLUMNS = ("__num_turns__", "tool_call_counts", "tool_error_counts", "tool_seconds",  # numeric ones
                      "generate_seconds")


def trajectory_columns(outputs: list) -> dict:
    """Per-sample columns of the rollout batch from each trajectory's AgentLoopOutput: verl's __num_turns__,
    tool_call_counts, turn_scores, tool_rewards and tool_extra_fields (the loop's extra_fields), and pyrl's
    tool_error_counts, tool_seconds and generate_seconds (the loop's metrics: the seconds it waited on tools and on
    the engine; the trainer's metrics read them); a loop that does not report one (a user's) gets 0 or [] there."""
    def objects(values):
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    extra = [output.extra_fields for output in outputs]
    return {"__num_turns__": np.array([output.num_turns for output in outputs], dtype=np.int32),
            "tool_call_counts": np.array([e.get("tool_call_counts", 0) for e in extra], dtype=np.int32),
            "tool_error_counts": np.array([e.get("tool_error_counts", 0) for e in extra], dtype=np.int32),
            "tool_seconds": np.array([output.metrics.tool_calls for output in outputs], dtype=np.float64),
            "generate_seconds": np.array([output.metrics.generate_sequences for output in outputs], dtype=np.float64),
            "turn_scores": objects([list(e.get("turn_scores") or []) for e in extra]),
            "tool_rewards": objects([list(e.get("tool_rewards") or []) for e in extra]),
            # a loop's own score of its trajectory (None: the reward function scores it); see agent_loop_rm_scores
            "agent_loop_reward_score": objects([output.reward_score for output in outputs]),
            # verl's: each loop's extra_fields whole (the reward function's extra_info gets them; a loop that scores
            # itself puts its reward_extra_info there)
            "tool_extra_fields": objects([dict(e) for e in extra])}


def with_agent_loop_prompts(rows, prompt_ids: list[list[int]], pad_token_id: int):
    """The rollout rows with each trajectory's prompt as its agent loop returned it, where that differs from the
    dataset's (a user's loop may render its own): left-padded into the batch's prompt width, positions recomputed."""
    input_ids, mask = rows.batch["input_ids"], rows.batch["attention_mask"]
    changed = [i for i, ids in enumerate(prompt_ids) if ids != input_ids[i][mask[i].bool()].tolist()]
    if not changed:
        return rows
    width = input_ids.shape[1]
    too_long = [i for i in changed if len(prompt_ids[i]) > width]
    if too_long:
        raise ValueError(f"agent loop: rows {too_long[:8]} returned prompts longer than the batch's prompt width "
                         f"{width} (rollout.prompt_length): {[len(prompt_ids[i]) for i in too_long[:8]]} tokens")
    rows = rows.select_idxs(np.arange(len(rows)))  # a copy: the prompts' rows are shared with the caller
    for i in changed:
        ids = prompt_ids[i]
        rows.batch["input_ids"][i] = torch.tensor([pad_token_id] * (width - len(ids)) + ids, dtype=input_ids.dtype)
        rows.batch["attention_mask"][i] = torch.tensor([0] * (width - len(ids)) + [1] * len(ids), dtype=mask.dtype)
    if "position_ids" in rows.batch:
        rows.batch["position_ids"] = (rows.batch["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
    return rows


def agent_loop_logprobs(outputs: list) -> list[list[float]]:
    """Each trajectory's rollout log-probs (rollout.calculate_log_probs): a loop that returns none, or not one per
    response token, stops the batch (zeros in their place would pass for log-probs of 0)."""
    wrong = [i for i, o in enumerate(outputs)
             if o.response_logprobs is None or len(o.response_logprobs) != len(o.response_ids)]
    if wrong:
        o = outputs[wrong[0]]
        raise ValueError(f"agent loop: rows {wrong[:8]} returned no log-prob per response token (row {wrong[0]}: "
                         f"{None if o.response_logprobs is None else len(o.response_logprobs)} for "
                         f"{len(o.response_ids)} tokens), with rollout.calculate_log_probs=true: pass the server's "
                         "TokenOutput.log_probs on (ct_merge_assistant_token's assistant_logprobs)")
    return [list(o.response_logprobs) for o in outputs]


def agent_loop_rm_scores(reward_scores, lengths: list[int], response_length: int):
    """[B, R] scores on each response's last token (an empty one's: the last column, as verl's rm_scores[-1]) from
    the batch's agent_loop_reward_score column (AgentLoopOutput.reward_score per trajectory; verl 0.9.1's
    rm_scores); zeros on the rows no loop scored (the reward function scores those, as verl's _compute_score)."""
    rm_scores = torch.zeros((len(lengths), response_length), dtype=torch.float32)
    for i, (length, score) in enumerate(zip(lengths, reward_scores)):
        if score is not None:
            rm_scores[i, min(length, response_length) - 1 if length else response_length - 1] = float(score)
    return rm_scores


def agent_loop_reward_extra_info(extra_fields) -> dict[str, list]:
    """reward_extra_info {name: a value per row} of the rows its loops scored: each trajectory's
    extra_fields["reward_extra_info"] (verl 0.9.1's _postprocess), every row with the same names."""
    infos = [dict((fields or {}).get("reward_extra_info") or {}) for fields in extra_fields]
    names = list(dict.fromkeys(name for info in infos for name in info))
    for i, info in enumerate(infos):
        missing = [name for name in names if name not in info]
        if missing:
            raise ValueError(f"agent loop: row {i}'s extra_fields['reward_extra_info'] lacks {missing[:8]}, which "
                             "other rows of the batch report: each row gives the same names")
    return {name: [info[name] for info in infos] for name in names}


def openai_call(call) -> dict:
    try:
        arguments = json.loads(call.arguments)
    except (json.JSONDecodeError, TypeError):
        arguments = call.arguments  # kept raw, as verl 0.9.1 keeps undecodable arguments
    out = {"type": "function", "function": {"name": call.name, "arguments": arguments}}
    if getattr(call, "tool_call_id", None) is not None:
        out["id"] = call.tool_call_id
    return out
