"""pyrl's single_turn_agent (verl 0.9.1's): one generate call on the prompt; the response is what came back, cut at
the response length."""

from __future__ import annotations

from uuid import uuid4

from pyrl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from pyrl.utils.profiler import simple_timer


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: dict, **kwargs) -> AgentLoopOutput:
        prompt_ids = kwargs.get("raw_prompt_ids")
        if prompt_ids is None:  # verl renders the prompt without tools (a tool agent's has them)
            prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        prompt_ids = [int(token) for token in prompt_ids]
        response_length = self.rollout_config.response_length
        metrics = {}
        with simple_timer("generate_sequences", metrics):
            output = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=prompt_ids,
                                                        sampling_params=sampling_params)
        response = list(output.token_ids)[:response_length]
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=response, response_mask=[1] * len(response),
            response_logprobs=list(output.log_probs)[:response_length] if output.log_probs else None,
            num_turns=2, metrics=metrics, extra_fields={"turn_scores": [], "tool_rewards": []})
