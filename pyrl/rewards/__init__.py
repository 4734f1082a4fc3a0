"""pyrl.rewards: rule-based scorers keyed by data_source (verl's default_compute_score) and the reward
managers that turn a rollout batch into token-level scores."""

from pyrl.rewards.managers import RewardManager, load_reward_manager
from pyrl.rewards.scorers import default_compute_score

__all__ = ["RewardManager", "default_compute_score", "load_reward_manager"]
