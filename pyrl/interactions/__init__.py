"""Interactions: simulated users that answer the model between assistant turns during multi-turn rollout,
with verl 0.5-0.8's interface (BaseInteraction, initialize_interactions_from_config), and the built-in
`guess_number` interaction. Like pyrl.tools, this package knows nothing of Ray or the trainer.
"""

from pyrl.interactions.base import BaseInteraction
from pyrl.interactions.registry import initialize_interactions_from_config

__all__ = ["BaseInteraction", "initialize_interactions_from_config"]
