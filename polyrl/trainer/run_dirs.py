"""Where a `polyrl train` run writes metrics.jsonl, config.yaml, env.json and report.html: one directory per run.

Two runs in one metrics.jsonl make a report that mixes them (issue 21: two "step 0" validations, 0.0 and 0.156).
- `trainer.run_dir` unset: a fresh run gets its own `runs/{project_name}/{experiment_name}/{YYYYmmdd-HHMMSS}` (with
  `-2`, `-3` ... when that second is taken). A run that resumes a checkpoint goes on in the directory of the run that
  wrote the checkpoint (recorded in its `extra.pt`), or in a fresh one when that is gone.
- `trainer.run_dir` set: used as given, but it must not hold another run's metrics.jsonl unless this run resumes.
- A resumed run appends to its own metrics.jsonl after dropping the rows past the checkpoint's step: the steps a
  crashed run logged after its last checkpoint are trained again, and each step keeps one row.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from polyrl.errors import ConfigError

METRICS = "metrics.jsonl"


def checkpoint_run(ckpt_dir: Path) -> tuple[str | None, int]:
    """(run directory that wrote it, its step) of a checkpoint folder; the directory is None for older checkpoints."""
    extra = torch.load(Path(ckpt_dir) / "extra.pt", map_location="cpu", weights_only=True)
    return extra.get("run_dir"), int(extra["global_step"])


def chosen_run_dir(explicit: str | None, resumed: tuple[str | None, int] | None) -> Path | None:
    """The directory this run must use, or None when it needs a fresh one (see `fresh_run_dir`)."""
    if explicit is not None:
        run = Path(explicit)
        if resumed is None and has_metrics(run):
            raise ConfigError(
                f"trainer.run_dir={explicit} already holds another run's {METRICS} and this run resumes no checkpoint; "
                "choose a new trainer.run_dir (or leave it unset: each run then gets its own timestamped folder), "
                "or delete that folder.")
        return run
    if resumed is not None and resumed[0] and Path(resumed[0]).is_dir():
        return Path(resumed[0])
    return None


def fresh_run_dir(root: Path) -> Path:
    """Creates and returns `root/<YYYYmmdd-HHMMSS>[-k]`, a folder no other run has (mkdir is the arbiter)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    for k in range(1, 10_000):
        run = root / (stamp if k == 1 else f"{stamp}-{k}")
        try:
            run.mkdir()
            return run
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory under {root} for {stamp}")


def has_metrics(run: Path) -> bool:
    path = run / METRICS
    return path.is_file() and path.stat().st_size > 0


def drop_rows_after(run: Path, step: int) -> int:
    """Removes metrics rows with a step past `step` (rewritten whole, then renamed); returns how many."""
    path = run / METRICS
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if _step(line) <= step]
    if len(kept) < len(lines):
        tmp = path.with_name(f".{METRICS}.tmp-{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return len(lines) - len(kept)


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):  # a torn last line of a killed run
        return 1 << 62
