"""Gradient-norm clipping over a mix of FSDP-sharded (DTensor) and replicated (plain) parameters.

torch's `clip_grad_norm_` refuses a mix of DTensor and plain gradients, and `parallelize` produces exactly that
(sharded blocks, replicated embeddings/LM head). The total norm is sqrt(|sharded|^2 + |replicated|^2): the sharded
part is reduced over ranks by DTensor, the replicated part is already identical on every rank.
"""

from __future__ import annotations

import torch


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor")


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """Clip in place; returns the total norm before clipping as a plain tensor (same value on every rank)."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if _is_dtensor(g)]
    if not sharded:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)  # one process: torch's own, bit for bit
    plain = [g for g in grads if not _is_dtensor(g)]
    total_sq = torch.nn.utils.get_total_norm(sharded).full_tensor().float() ** 2
    if plain:
        total_sq = total_sq + torch.nn.utils.get_total_norm(plain).float().to(total_sq.device) ** 2
    total = total_sq.sqrt()
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    if coef < 1.0 and torch.isfinite(total):
        for g in grads:
            g.mul_(coef)
    return total
