"""Interactions from configuration (verl 0.5-0.8's `verl.interactions.utils.interaction_registry`): the YAML
that the rollout's `multi_turn.interaction_config_path` names.

    interaction:
      - name: guess_number                                   # optional: from the class name without "Interaction"
        class_name: pyrl.interactions.guess_number.GuessNumberInteraction
        config: {}                                           # handed to the class as `config`, plus its `name`

A sample picks its interaction by `extra_info.interaction_kwargs.name`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from pyrl.usercode import load_object

if TYPE_CHECKING:
    from pyrl.interactions.base import BaseInteraction


def default_interaction_name(cls_name: str) -> str:
    """verl's name for an unnamed entry: the class name, lower-cased, without an "Interaction" suffix."""
    simple = cls_name.rsplit(".", 1)[-1]
    return (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def initialize_interactions_from_config(interaction_config_file: str) -> dict[str, BaseInteraction]:
    """{name: interaction instance} for the entries of the YAML file; a repeated name raises."""
    interaction_config = OmegaConf.load(interaction_config_file)
    entries = interaction_config.get("interaction") if isinstance(interaction_config, DictConfig) else None
    if entries is None:
        raise ValueError(f"{interaction_config_file}: expected a top-level `interaction:` list")
    interaction_map = {}
    for index, entry in enumerate(entries):
        cls_name = entry.get("class_name")
        if not cls_name:
            raise ValueError(f"{interaction_config_file}: interaction[{index}]: expected `class_name` (a dotted path "
                             f"to a BaseInteraction subclass)")
        config = entry.get("config")
        config = {} if config is None else OmegaConf.to_container(config, resolve=True)
        name = entry.get("name") or default_interaction_name(cls_name)
        if name in interaction_map:
            raise ValueError(f"{interaction_config_file}: interaction[{index}]: duplicate interaction name {name!r}; "
                             f"each interaction must have a unique name")
        config["name"] = name
        interaction_map[name] = load_object(cls_name, "class_name")(config=config)
    return interaction_map
