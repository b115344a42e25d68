"""Masked reductions over [batch, response tokens] tensors, with verl's numerics.

Padding positions never contribute: values there are replaced by 0 before summing (so a NaN in padding cannot
leak in), and `masked_mean` adds 1e-8 to the count so an all-padding micro-batch gives 0, not NaN.
`masked_var` is Bessel-corrected by default, as verl's `masked_whiten` uses it.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is nonzero (over `dim`, or over everything)."""
    valid = torch.where(mask.bool(), values, torch.zeros_like(values))
    valid = valid * mask
    return valid.sum() if dim is None else valid.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is nonzero; 0 (not NaN) when the mask is empty."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked values (scalar); unbiased needs at least two valid entries."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        # No check for count < 2 here: it would cost a host sync per call. Callers whiten whole batches,
        # which always hold more than one valid token.
        var = var * count / (count - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with masked, unbiased statistics (verl's `masked_whiten`)."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def whiten_over(all_reduce):
    """`masked_whiten` with the statistics of a batch split over processes: `all_reduce(t)` sums a tensor over them
    (`DistEnv.all_reduce`). Each process whitens its rows with the whole batch's mean and unbiased variance, so the
    result is one process's `masked_whiten` of the concatenated batch."""

    def whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
        total, count = all_reduce(torch.stack([masked_sum(values, mask), mask.sum().to(values.dtype)]))
        mean = total / (count + 1e-8)
        var = all_reduce(masked_sum((values - mean) ** 2, mask)) / (count + 1e-8) * count / (count - 1)
        whitened = (values - mean) * torch.rsqrt(var + 1e-8)
        return whitened if shift_mean else whitened + mean

    return whiten
