"""`guess_number`: a built-in interaction, a simulated user who thinks of a number and answers each guess
with "higher", "lower" or "correct". The smallest multi-turn task with real feedback: the model must use
the previous answers to narrow the range, which a single-turn policy cannot.

The sample's `extra_info.interaction_kwargs` carry the target: {"name": "guess_number", "target": 37}. A guess
is the last `<answer>N</answer>` of the latest assistant message. A correct guess ends the episode with turn
score 1.0; otherwise the turn scores 0.0 and the conversation goes on (the agent loop's turn limits end it).
"""

from __future__ import annotations

import re
from typing import Any

from pyrl.interactions.base import BaseInteraction

_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def parse_guess(text: str) -> int | None:
    """The integer in the last <answer>...</answer> of `text`, or None."""
    found = _ANSWER.findall(text)
    return int(found[-1]) if found else None


class GuessNumberInteraction(BaseInteraction):
    """Answers guesses of a hidden integer target; state per trajectory: the target, the guesses, solved."""

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, target: int | str | None = None,
                                **kwargs) -> str:
        try:
            if isinstance(target, bool) or isinstance(target, float) and not target.is_integer():
                # int() would take True or 3.7 silently (an integral float is fine: parquet columns may hold 37.0)
                raise TypeError
            target = int(target)
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}: interaction_kwargs.target: expected an integer, got {target!r}") from None
        instance_id = await super().start_interaction(instance_id)
        self._instance_dict[instance_id] = {"target": target, "guesses": 0, "solved": False}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        state = self._instance_dict[instance_id]
        content = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        guess = parse_guess(content if isinstance(content, str) else str(content))
        if guess is None:
            return False, "Please give your guess as <answer>N</answer>.", 0.0, {"guesses": state["guesses"]}
        state["guesses"] += 1
        if guess == state["target"]:
            state["solved"] = True
            return True, "correct", 1.0, {"guesses": state["guesses"]}
        return False, ("higher" if guess < state["target"] else "lower"), 0.0, {"guesses": state["guesses"]}

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        return 1.0 if self._instance_dict[instance_id]["solved"] else 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)
