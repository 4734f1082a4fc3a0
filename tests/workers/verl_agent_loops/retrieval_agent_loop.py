"""A loop of the tests' own, written against verl 0.9.1's agent-loop contract as a user would write it (only the
package name is pyrl's): a retrieval agent over a small local corpus.

The model answers; its answer (with the question) is the query for a word-overlap search over the corpus (a JSON
list of passages, at extra_info.corpus_path); the best passage not yet retrieved is appended as a user message
(ct_merge_context_msg: mask 0) and the model answers again, extra_info.rounds times, within the response length,
each answer at most extra_info.max_turn_tokens tokens (default: what is left of the response).
reward_score: 1.0 where a retrieved passage is the row's gold one (extra_info.gold), else 0.0.

extra_fields: retrieved (passage ids), turn_scores (each retrieval's overlap), tool_call_counts (retrievals, the
column pyrl's trainer reads), calls (each generate request's prompt_ids and the token_ids the server returned),
for the test to check the plumbing against, and reward_extra_info (acc and passages, verl's per-sample reward
fields of a loop that scores itself).
"""

from __future__ import annotations

import json
import re
from typing import Any
from uuid import uuid4

from pyrl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from pyrl.utils.profiler import simple_timer
from pyrl.workers.rollout.replica import TokenOutput


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def retrieve(corpus: list[str], query: str, exclude: list[int]) -> tuple[int, int]:
    """(passage id, overlap) of the passage sharing the most words with the query; ties go to the lower id."""
    query_words = words(query)
    candidates = [i for i in range(len(corpus)) if i not in exclude]
    best = max(candidates, key=lambda i: (len(words(corpus[i]) & query_words), -i))
    return best, len(words(corpus[best]) & query_words)


@register("retrieval_agent")
class RetrievalAgentLoop(AgentLoopBase):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.response_length = self.rollout_config.response_length

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        extra_info = kwargs["extra_info"]
        with open(extra_info["corpus_path"]) as f:
            corpus = json.load(f)
        rounds = int(extra_info["rounds"])
        max_turn_tokens = int(extra_info.get("max_turn_tokens", self.response_length))
        messages = list(kwargs["raw_prompt"])
        question = messages[-1]["content"]

        prompt_ids = await self.ct_build_initial_tokens(messages)
        tokens = list(prompt_ids)
        mask: list[int] = []
        logprobs: list[float] | None = [] if sampling_params.get("logprobs") else None
        metrics: dict = {}
        calls, retrieved, turn_scores = [], [], []
        assistant_turns = user_turns = 0
        request_id = uuid4().hex
        while True:
            params = {**sampling_params, "max_tokens": min(max_turn_tokens, self.response_length - len(mask))}
            with simple_timer("generate_sequences", metrics):
                output = await self.server_manager.generate(request_id=request_id, prompt_ids=tokens,
                                                            sampling_params=params)
            if not isinstance(output, TokenOutput):
                raise TypeError(f"server_manager.generate returned {type(output).__name__}, not a TokenOutput")
            calls.append({"prompt_ids": list(tokens), "token_ids": list(output.token_ids)})
            merge, mask, logprobs = await self.ct_merge_assistant_token(
                tokens, output.token_ids, mask, logprobs, assistant_logprobs=output.log_probs)
            tokens = merge.token_ids
            assistant_turns += 1
            answer = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
            if len(mask) >= self.response_length or user_turns >= rounds:
                break
            passage, overlap = retrieve(corpus, question + " " + answer, retrieved)
            previous = list(messages)
            messages.append({"role": "user", "content": corpus[passage]})
            merge, new_mask, new_logprobs = await self.ct_merge_context_msg(previous, messages, tokens, mask,
                                                                            logprobs)
            if len(new_mask) >= self.response_length:  # no room to answer after it: end without it
                messages.pop()
                break
            tokens, mask, logprobs = merge.token_ids, new_mask, new_logprobs
            retrieved.append(passage)
            turn_scores.append(float(overlap))
            user_turns += 1

        found = int(extra_info["gold"]) in retrieved
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=tokens[len(prompt_ids):], response_mask=mask,
            response_logprobs=logprobs, reward_score=float(found),
            num_turns=1 + assistant_turns + user_turns, metrics=metrics,
            extra_fields={"retrieved": retrieved, "turn_scores": turn_scores, "tool_call_counts": len(retrieved),
                          "calls": calls, "reward_extra_info": {"acc": float(found), "passages": len(retrieved)}})
