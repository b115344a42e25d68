"""Rewards: built-in rule scorers dispatched on data_source, custom reward files, and the reward manager."""

from polyrl.rewards.config import CustomRewardConfig, OverlongBufferConfig
from polyrl.rewards.custom import load_custom_reward
from polyrl.rewards.manager import RewardManager
from polyrl.rewards.rule import default_compute_score, register_rule


def build_reward_fn(custom: CustomRewardConfig | None):
    """The custom function when custom_reward_function.path is set, else the built-in rule dispatcher."""
    if custom is not None and custom.path:
        return load_custom_reward(custom.path, custom.name)
    return default_compute_score


__all__ = ["CustomRewardConfig", "OverlongBufferConfig", "RewardManager", "build_reward_fn",
           "default_compute_score", "load_custom_reward", "register_rule"]
