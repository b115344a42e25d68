"""Built-in rule scorers, dispatched on `data_source` (verl's `default_compute_score`).

A registry maps each data source to `fn(solution_str, ground_truth, extra_info) -> float`. An unknown data source
is an error rather than a silent 0: a misspelt `data_source` column would otherwise train on a constant reward.
"""

from __future__ import annotations

from typing import Any, Callable

from polyrl.data.synthetic import TASKS_BY_SOURCE
from polyrl.errors import RewardError
from polyrl.rewards import boxed, gsm8k

Scorer = Callable[[str, Any, "dict | None"], float]

RULE_SCORERS: dict[str, Scorer] = {"openai/gsm8k": lambda s, gt, extra: gsm8k.compute_score(s, gt)}
for _source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math"):
    RULE_SCORERS[_source] = lambda s, gt, extra: boxed.compute_score(s, gt)
for _source, _task in TASKS_BY_SOURCE.items():
    RULE_SCORERS[_source] = _task.score


def register_rule(data_source: str, fn: Scorer) -> None:
    RULE_SCORERS[data_source] = fn


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """Score one response with the built-in scorer for its data source: 1.0 correct, 0.0 not."""
    scorer = RULE_SCORERS.get(data_source)
    if scorer is None:
        raise RewardError(
            f"No built-in reward for data_source '{data_source}' (known: {', '.join(sorted(RULE_SCORERS))}); set "
            f"custom_reward_function.path (and .name) to a file defining your reward function."
        )
    return float(scorer(solution_str, ground_truth, extra_info))
