"""BaseInteraction: a simulated user (or environment) that answers the model between assistant turns, with
the interface of verl 0.5-0.8's `verl.interactions.base` (verl 0.9.1 removed interactions; pyrl keeps them so
that multi-turn tasks with feedback, such as "try again" or "higher/lower", train with the same files).

The agent loop calls, per trajectory: start_interaction(request_id, **interaction_kwargs) with the sample's
`extra_info.interaction_kwargs` (which include the interaction's `name`), then after each assistant turn
generate_response(request_id, messages, **interaction_kwargs) -> (should_terminate_sequence, response_text,
turn_score, additional_data), the response becoming the next user message, and finally
finalize_interaction(request_id).
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4


class BaseInteraction:
    """An interaction: `name` (from the config, which the registry fills in) and the async lifecycle above.
    Subclasses keep per-trajectory state keyed by instance_id."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        """Starts a trajectory's interaction; returns its id (a fresh uuid when none is given)."""
        return str(uuid4()) if instance_id is None else instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        """The user's answer to the conversation so far: (should_terminate_sequence, response_text, turn score,
        additional data)."""
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs) -> float:
        """The trajectory's score from the interaction's state."""
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs) -> None:
        """Frees the trajectory's state."""
