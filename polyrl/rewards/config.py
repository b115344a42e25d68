"""Reward config groups with verl's key names: `custom_reward_function.*` and `reward_model.*` (legacy layout).

The trainer's config tree mounts these; the keys are the ones verl's DAPO recipe and examples use
(`custom_reward_function.path`, `reward_model.overlong_buffer.len`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CustomRewardConfig:
    path: str | None = None
    """Python file defining the reward function; null uses the built-in rule scorers (dispatch on data_source)."""
    name: str = "compute_score"
    """Function in that file: fn(data_source, solution_str, ground_truth, extra_info) -> float | dict with 'score'."""


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO's soft overlong penalty: responses longer than max_response_length - len lose reward linearly."""
    len: int = 0
    """Width of the penalty zone in tokens, ending at data.max_response_length."""
    penalty_factor: float = 1.0
    """Penalty at max_response_length; it grows linearly from 0 at the start of the zone."""
    log: bool = False
    """Log the penalty (reward_extra/overlong_reward) and the overlong fraction (reward_extra/overlong)."""
