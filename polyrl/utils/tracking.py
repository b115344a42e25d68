"""Metric loggers: one `Tracker` fans each step's metrics out to the backends named in `trainer.logger`.

Backends live in a name->class registry (`LOGGERS`), like verl's `verl/utils/tracking.py`:
- `console`: one compact line per step, starting `step N` (rich when installed, never wrapped), with the few metrics a
  person watches;
- `file`: `<run_dir>/metrics.jsonl`, one JSON object per step, flushed every step so a crashed run keeps its
  metrics; `polyrl report` reads only this file. Non-finite values are written as `null` (strict JSON), so a key
  present with `null` means the value was NaN or inf;
- `tensorboard`: `SummaryWriter` into `<run_dir>/tensorboard`;
- `wandb`: offline unless the user set `WANDB_MODE` themselves (our machines have no network).

Values may be Python numbers, numpy scalars or 1-element tensors: they are converted once per `log` call, with
one device->host copy per device rather than one `.item()` sync per metric.
Images (`log_images`) are saved as a PNG grid under `<run_dir>/samples/step_<N>.png`, which the report shows.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from typing import Any, Sequence

import numpy as np
import torch

from polyrl.errors import ConfigError

# Metrics the console line shows, in order, with a short label; the rest stay in metrics.jsonl.
_CONSOLE_KEYS = [
    ("critic/score/mean", "score"),
    ("critic/rewards/mean", "reward"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/ppo_kl", "kl"),
    ("actor/entropy", "ent"),
    ("actor/grad_norm", "gnorm"),
    ("response_length/mean", "len"),
    ("critic/rewards/zero_std_ratio", "zero_std"),
    ("perf/throughput", "tok/s/gpu"),
    ("perf/mfu/actor", "mfu"),
    ("timing_s/step", "s/step"),
]


def to_floats(metrics: dict[str, Any]) -> dict[str, float]:
    """Converts metric values to Python floats, batching tensors per device into one host copy."""
    out: dict[str, float] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"metric {key!r} is a tensor of shape {tuple(value.shape)}; log a scalar (e.g. .mean()) instead"
                )
            by_device[value.device].append((key, value.detach().reshape(())))
        elif isinstance(value, (bool, int, float, np.number)) or (isinstance(value, np.ndarray) and value.size == 1):
            out[key] = float(value)
        else:
            raise ValueError(f"metric {key!r} has value {value!r} of type {type(value).__name__}; log a number")
    for items in by_device.values():
        values = torch.stack([v.float() for _, v in items]).tolist()
        out.update((k, float(v)) for (k, _), v in zip(items, values))
    return out


def _fmt(value: float) -> str:
    return f"{value:.4g}"


class ConsoleLogger:
    """One compact line per step; rich colours it when rich is installed."""

    def __init__(self, run_dir: str, project_name: str, experiment_name: str, config: dict):
        try:
            from rich.console import Console

            self._console = Console(highlight=False)
        except ImportError:
            self._console = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        shown = [(label, metrics[key]) for key, label in _CONSOLE_KEYS if key in metrics]
        shown += [(k.split("/", 1)[1], v) for k, v in metrics.items() if k.startswith("val-core/")]
        if not shown:  # e.g. SFT: show whatever comes first
            shown = list(metrics.items())[:6]
        more = len(metrics) - len(shown)
        if self._console is not None:
            parts = " ".join(f"[dim]{label}[/dim] {_fmt(v)}" for label, v in shown)
            tail = f" [dim]+{more} more[/dim]" if more > 0 else ""
            # soft_wrap: one line per step however long (rich would cut it at 80 columns in a file)
            self._console.print(f"[bold cyan]step {step}[/bold cyan] {parts}{tail}", soft_wrap=True)
        else:
            parts = " ".join(f"{label}={_fmt(v)}" for label, v in shown)
            print(f"step {step} {parts}" + (f" (+{more} more)" if more > 0 else ""), flush=True)

    def log_images(self, tag: str, path: str, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class FileLogger:
    """Appends `{"step": N, ...metrics}` to `<run_dir>/metrics.jsonl`, flushed each step."""

    def __init__(self, run_dir: str, project_name: str, experiment_name: str, config: dict):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._f = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def log_images(self, tag: str, path: str, step: int) -> None:
        pass

    def close(self) -> None:
        self._f.close()


class TensorboardLogger:
    """Scalars (and image grids) into `<run_dir>/tensorboard`; the config goes in as a text summary."""

    def __init__(self, run_dir: str, project_name: str, experiment_name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=os.path.join(run_dir, "tensorboard"))
        if config:
            text = json.dumps(config, indent=2, default=str)
            self._writer.add_text("config", f"```\n{text}\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()  # a crashed run keeps its curves

    def log_images(self, tag: str, path: str, step: int) -> None:
        from PIL import Image

        self._writer.add_image(tag, np.asarray(Image.open(path).convert("RGB")), step, dataformats="HWC")
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """Weights & Biases, offline by default (`wandb sync <run_dir>/wandb/offline-run-*` uploads it later)."""

    def __init__(self, run_dir: str, project_name: str, experiment_name: str, config: dict):
        import wandb

        self._wandb = wandb
        self._run = wandb.init(
            project=project_name,
            name=experiment_name,
            config=config,
            dir=run_dir,
            mode=os.environ.get("WANDB_MODE", "offline"),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_images(self, tag: str, path: str, step: int) -> None:
        self._run.log({tag: self._wandb.Image(path)}, step=step)

    def close(self) -> None:
        self._run.finish()


# name -> (class, module that must be importable)
LOGGERS: dict[str, tuple[type, str | None]] = {
    "console": (ConsoleLogger, None),
    "file": (FileLogger, None),
    "tensorboard": (TensorboardLogger, "tensorboard"),
    "wandb": (WandbLogger, "wandb"),
}

# pip package that provides each optional module
_PIP_NAME = {"tensorboard": "tensorboard", "wandb": "wandb"}


def _check_logger(name: str) -> None:
    import importlib.util

    if name not in LOGGERS:
        raise ConfigError(
            f"trainer.logger contains {name!r}, which polyrl does not support; use any of {sorted(LOGGERS)}, "
            f"e.g. trainer.logger=[console,file]"
        )
    module = LOGGERS[name][1]
    if module is not None and importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"trainer.logger contains {name!r} but the {module} package is not installed; "
            f"run `pip install {_PIP_NAME[module]}` or remove {name!r} from trainer.logger"
        )


def image_grid(images: Sequence[Any], pad: int = 2) -> "PIL.Image.Image":  # noqa: F821
    """Tiles PIL images or uint8 HWC/HW arrays (or tensors) into one RGB image, about square, white gaps."""
    from PIL import Image

    if len(images) == 0:
        raise ValueError("log_images got an empty list of images; pass at least one")
    tiles = []
    for i, img in enumerate(images):
        if isinstance(img, torch.Tensor):
            img = img.detach().cpu().numpy()
        if isinstance(img, np.ndarray):
            if img.dtype != np.uint8:
                raise ValueError(
                    f"image {i} has dtype {img.dtype}; pass uint8 arrays, e.g. (x.clip(0, 1) * 255).astype(np.uint8)"
                )
            img = Image.fromarray(img)
        if not isinstance(img, Image.Image):
            raise ValueError(f"image {i} is a {type(img).__name__}; pass PIL images or uint8 HWC arrays")
        tiles.append(img.convert("RGB"))
    w, h = tiles[0].size
    cols = math.ceil(math.sqrt(len(tiles)))
    rows = math.ceil(len(tiles) / cols)
    grid = Image.new("RGB", (cols * w + (cols - 1) * pad, rows * h + (rows - 1) * pad), "white")
    for i, tile in enumerate(tiles):
        if tile.size != (w, h):
            tile = tile.resize((w, h))
        grid.paste(tile, ((i % cols) * (w + pad), (i // cols) * (h + pad)))
    return grid


class Tracker:
    """Logs one step's metrics to every backend in `loggers` (verl's `trainer.logger`)."""

    def __init__(
        self,
        loggers: list[str] | str,
        run_dir: str,
        *,
        project_name: str,
        experiment_name: str,
        config: dict,
    ):
        names = [loggers] if isinstance(loggers, str) else list(loggers)
        for name in names:  # check all before creating any, so a typo leaves no half-made run dir
            _check_logger(name)
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self._backends = [
            LOGGERS[name][0](run_dir, project_name, experiment_name, config) for name in dict.fromkeys(names)
        ]
        self._image_paths: set[str] = set()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        values = to_floats(metrics)
        for backend in self._backends:
            backend.log(values, step)

    def log_images(self, tag: str, images: Sequence[Any], step: int) -> str:
        """Saves a PNG grid at `<run_dir>/samples/step_<N>.png` (`step_<N>_<tag>.png` for a second tag)."""
        samples = os.path.join(self.run_dir, "samples")
        os.makedirs(samples, exist_ok=True)
        path = os.path.join(samples, f"step_{step}.png")
        if path in self._image_paths:
            path = os.path.join(samples, f"step_{step}_{re.sub(r'[^A-Za-z0-9_.-]+', '-', tag)}.png")
        from PIL import PngImagePlugin

        info = PngImagePlugin.PngInfo()
        info.add_text("polyrl_tag", tag)
        image_grid(images).save(path, pnginfo=info)
        self._image_paths.add(path)
        for backend in self._backends:
            backend.log_images(tag, path, step)
        return path

    def close(self) -> None:
        for backend in self._backends:
            backend.close()
        self._backends = []

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
