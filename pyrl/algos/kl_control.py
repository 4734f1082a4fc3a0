"""KL-in-reward coefficient controllers (verl's algorithm.kl_ctrl): r_t = score_t - beta * kl_t."""

from __future__ import annotations

import numpy as np


class FixedKLController:
    """beta stays kl_coef."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al.: e = clip(kl / target - 1, -0.2, 0.2); beta <- beta (1 + e n_steps / horizon)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        super().__init__(init_kl_coef)
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl: target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.target, self.horizon = float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon


KL_CONTROLLERS = ("fixed", "adaptive")  # algorithm.kl_ctrl.type


def get_kl_controller(kl_ctrl) -> FixedKLController:
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_ctrl.kl_coef)
    if kl_ctrl.type == "adaptive":
        return AdaptiveKLController(kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
    raise ValueError(f"algorithm.kl_ctrl.type: expected one of {KL_CONTROLLERS}, got {kl_ctrl.type!r}")
