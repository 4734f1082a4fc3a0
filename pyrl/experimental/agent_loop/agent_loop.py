"""verl 0.9.1's agent-loop contract (verl/experimental/agent_loop/agent_loop.py), under the same names:

    @register("my_agent")
    class MyAgentLoop(AgentLoopBase):
        async def run(self, sampling_params: dict, **kwargs) -> AgentLoopOutput:
            prompt_ids = await self.ct_build_initial_tokens(kwargs["raw_prompt"])
            output = await self.server_manager.generate(request_id=..., prompt_ids=prompt_ids,
                                                        sampling_params=sampling_params)
            ...

A row runs the loop its agent_name column names (else rollout.agent.default_agent_loop). Loops are registered with
@register, or listed in the YAML file rollout.agent.agent_loop_config_path (`- name: my_agent` /
`_target_: my.module.MyAgentLoop`, plus any constructor arguments), and built per trajectory with
hydra.utils.instantiate, as verl does; pyrl's own single_turn_agent and tool_agent are registered the same way.

Every trajectory is a coroutine (AgentLoopRunner.run: asyncio.gather over the batch), and its generate calls go to
pyrl's RolloutServer, which batches what is pending (pyrl/workers/rollout/server.py).

What differs from verl, and why:
- kwargs are the row's non-tensor fields as in verl, plus `raw_prompt_ids`: the prompt's tokens as pyrl's dataset
  rendered them (tools, data.apply_chat_template_kwargs, truncation); pyrl's own loops start from them.
- trainer_config holds actor_rollout_ref (the worker's section) and data.apply_chat_template_kwargs: the rest of the
  run's config does not reach the rollout workers.
- The continuous-token builder is pyrl's ChatTokens (the template's own rendering of appended messages after a
  synthetic prefix, with the turn separator an end-of-turn token lacks), not verl's per-family builders: GLM, Gemma 4
  and DeepSeek templates with boundary rules of their own are not special-cased.
- Text only: multimodal inputs are refused.
- reward_score (a loop that scores its own trajectories) becomes rm_scores, as verl's; pyrl's reward step then
  takes it instead of the reward function.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from omegaconf import OmegaConf
from pydantic import BaseModel

from pyrl.config import engine_max_model_len
from pyrl.workers.rollout.agent_loop import ChatTokens, ToolRunner
from pyrl.workers.rollout.server import CURRENT_TRAJECTORY, RolloutServer, TrajectorySlot

logger = logging.getLogger("pyrl")


class AgentLoopMetrics(BaseModel):
    """Agent loop performance metrics (seconds)."""

    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = -1  # -1 means not available


class AgentLoopOutput(BaseModel):
    """Agent loop output."""

    prompt_ids: list[int]
    """Prompt token ids."""
    response_ids: list[int]
    """Response token ids including LLM generated token, tool response token."""
    response_mask: list[int]
    """Response mask, 1 for LLM generated token, 0 for tool response token."""
    response_logprobs: Optional[list[float]] = None
    """Log probabilities for the response tokens."""
    routed_experts: Optional[Any] = None
    """Routed experts for the total tokens (pyrl: refused)."""
    multi_modal_data: Optional[dict[str, Any]] = None
    """Multi-modal data for multi-modal tools (pyrl: refused)."""
    reward_score: Optional[float] = None
    """Reward score for the trajectory."""
    num_turns: int = 0
    """Number of chat turns, including user, assistant, tool."""
    metrics: AgentLoopMetrics
    """Auxiliary performance metrics"""
    extra_fields: dict[str, Any] = {}
    """Extra fields for dynamic addition."""
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    mm_processor_output: Optional[list[dict[str, Any]]] = None


class AgentRuntime:
    """What pyrl's own loops take besides verl's constructor arguments, in one object (hydra.utils.instantiate
    passes objects through as they are, where it would turn a dict into a DictConfig): the interactions by name,
    the ToolRunner tools run on, and the ChatTokens the batch's trajectories share. A user's loop ignores it."""

    def __init__(self, chat_tokens: ChatTokens, tool_runner=None, interactions: dict | None = None, multi_turn=None):
        """multi_turn: pyrl's rollout.multi_turn section itself (its reads are pyrl's, not a DictConfig copy's)."""
        self.chat_tokens, self.tool_runner, self.interactions = chat_tokens, tool_runner, dict(interactions or {})
        self.multi_turn = multi_turn


