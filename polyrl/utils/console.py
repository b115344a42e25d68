"""What a run prints: one clean line per logged step, in a terminal and in a file alike.

A progress bar redraws itself with carriage returns. In a file (`polyrl train ... > log 2>&1`) those redraws land
inside the logger's lines, so `grep '^step'` misses steps. So bars are drawn only when their stream is a terminal,
transformers' own bars ("Loading weights", "Writing model shards") are switched off when stderr is not one, and
while a bar is drawn, log lines are written with the bar lifted off its line (`bar_lifted`).
"""

from __future__ import annotations

import contextlib
import sys


def is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def progress_bar(total: int, *, desc: str, initial: int = 0, enabled: bool = True):
    """A tqdm bar on stderr when it is a terminal, else None (a log file gets no carriage-return redraws)."""
    if not enabled or not is_terminal(sys.stderr):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=sys.stderr)


def bar_lifted(bar):
    """Context in which printed lines do not share the bar's line: the bar is cleared, then redrawn below them."""
    return bar.external_write_mode() if bar is not None else contextlib.nullcontext()


def quiet_library_bars() -> None:
    """transformers' and huggingface_hub's progress bars off unless stderr is a terminal."""
    if is_terminal(sys.stderr):
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
