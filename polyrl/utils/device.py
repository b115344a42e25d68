"""The device and dtype names users write in configs, resolved in one place for every trainer and engine."""

from __future__ import annotations

import torch

from polyrl.errors import ConfigError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def to_dtype(name: str, key: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"Config key '{key}' got dtype {name!r}; use one of float32, bfloat16, float16.")
    return DTYPES[name]


def pick_device(name: str, key: str = "trainer.device") -> torch.device:
    """`auto` is CUDA when a GPU is visible, else CPU; asking for CUDA without one is a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{key}={name} but no CUDA GPU is visible; use {key}=cpu or auto.")
    return torch.device(name)


def cpu_share(parts: int = 1) -> int:
    """This process's share of the host's usable cores when `parts` workers per process share them with the other
    processes of this host (torchrun's LOCAL_WORLD_SIZE): at least 1."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // (max(1, parts) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
