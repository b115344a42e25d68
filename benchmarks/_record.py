"""Append one measurement row to BENCHMARKS.md (DESIGN.md's table format; rows are only ever appended)."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

HEADER = ("| date | device | benchmark | shape / config | polyrl | peer (name: value) | limit | polyrl/peer | "
          "polyrl/limit | commit |\n|---|---|---|---|---|---|---|---|---|---|\n")


def commit() -> str:
    """The measured code's commit: $POLYRL_COMMIT when set (a copied tree whose .git is stale or missing: pass the
    commit the copy was made from), else HEAD, marked `+changes` when tracked files differ from it (the device
    machine's copy once reported an older HEAD for newer code)."""
    import os

    if os.environ.get("POLYRL_COMMIT"):
        return os.environ["POLYRL_COMMIT"]
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,  # noqa: E731
                                    cwd=Path(__file__).parent).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD") or "-"
        return head + ("+changes" if head != "-" and git("status", "--porcelain", "--untracked-files=no") else "")
    except OSError:
        return "-"


def append_row(device: str, benchmark: str, shape: str, polyrl: str, peer: str = "-", limit: str = "-",
               ratio_peer: str = "-", ratio_limit: str = "-", path: str | Path | None = None) -> str:
    path = Path(path or Path(__file__).resolve().parent.parent / "BENCHMARKS.md")
    if not path.exists() or not path.read_text().strip():
        path.write_text("# Benchmarks\n\nOne row per measurement, newest last; numbers come from the scripts in "
                        "`benchmarks/`.\n\n" + HEADER)
    row = (f"| {datetime.date.today().isoformat()} | {device} | {benchmark} | {shape} | {polyrl} | {peer} | {limit} "
           f"| {ratio_peer} | {ratio_limit} | {commit()} |\n")
    with open(path, "a") as f:
        f.write(row)
    return row