class DictConfigWrap:
    """Wrapper for DictConfig to avoid hydra.utils.instantiate recursive resolve."""

    def __init__(self, config):
        self.config = config


class ToolListWrap:
    """Wraps a tool list so hydra.utils.instantiate doesn't recursively resolve its elements."""

    def __init__(self, tools: list):
        self.tools = tools


# ---- verl's continuous-token builder API, over pyrl's ChatTokens ----
@dataclass(frozen=True)
class MergeResult:
    """Merged runtime tokens and the edits at the junction (verl 0.9.1's): inserted_token_ids are boundary tokens
    the builder added (mask and log-prob 0)."""

    token_ids: list[int]
    appended_token_count: int
    kind: Literal["assistant", "context"] = "context"
    inserted_token_ids: list[int] = field(default_factory=list)
    removed_prefix_token_count: int = 0


class ContinuousTokens:
    """verl 0.9.1's ContinuousTokenBuilder runtime API (build_initial_tokens, merge_context_tokens,
    merge_assistant_tokens, align_response_metadata) over pyrl's ChatTokens."""

    def __init__(self, chat: ChatTokens):
        self.chat = chat

    def build_initial_tokens(self, messages: list[dict], *, tools: list[dict] | None = None, images=None,
                             videos=None, audios=None, mm_inputs_out=None) -> list[int]:
        return self.chat.render(list(messages), True, tools)

    def merge_context_tokens(self, previous_messages: list[dict], updated_messages: list[dict],
                             runtime_token_ids: list[int], *, tools: list[dict] | None = None) -> MergeResult:
        if list(updated_messages[:len(previous_messages)]) != list(previous_messages):
            raise ValueError("continuous tokens: updated_messages must extend previous_messages (append only)")
        appended = list(updated_messages[len(previous_messages):])
        roles = {message.get("role") for message in appended}
        if not appended:
            tokens = []
        elif roles == {"tool"}:
            tokens = self.chat.tool_responses(appended, tools)
        elif len(appended) == 1 and roles <= {"user", "system"}:
            tokens = self.chat.user_message(appended[0], tools)
        else:
            raise ValueError(f"continuous tokens: pyrl merges either tool messages or one user message per turn, "
                             f"got roles {[m.get('role') for m in appended]}")
        # a turn that stopped at its end-of-turn token lacks what the template puts after it (Qwen's newline); a
        # turn cut at max_tokens gets nothing inserted, not even the end-of-turn token, as in verl 0.9.1's
        # QwenContinuousTokenBuilder (the model then reads `...answer<|im_start|>user`, masked out of the loss)
        ended = bool(runtime_token_ids) and runtime_token_ids[-1] == self.chat.eos_token_id and bool(tokens)
        inserted = list(self.chat.turn_separator) if ended else []
        return MergeResult(token_ids=list(runtime_token_ids) + inserted + tokens, appended_token_count=len(tokens),
                           kind="context", inserted_token_ids=inserted)

    def merge_assistant_tokens(self, runtime_token_ids: list[int], assistant_token_ids: list[int]) -> MergeResult:
        return MergeResult(token_ids=list(runtime_token_ids) + list(assistant_token_ids),
                           appended_token_count=len(assistant_token_ids), kind="assistant")

    @staticmethod
    def align_response_metadata(merge_result: MergeResult, response_mask: list[int],
                                response_logprobs: list[float] | None = None, *,
                                assistant_logprobs: list[float] | None = None) -> tuple[list[int], list | None]:
        """verl 0.9.1's: inserted boundary and context tokens get mask and log-prob 0, assistant tokens mask 1 and
        their log-probs."""
        mask = list(response_mask)
        logprobs = list(response_logprobs) if response_logprobs is not None else None
        if logprobs is None and assistant_logprobs is not None:
            raise ValueError("response_logprobs is required when assistant_logprobs is provided")
        if merge_result.removed_prefix_token_count:
            mask = mask[:-merge_result.removed_prefix_token_count]
            if logprobs is not None:
                logprobs = logprobs[:-merge_result.removed_prefix_token_count]
        inserted = len(merge_result.inserted_token_ids)
        mask += [0] * inserted
        if logprobs is not None:
            logprobs += [0.0] * inserted
        count = merge_result.appended_token_count
        if merge_result.kind == "assistant":
            mask += [1] * count
            if logprobs is not None:
                assistant_logprobs = [] if assistant_logprobs is None and not count else assistant_logprobs
                if assistant_logprobs is None or len(assistant_logprobs) != count:
                    got = None if assistant_logprobs is None else len(assistant_logprobs)
                    raise ValueError(f"assistant_logprobs must have one log-prob per appended assistant token "
                                     f"({count}), got {got}")
                logprobs += list(assistant_logprobs)
        elif merge_result.kind == "context":
            mask += [0] * count
            if logprobs is not None:
                logprobs += [0.0] * count
        else:
            raise ValueError(f"Unknown Continuous Token merge kind: {merge_result.kind!r}")
        return mask, logprobs

    @classmethod
    def supports_multimodal(cls) -> bool:
        return False


