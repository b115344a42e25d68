"""Crash-safe checkpoints in verl's layout: `<root>/global_step_N/` plus `<root>/latest_checkpointed_iteration.txt`.

A checkpoint is written into `global_step_N.tmp-<pid>/`, every file is fsynced, the folder is renamed to
`global_step_N` (atomic on POSIX) and only then is the "latest" file replaced (again write-then-rename). A crash at
any point leaves either the previous checkpoint or the new one, never a half-written one that gets loaded: folders
with a `.tmp-` suffix are ignored and cleaned up. Tensors go to safetensors; everything else (optimizer state, RNG,
data position) goes through `torch.save` and is read back with `weights_only=True`, so loading never runs pickle code.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from polyrl.errors import UserError

LATEST = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_tensor_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def _write_atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class CheckpointManager:
    """Saves and finds checkpoints under `root`; keeps at most `max_to_keep` (None: all)."""

    def __init__(self, root: str | Path, max_to_keep: int | None = None):
        self.root = Path(root)
        self.max_to_keep = max_to_keep

    def save(self, step: int, state: dict[str, Any], writers: dict[str, Callable[[Path], None]] | None = None) -> Path:
        """Write `state` (name -> tensor dict or plain object) and run `writers` (name -> fn(dir)) atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"global_step_{step}"
        tmp = self.root / f"global_step_{step}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, obj in state.items():
            if _is_tensor_dict(obj):
                # safetensors refuses aliased storage (tied embeddings): store independent contiguous copies
                save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in obj.items()},
                          str(tmp / f"{name}.safetensors"))
            else:
                torch.save(obj, tmp / f"{name}.pt")
        for name, write in (writers or {}).items():
            (tmp / name).mkdir(parents=True, exist_ok=True)
            write(tmp / name)
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
            old = self.root / f"global_step_{step}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(self.root)
        _write_atomic_text(self.root / LATEST, str(step))
        self._prune()
        return final

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())

    def latest_step(self) -> int | None:
        """The step named in the latest file if that folder is complete, else the newest complete folder."""
        steps = self.steps()
        latest = self.root / LATEST
        if latest.is_file():
            try:
                step = int(latest.read_text().strip())
                if step in steps:
                    return step
            except ValueError:
                pass
        return steps[-1] if steps else None

    def load(self, step_or_path: int | str | Path) -> dict[str, Any]:
        path = self.root / f"global_step_{step_or_path}" if isinstance(step_or_path, int) else Path(step_or_path)
        if not path.is_dir():
            raise UserError(f"Checkpoint folder '{path}' does not exist; check trainer.resume_from_path.")
        out: dict[str, Any] = {}
        for f in sorted(path.iterdir()):
            if f.suffix == ".safetensors":
                out[f.stem] = load_file(str(f))
            elif f.suffix == ".pt":
                out[f.stem] = torch.load(f, map_location="cpu", weights_only=True)
        out["_path"] = path
        return out

    def _prune(self) -> None:
        for p in self.root.iterdir():  # leftovers of crashed saves
            if ".tmp-" in p.name or ".old-" in p.name:
                if not p.name.endswith(f"-{os.getpid()}"):
                    shutil.rmtree(p, ignore_errors=True)
        if self.max_to_keep and self.max_to_keep > 0:
            for step in self.steps()[: -self.max_to_keep]:
                shutil.rmtree(self.root / f"global_step_{step}", ignore_errors=True)


def rng_state() -> dict[str, Any]:
    import random

    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    numpy_state = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(_tuplify(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x
