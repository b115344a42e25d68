"""Validation metrics as verl computes them: per-prompt bootstrapped @N statistics, averaged over prompts.

For each data source and prompt (samples are grouped by their input text), and each numeric variable in
`infos` (e.g. `reward`, `acc`, anything a reward function returns), with n samples of that prompt:

- `mean@n`, `std@n` (population std; only `mean@1` when n == 1),
- for N in 2, 4, 8, ... < n, and n itself: 1000 bootstrap draws of N samples with replacement (seeded, so
  runs are comparable) give `best@N/{mean,std}` (max of each draw), `worst@N/{mean,std}` (min), and, when
  `infos` has a `pred` key (the extracted answer), `maj@N/{mean,std}`: the value of the first sample holding
  the draw's most frequent prediction (ties go to the prediction seen first in the draw).

Each metric is then averaged over the prompts of a data source. The main variable (`acc` when present, else
`reward`) goes under `val-core/<data_source>/<var>/` for the mean@N, best@N/* and maj@N/* of the largest N
(verl's rule: name starts with mean/best/maj, so best@N/std and maj@N/std are core too); everything else under
`val-aux/`. Draws use `np.random.RandomState(seed)`, which yields the same indices as
verl's `np.random.seed(seed); np.random.choice(...)` without touching numpy's global RNG.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

N_BOOTSTRAP = 1000


def bootstrap_ns(n: int) -> list[int]:
    """Subset sizes verl bootstraps for n samples: 2, 4, 8, ... below n, then n (none when n <= 1)."""
    if n <= 1:
        return []
    ns, k = [], 2
    while k < n:
        ns.append(k)
        k *= 2
    return ns + [n]


@lru_cache(maxsize=256)
def _draws(n_data: int, subset_size: int, seed: int) -> np.ndarray:
    # Same seed for every prompt (as verl), so the draws depend only on the sizes: compute them once.
    idx = np.random.RandomState(seed).choice(n_data, size=(N_BOOTSTRAP, subset_size), replace=True)
    idx.flags.writeable = False
    return idx


def _majority_values(vals: np.ndarray, preds: list, idx: np.ndarray) -> np.ndarray:
    """Per draw: the value of the first sample carrying the draw's most common prediction."""
    _, codes = np.unique(np.asarray(preds, dtype=object).astype(str), return_inverse=True)
    num_draws, n = idx.shape
    num_codes = int(codes.max()) + 1
    codes_DN = codes.reshape(-1)[idx]
    rows_D = np.arange(num_draws)
    # [draws, distinct predictions] tables; memory O(draws * n), never draws * n * distinct
    flat = (rows_D[:, None] * num_codes + codes_DN).ravel()
    counts_DK = np.bincount(flat, minlength=num_draws * num_codes).reshape(num_draws, num_codes)
    first_pos_DK = np.full((num_draws, num_codes), n, dtype=np.int64)
    for pos in range(n - 1, -1, -1):  # backwards, so the earliest position is written last
        first_pos_DK[rows_D, codes_DN[:, pos]] = pos
    # among the most frequent predictions, the one that appears first in the draw wins (python max() on a dict)
    is_top_DK = counts_DK == counts_DK.max(axis=1, keepdims=True)
    winner_pos_D = np.where(is_top_DK, first_pos_DK, n).min(axis=1)
    return vals[idx[np.arange(num_draws), winner_pos_D]]


def _prompt_metrics(vals: np.ndarray, preds: list | None, seed: int) -> dict[str, float]:
    n = len(vals)
    metric = {f"mean@{n}": float(np.mean(vals))}
    if n == 1:
        return metric
    metric[f"std@{n}"] = float(np.std(vals))
    for k in bootstrap_ns(n):
        idx = _draws(n, k, seed)
        best, worst = vals[idx].max(axis=1), vals[idx].min(axis=1)
        metric[f"best@{k}/mean"], metric[f"best@{k}/std"] = float(best.mean()), float(best.std())
        metric[f"worst@{k}/mean"], metric[f"worst@{k}/std"] = float(worst.mean()), float(worst.std())
        if preds is not None:
            maj = _majority_values(vals, preds, idx)
            metric[f"maj@{k}/mean"], metric[f"maj@{k}/std"] = float(maj.mean()), float(maj.std())
    return metric


def validation_metrics_by_source(
    data_sources: Sequence[str], sample_inputs: Sequence[str], infos: dict[str, list], seed: int = 42
) -> dict[str, dict[str, dict[str, float]]]:
    """{data_source: {var: {metric: value averaged over prompts}}} (verl's `process_validation_metrics`)."""
    for key, vals in infos.items():
        if len(vals) != len(data_sources):
            raise ValueError(f"infos[{key!r}] has {len(vals)} values but there are {len(data_sources)} samples")
    grouped = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # source -> prompt -> var -> values
    for i, source in enumerate(data_sources):
        for var, vals in infos.items():
            grouped[str(source)][sample_inputs[i]][var].append(vals[i])

    per_prompt = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))  # source -> var -> metric -> values
    for source, prompts in grouped.items():
        for var2vals in prompts.values():
            preds = var2vals.get("pred")
            for var, vals in var2vals.items():
                if not vals or isinstance(vals[0], str):  # text fields such as `pred` carry no statistic
                    continue
                for name, value in _prompt_metrics(np.asarray(vals, dtype=np.float64), preds, seed).items():
                    per_prompt[source][var][name].append(value)
    return {
        source: {var: {name: float(np.mean(v)) for name, v in metrics.items()} for var, metrics in var2metrics.items()}
        for source, var2metrics in per_prompt.items()
    }


def _n_of(metric_name: str) -> int:
    return int(metric_name.split("@")[-1].split("/")[0])


def process_validation_metrics(
    data_sources: Sequence[str], sample_inputs: Sequence[str], infos: dict[str, list], seed: int = 42
) -> dict[str, float]:
    """Flat `val-core/...` and `val-aux/...` metrics, split as verl's trainer does."""
    out: dict[str, float] = {}
    for source, var2metrics in validation_metrics_by_source(data_sources, sample_inputs, infos, seed).items():
        core_var = "acc" if "acc" in var2metrics else "reward"
        for var, metrics in var2metrics.items():
            n_max = max(_n_of(name) for name in metrics)
            for name, value in metrics.items():
                # verl tests `f"@{n_max}" in name`, which also matches e.g. @16 when n_max is 1; compare N exactly
                is_core = var == core_var and name.startswith(("mean", "maj", "best")) and _n_of(name) == n_max
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{var}/{name}"] = value
    return out
