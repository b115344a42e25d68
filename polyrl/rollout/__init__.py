"""Text-generation backends behind one interface (`polyrl.rollout.base.RolloutEngine`), chosen by name.

Each backend module registers a builder in `ROLLOUT_BACKENDS` (`register_rollout`) when it is imported; the
registry is the only dispatch, so a new backend is one decorated function and no edit here.
"""

from __future__ import annotations

import importlib

import torch

from polyrl.errors import ConfigError
from polyrl.rollout.base import ROLLOUT_BACKENDS, Generation, RolloutEngine, SamplingParams, register_rollout

BUILTIN_BACKENDS = ("polyrl.rollout.hf", "polyrl.rollout.native")  # imported on first use: each registers itself


def rollout_backends() -> dict:
    """The registry, with the built-in backends loaded."""
    for module in BUILTIN_BACKENDS:
        importlib.import_module(module)
    return ROLLOUT_BACKENDS


def make_rollout(cfg, model, *, pad_token_id: int, device: torch.device, max_model_len: int, **extra) -> RolloutEngine:
    """Build the engine named by `actor_rollout_ref.rollout.name` around the actor's weights. `extra`: what only
    some backends take (the native engine's `tp` group)."""
    backends = rollout_backends()
    if cfg.name not in backends:
        raise ConfigError(f"actor_rollout_ref.rollout.name={cfg.name!r} is not a registered rollout backend; use one "
                          f"of {sorted(backends)}.")
    return backends[cfg.name](cfg, model, pad_token_id=pad_token_id, device=device, max_model_len=max_model_len,
                             **extra)


__all__ = ["ROLLOUT_BACKENDS", "Generation", "RolloutEngine", "SamplingParams", "make_rollout", "register_rollout",
           "rollout_backends"]
