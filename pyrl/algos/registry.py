"""Name -> function registries of the advantage estimators and the policy losses, each entry with what it needs.

An entry declares its needs where it is registered (`Needs`): the batch fields the trainer passes it, whether it
reads the per-sample non-tensor fields, whether it needs the old policy's log-probs before the update (so the
old-log-prob pass cannot be skipped), and a `check` of its settings that pyrl runs at start, before any worker,
so that a bad knob costs seconds instead of a model load and a rollout. The trainer passes what an entry asks for
and never branches on an algorithm's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Needs:
    tensors: tuple[str, ...] = ()  # batch fields passed by name; a missing one stops the step naming it
    optional_tensors: tuple[str, ...] = ()  # batch fields passed when the batch has them (else None is not passed)
    non_tensor_batch: bool = False  # the per-sample non-tensor fields (e.g. reward components), as non_tensor_batch
    old_log_probs_before_update: bool = False  # reads old_log_probs (or what their pass computes) before the update
    # check(section): the entry's settings in the config section it reads (algorithm for estimators, the actor for
    # losses); raises ValueError naming the key relative to the section
    check: Callable[[Any], None] | None = None
    # metrics(batch, section) -> {name: float}: what the entry reports after it ran (estimators)
    metrics: Callable[[Any, Any], dict] | None = None


# where a batch field an entry may need comes from, for the error when a step lacks it
FIELD_SOURCES = {
    "values": "the critic's values pass (critic.enable)",
    "reward_baselines": "ReMax's greedy rollout (algorithm.adv_estimator=remax)",
    "old_log_probs": "the old-log-prob pass",
    "sum_pi_squared": "the old-log-prob pass with actor_rollout_ref.actor.calculate_sum_pi_squared=true "
                      "(rollout_correction.bypass_mode skips that pass)",
    "rollout_is_weights": "algorithm.rollout_correction.rollout_is",
}

# what an entry registered without a declaration gets: verl 0.9.1's compute_advantage passes these to any estimator
# when the batch has them
VERL_OPTIONAL = Needs(optional_tensors=("values", "reward_baselines"))


class Registry:
    """register(name, needs=...) decorator, get(name) -> function, needs(name) -> Needs; `kind` names the things
    in error messages. `functions` is the name -> function table (verl's *_REGISTRY dicts)."""

    def __init__(self, kind: str, default_needs: Needs = Needs()):
        self.kind, self.default_needs = kind, default_needs
        self.functions: dict[str, Callable] = {}
        self._needs: dict[str, Needs] = {}

    def register(self, name: str, needs: Needs | None = None):
        def decorator(fn):
            if name in self.functions and self.functions[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered: {self.functions[name]}")
            self.functions[name] = fn
            self._needs[name] = needs if needs is not None else self.default_needs
            return fn

        return decorator

    def get(self, name: str) -> Callable:
        if name not in self.functions:
            raise ValueError(f"Unknown {self.kind} {name!r}; known: {', '.join(sorted(self.functions))}")
        return self.functions[name]

    def needs(self, name: str) -> Needs:
        self.get(name)
        return self._needs.get(name, self.default_needs)  # an entry put in `functions` directly: the default
