"""Weight sync from the FSDP-sharded actor to each rank's rollout engine, one tensor at a time.

Each rank's engine holds a full replica (data-parallel rollout: every rank generates its own prompts), so every
rank needs every full weight. `full_tensors` yields `(hf_name, full_tensor)` pairs lazily: the all-gather of
parameter `i+1` starts only after the engine has copied parameter `i` in place, so the extra memory is one
parameter's full size, never a second copy of the model on any rank. All ranks must consume the stream in the same
order (it is a sequence of collectives); `PPOTrainer._weights_for_rollout` guarantees that by calling it everywhere.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The unsharded value of a DTensor (collective), or `t` itself for a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream HF-named full tensors out of (possibly sharded) ones; see the module docstring."""
    for name, t in named:
        yield name, full_tensor(t.detach())


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Every full weight on every rank (tests and small models only: this *is* a full copy)."""
    return {k: full_tensor(v.detach()).clone() for k, v in model.state_dict().items()}
