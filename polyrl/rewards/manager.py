"""Reward manager: score a batch of responses with one reward function, and shape the scores.

It is verl's naive manager (plus the DAPO overlong penalty): one call per sample, in order. A reward function may
return a number, or a dict whose 'score' is the reward and whose other numeric keys are returned as extras for
logging (`reward_extra/<key>/mean`); non-numeric dict values (e.g. the parsed prediction) are not metrics and are
dropped. Anything that goes wrong inside the user's function is turned into one `RewardError` that names the
function, its file, the sample and its data source, because a bare traceback from a worker hides which sample broke.

Serial on purpose: the rule scorers take microseconds per sample (see tests), far below a rollout's cost, and a
thread pool cannot speed up Python-bound code. Slow user rewards (e.g. a sandbox call) are the case for a pool.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections import defaultdict
from typing import Any, Callable

import torch

from polyrl.algorithms.dapo import overlong_penalty
from polyrl.errors import RewardError
from polyrl.rewards.config import OverlongBufferConfig

Sample = tuple[str, str, Any, "dict | None"]  # (data_source, solution_str, ground_truth, extra_info)


def describe(fn: Callable) -> str:
    """'name' (file) of a function, for error messages."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    try:
        where = inspect.getsourcefile(fn) or "?"
    except TypeError:
        where = "?"
    return f"'{name}' ({where})"


def _as_float(value: Any) -> float | None:
    if isinstance(value, (str, bytes)) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):  # e.g. a tensor with more than one element
        return None


class RewardManager:
    def __init__(self, compute_score: Callable, *, overlong_buffer: OverlongBufferConfig | None = None,
                 max_response_length: int | None = None):
        self.compute_score = compute_score
        self.overlong = overlong_buffer if overlong_buffer is not None and overlong_buffer.enable else None
        self.max_response_length = max_response_length
        if self.overlong is not None:
            if max_response_length is None:
                raise ValueError("overlong_buffer needs max_response_length (data.max_response_length)")
            if not 0 < self.overlong.len <= max_response_length:
                raise RewardError(
                    f"reward_model.overlong_buffer.len={self.overlong.len} must be between 1 and "
                    f"data.max_response_length={max_response_length}; set it, e.g. to "
                    f"{max(1, max_response_length // 4)}."
                )

    def _fail(self, i: int, sample: Sample, what: str, fix: str = "fix the function or that sample") -> RewardError:
        return RewardError(
            f"Reward function {describe(self.compute_score)} {what} on sample {i} (data_source='{sample[0]}'); {fix}."
        )

    def _score_one(self, i: int, sample: Sample, kwargs: dict | None = None) -> tuple[float, dict[str, float]]:
        data_source, solution_str, ground_truth, extra_info = sample
        try:
            out = self.compute_score(data_source, solution_str, ground_truth, extra_info, **(kwargs or {}))
        except RewardError:
            raise  # already one clear sentence (e.g. an unknown data_source in the rule dispatcher)
        except Exception as e:
            raise self._fail(i, sample, f"raised {type(e).__name__}: {e}") from e
        extras = {}
        if isinstance(out, dict):
            if "score" not in out:
                raise self._fail(i, sample, f"returned a dict without a 'score' key (keys: {', '.join(map(str, out))})")
            extras = {k: v for k, v in ((k, _as_float(v)) for k, v in out.items() if k != "score") if v is not None}
            out = out["score"]
        score = _as_float(out)
        if score is None:
            raise self._fail(i, sample, f"returned {type(out).__name__} {out!r:.60}, not a number")
        if not math.isfinite(score):
            raise self._fail(i, sample, f"returned {score}")
        return score, extras

    def score(self, samples: list[Sample], response_lengths: list[int] | None = None,
              kwargs: list[dict] | None = None) -> tuple[list[float], dict[str, list[float]]]:
        """Per-sample rewards and per-key extras (each list aligned with `samples`); `kwargs[i]` are extra keyword
        arguments of sample i's call (a reward model's score: rewards/model_reward.py)."""
        scores, extras = [], defaultdict(list)
        keys = None
        for i, sample in enumerate(samples):
            s, ex = self._score_one(i, sample, kwargs[i] if kwargs is not None else None)
            if keys is None:
                keys = set(ex)
            elif set(ex) != keys:  # misaligned extras would be averaged over the wrong samples
                raise self._fail(i, sample, f"returned extra keys {sorted(ex)}, not sample 0's {sorted(keys)},",
                                 "return the same keys for every sample")
            scores.append(s)
            for k, v in ex.items():
                extras[k].append(v)
        if self.overlong is not None:
            if response_lengths is None or len(response_lengths) != len(samples):
                raise ValueError("overlong_buffer needs one response length per sample")
            penalties = overlong_penalty(torch.tensor(response_lengths), self.max_response_length, self.overlong.len,
                                         self.overlong.penalty_factor).tolist()
            scores = [s + p for s, p in zip(scores, penalties)]
            if self.overlong.log:
                extras["overlong_reward"] = penalties
                extras["overlong"] = [float(p < 0) for p in penalties]
        return scores, dict(extras)