class AgentLoopBase(ABC):
    """An agent loop takes a row's messages, talks to the rollout server and its environment, and returns one
    trajectory (verl 0.9.1's base class, same constructor and helpers; see the module docstring for the
    differences)."""

    def __init__(self, trainer_config: DictConfigWrap, server_manager, tokenizer, processor=None, dataset_cls=None,
                 data_config: DictConfigWrap | None = None, hf_model_type: str | None = None, **kwargs):
        self.config = trainer_config.config
        self.rollout_config = self.config.actor_rollout_ref.rollout
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.data_config = data_config.config if data_config is not None else OmegaConf.create({})
        self.apply_chat_template_kwargs = dict(self.data_config.get("apply_chat_template_kwargs") or {})
        self.mm_processor_kwargs = dict(self.data_config.get("mm_processor_kwargs") or {})
        runtime = kwargs.get("runtime")
        chat = runtime.chat_tokens if isinstance(runtime, AgentRuntime) else ChatTokens(
            tokenizer, self.config.actor_rollout_ref.model.get("custom_chat_template"),
            self.apply_chat_template_kwargs)
        self.continuous_token_builder = ContinuousTokens(chat)
        self.loop = asyncio.get_running_loop()

    def _assert_mm_supported(self, has_multi_modal: bool) -> None:
        if has_multi_modal:
            raise ValueError("agent loop: multimodal inputs are not supported by pyrl (text only)")

    def _get_mm_processor_kwargs(self, audio_data=None) -> dict:
        return dict(self.mm_processor_kwargs)

    async def process_vision_info(self, messages: list[dict]) -> dict:
        return await self.process_multi_modal_info(messages)

    async def process_multi_modal_info(self, messages: list[dict]) -> dict:
        """{} for text messages; a message with image, video or audio content is refused (pyrl is text only)."""
        for message in messages:
            content = message.get("content")
            if isinstance(content, list) and any(isinstance(part, dict) and part.get("type") in
                                                 ("image", "video", "audio", "image_url") for part in content):
                raise ValueError("agent loop: multimodal message content is not supported by pyrl (text only)")
        return {}

    async def ct_build_initial_tokens(self, messages: list[dict], tools: list[dict] = None, images=None,
                                      videos=None, audios=None, mm_inputs_out: dict = None) -> list[int]:
        self._assert_mm_supported(bool(images or videos or audios))
        prompt_ids = await self.loop.run_in_executor(
            None, lambda: self.continuous_token_builder.build_initial_tokens(messages, tools=tools))
        return self._cap_text_prompt_length(prompt_ids)

    @staticmethod
    def build_sglang_video_payload(videos, mm_inputs: dict) -> None:
        return None

    async def ct_merge_context_msg(self, previous_messages: list[dict], updated_messages: list[dict],
                                   runtime_token_ids: list[int], response_mask: list[int],
                                   response_logprobs: Optional[list[float]] = None, tools: list[dict] = None):
        merge_result = await self.loop.run_in_executor(None, lambda: self.continuous_token_builder.merge_context_tokens(
            previous_messages, updated_messages, runtime_token_ids, tools=tools))
        mask, logprobs = self.continuous_token_builder.align_response_metadata(merge_result, response_mask,
                                                                              response_logprobs)
        return merge_result, mask, logprobs

    async def ct_merge_assistant_token(self, runtime_token_ids: list[int], assistant_token_ids: list[int],
                                       response_mask: list[int], response_logprobs: Optional[list[float]] = None,
                                       assistant_logprobs: Optional[list[float]] = None):
        merge_result = self.continuous_token_builder.merge_assistant_tokens(runtime_token_ids, assistant_token_ids)
        mask, logprobs = self.continuous_token_builder.align_response_metadata(
            merge_result, response_mask, response_logprobs, assistant_logprobs=assistant_logprobs)
        return merge_result, mask, logprobs

    def _cap_text_prompt_length(self, prompt_ids: list[int]) -> list[int]:
        prompt_length = self.rollout_config.prompt_length
        if len(prompt_ids) > prompt_length:
            logger.warning("Prompt of %d tokens exceeds rollout.prompt_length=%d; left-truncating.", len(prompt_ids),
                           prompt_length)
            return prompt_ids[-prompt_length:]
        return prompt_ids

    @abstractmethod
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        """Run the agent loop for one row. sampling_params: the batch's (temperature, top_p, top_k,
        repetition_penalty, logprobs); kwargs: the row's fields (raw_prompt, tools_kwargs, extra_info, index, ...)."""
        raise NotImplementedError


