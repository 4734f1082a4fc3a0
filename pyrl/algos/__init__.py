"""pyrl.algos: registries of advantage estimators and policy losses, thin functions over pyrl.ops."""

from pyrl.algos.advantage import ADV_ESTIMATOR_REGISTRY, ESTIMATORS, get_adv_estimator_fn, register_adv_est
from pyrl.algos.kl_control import AdaptiveKLController, FixedKLController, get_kl_controller
from pyrl.algos.policy_loss import POLICY_LOSS_REGISTRY, POLICY_LOSSES, get_policy_loss_fn, register_policy_loss
from pyrl.algos.registry import Needs

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "AdaptiveKLController",
    "ESTIMATORS",
    "FixedKLController",
    "Needs",
    "POLICY_LOSSES",
    "POLICY_LOSS_REGISTRY",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "register_adv_est",
    "register_policy_loss",
]
