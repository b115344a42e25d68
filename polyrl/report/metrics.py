"""Reads `metrics.jsonl` as written by the `file` logger, tolerating what real runs leave behind.

- A crashed or still-running run may end in a half-written line: it is skipped and counted.
- A resumed run logs some steps twice: the later row wins, key by key (it is the one the weights continue from).
- `null` means the logged value was NaN or inf: it becomes NaN here, and `non_finite` lists where it happened.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Metrics:
    rows: dict[int, dict[str, float]] = field(default_factory=dict)
    """step -> {metric: value}."""
    bad_lines: int = 0
    """Lines that were not a JSON object with an integer step (e.g. a half-written last line)."""
    non_finite: dict[str, list[int]] = field(default_factory=dict)
    """metric -> steps where it was NaN or inf."""

    @property
    def steps(self) -> list[int]:
        return sorted(self.rows)

    @property
    def keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for step in self.steps:
            seen.update(dict.fromkeys(self.rows[step]))
        return list(seen)

    def has(self, key: str) -> bool:
        return any(key in row for row in self.rows.values())

    def match(self, pattern: str) -> list[str]:
        """Metric names matching a glob such as `val-core/*`, in first-logged order."""
        return [k for k in self.keys if fnmatch.fnmatchcase(k, pattern)]

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) where `key` was logged; values NaN where it was non-finite."""
        pairs = [(s, self.rows[s][key]) for s in self.steps if key in self.rows[s]]
        steps = np.array([p[0] for p in pairs], dtype=float)
        return steps, np.array([p[1] for p in pairs], dtype=float)

    def last(self, key: str) -> float | None:
        _, values = self.series(key)
        finite = values[np.isfinite(values)]
        return float(finite[-1]) if len(finite) else None


def load_metrics(path: str) -> Metrics:
    m = Metrics()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step = int(row.pop("step"))
            except (ValueError, KeyError, TypeError, AttributeError):
                m.bad_lines += 1
                continue
            out = m.rows.setdefault(step, {})
            for key, value in row.items():
                if value is None or (isinstance(value, float) and not math.isfinite(value)):
                    m.non_finite.setdefault(key, []).append(step)
                    out[key] = math.nan
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[key] = float(value)
    return m