# agent_name -> the config hydra.utils.instantiate builds the loop from ({"_target_": "module.Class", ...})
_agent_loop_registry: dict[str, dict] = {}


def register(agent_name: str):
    """Register agent loop class."""

    def decorator(subclass: type[AgentLoopBase]) -> type[AgentLoopBase]:
        _agent_loop_registry[agent_name] = {"_target_": f"{subclass.__module__}.{subclass.__qualname__}"}
        return subclass

    return decorator


def load_agent_loop_config(path: str | None) -> None:
    """rollout.agent.agent_loop_config_path: a YAML list of {name, _target_, ...} entries, each registered under its
    name (verl 0.9.1's AgentLoopWorker does the same)."""
    if not path:
        return
    key = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
    try:
        entries = OmegaConf.load(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{key}: no file {path!r}") from None
    if not OmegaConf.is_list(entries):
        raise ValueError(f"{key}: {path} must hold a list of agent loops ({{name, _target_}} entries)")
    for i, entry in enumerate(entries):
        if not OmegaConf.is_dict(entry) or not entry.get("name") or not entry.get("_target_"):
            raise ValueError(f"{key}: {path} entry {i} needs a name and a _target_ (module.Class), got {entry}")
        _agent_loop_registry[str(entry.name)] = entry


def known_agent_loops(path: str | None) -> set[str]:
    """The agent_name values a run may use: pyrl's loops and those of rollout.agent.agent_loop_config_path, whose
    classes are located here (an unimportable _target_ stops the run at start, naming it)."""
    import hydra  # lazy: hydra's instantiate loads only with an agent loop

    # lazy: circular (they import this module); importing them registers pyrl's loops
    from pyrl.experimental.agent_loop import single_turn_agent_loop, tool_agent_loop  # noqa: F401

    load_agent_loop_config(path)
    for name, entry in _agent_loop_registry.items():
        try:
            hydra.utils.get_class(str(entry["_target_"]))
        except Exception as error:
            raise ValueError(f"actor_rollout_ref.rollout.agent.agent_loop_config_path: agent loop {name!r}: its "
                             f"_target_ {entry['_target_']!r} cannot be imported: {error}") from error
    return set(_agent_loop_registry)


@dataclass
class BatchOutput:
    """One batch's trajectories, in the batch's order: each AgentLoopOutput, and the rollout server's counters."""

    outputs: list[AgentLoopOutput]
    engine_calls: int
    requests: int
    engine_idle_fraction: float


class AgentLoopRunner:
    """Runs a batch's rows through their agent loops, every trajectory a coroutine against one RolloutServer
    (verl's AgentLoopWorker.generate_sequences, without Ray: it runs in the rollout worker). config: pyrl's
    actor_rollout_ref section; tools: what every loop gets as tools=ToolListWrap, as verl's; interactions: pyrl's
    tool agent's, by name; template_kwargs: data.apply_chat_template_kwargs. lockstep: the lock-step rollout, to
    measure against (see RolloutServer)."""

    def __init__(self, engine, tokenizer, config, tools: list, interactions: dict | None = None,
                 template_kwargs: dict | None = None, lockstep: bool = False):
        # lazy: circular (they import this module); importing them registers pyrl's loops
        from pyrl.experimental.agent_loop import single_turn_agent_loop, tool_agent_loop  # noqa: F401

        rollout = config.rollout
        self.engine, self.tokenizer, self.lockstep = engine, tokenizer, lockstep
        # what loops see as self.config (verl hands them a DictConfig): an open copy, with verl's rollout keys that
        # pyrl refuses set to the defaults it runs with (loops read them)
        self.trainer_config = OmegaConf.create({"actor_rollout_ref": OmegaConf.to_container(
            OmegaConf.structured(config))})
        OmegaConf.update(self.trainer_config, "actor_rollout_ref.rollout.full_determinism", False, force_add=True)
        template_kwargs = dict(template_kwargs or {})
        self.data_config = OmegaConf.create({"apply_chat_template_kwargs": template_kwargs})
        self.tools = list(tools)
        self.runtime = AgentRuntime(ChatTokens(tokenizer, config.model.custom_chat_template, template_kwargs),
                                    ToolRunner(), interactions, rollout.multi_turn)
        self.classes: dict[str, type] = {}
        load_agent_loop_config(rollout.agent.agent_loop_config_path)
        self.prompt_length = rollout.prompt_length
        self.max_model_len = engine_max_model_len(rollout)

    def _build(self, name: str, **kwargs) -> AgentLoopBase:
        """hydra.utils.instantiate(registry entry, **kwargs, _recursive_=False), as verl builds a loop per
        trajectory; a plain {_target_, arguments} entry is built by calling its class, located once (instantiate
        costs ~5 ms a trajectory, the loop's own constructor ~0.3)."""
        import hydra  # lazy: hydra's instantiate loads only with an agent loop

        entry = _agent_loop_registry[name]
        if any(key.startswith("_") and key != "_target_" for key in entry):  # _args_, _partial_, ...: hydra's
            return hydra.utils.instantiate(entry, **kwargs, _recursive_=False)
        if name not in self.classes:
            self.classes[name] = hydra.utils.get_class(str(entry["_target_"]))
        # the entry's own arguments as instantiate passes them without recursion (nested ones stay configs)
        arguments = {key: entry[key] for key in entry if key != "_target_"}
        return self.classes[name](**arguments, **kwargs)

    def check_names(self, names: list[str]) -> None:
        unknown = sorted({name for name in names if name not in _agent_loop_registry})
        if unknown:
            raise ValueError(f"agent loop: agent_name {unknown} not registered; registered: "
                             f"{sorted(_agent_loop_registry)} (register one with @register or "
                             "actor_rollout_ref.rollout.agent.agent_loop_config_path)")

    def run(self, rows: list[dict], sampling_params: dict, spec) -> BatchOutput:
        """rows: each trajectory's fields (agent_name, raw_prompt, raw_prompt_ids, ...), one per trajectory;
        spec: the batch's SamplingSpec (its seed, response length and defaults)."""
        self.check_names([row["agent_name"] for row in rows])
        config = self.trainer_config
        if config.actor_rollout_ref.rollout.response_length != spec.max_tokens:  # validation's may differ
            config = copy.deepcopy(config)
            config.actor_rollout_ref.rollout.response_length = spec.max_tokens
        return asyncio.run(self._run(rows, sampling_params, spec, config))

    async def _run(self, rows: list[dict], sampling_params: dict, spec, config) -> BatchOutput:
        server = RolloutServer(self.engine, spec, self.prompt_length, self.max_model_len, self.lockstep)
        wrapped, data = DictConfigWrap(config), DictConfigWrap(self.data_config)

        async def trajectory(index: int, row: dict) -> AgentLoopOutput:
            CURRENT_TRAJECTORY.set(TrajectorySlot(index))
            server.trajectory_started()
            try:
                kwargs = {key: value for key, value in row.items() if key != "agent_name"}
                loop = self._build(row["agent_name"], trainer_config=wrapped, server_manager=server,
                                   tokenizer=self.tokenizer, processor=None, hf_model_type=None, dataset_cls=None,
                                   data_config=data, tools=ToolListWrap(self.tools), runtime=self.runtime)
                output = await loop.run(dict(sampling_params), **kwargs)
                if not isinstance(output, AgentLoopOutput):
                    raise TypeError(f"agent loop {row['agent_name']!r}: run returned {type(output).__name__}, "
                                    "expected an AgentLoopOutput")
                return output
            finally:
                server.trajectory_finished()

        try:
            # each task runs in a copy of this context, so each trajectory's slot is its own
            outputs = await asyncio.gather(*(trajectory(i, row) for i, row in enumerate(rows)))
        finally:
            server.close()
        return BatchOutput(list(outputs), server.stats.calls, server.stats.requests, server.stats.idle_fraction())
