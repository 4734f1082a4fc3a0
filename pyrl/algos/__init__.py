"""pyrl.algos: registries of advantage estimators and policy losses, thin functions over pyrl.ops."""

from pyrl.algos.advantage import ADV_ESTIMATOR_REGISTRY, get_adv_estimator_fn, register_adv_est
from pyrl.algos.kl_control import AdaptiveKLController, FixedKLController, get_kl_controller
from pyrl.algos.policy_loss import POLICY_LOSS_REGISTRY, get_policy_loss_fn, register_policy_loss

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "AdaptiveKLController",
    "FixedKLController",
    "POLICY_LOSS_REGISTRY",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "register_adv_est",
    "register_policy_loss",
]
