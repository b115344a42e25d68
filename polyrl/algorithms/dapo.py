"""DAPO's two data-side tricks: the overlong soft penalty and dynamic sampling (group filtering).

- Overlong penalty (verl's `dapo` reward manager, `overlong_buffer_cfg.{len, penalty_factor}`): with
  L_max = max_response_length and a buffer of b tokens, a response of length L gets
  min(0, -(L - (L_max - b)) / b * penalty_factor): 0 up to L_max - b, then linearly down to -penalty_factor at L_max.
  Lengths are capped at L_max, so the penalty never exceeds penalty_factor (verl's formula is the same for
  every length the rollout can produce).
- Dynamic sampling (`algorithm.filter_groups`): keep only prompt groups whose metric (e.g. `seq_final_reward`,
  `acc`) varies within the group; a group where every sample agrees has zero GRPO advantage and no gradient.
  "Varies" is tested as max > min rather than verl's np.std > 0, which float rounding can make positive for
  identical values (e.g. three 0.1s). Groups of one sample are kept, as verl does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from polyrl.errors import ConfigError


def overlong_penalty(
    response_lengths_B: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float,
) -> torch.Tensor:
    """Per-response penalty (<= 0, float) to add to the reward; 0 before the last `overlong_buffer_len` tokens."""
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ConfigError(
            f"overlong_buffer_cfg.len={overlong_buffer_len} must be in (0, data.max_response_length="
            f"{max_response_length}]; DAPO uses 4096 of 20480."
        )
    lengths_B = torch.as_tensor(response_lengths_B).float().clamp(max=max_response_length)
    exceed_B = lengths_B - (max_response_length - overlong_buffer_len)
    return torch.clamp(-exceed_B / overlong_buffer_len * penalty_factor, max=0.0)


def select_groups(
    metric_values_B: torch.Tensor | Sequence[float] | np.ndarray,
    index: Sequence | np.ndarray,
    keep_singletons: bool = True,
) -> tuple[list, torch.Tensor]:
    """Group ids (first-seen order) whose metric is not constant within the group, and the [B] bool row mask."""
    values_B = np.asarray(
        metric_values_B.detach().cpu().numpy() if torch.is_tensor(metric_values_B) else metric_values_B,
        dtype=np.float64,
    )
    ids = list(index)
    if len(ids) != len(values_B):
        raise ValueError(f"index has {len(ids)} entries but metric_values_B has {len(values_B)}")
    group_vals: dict = {}
    for gid, v in zip(ids, values_B):
        group_vals.setdefault(gid, []).append(v)
    kept = [
        gid
        for gid, vals in group_vals.items()
        if max(vals) > min(vals) or (keep_singletons and len(vals) == 1)
    ]
    kept_set = set(kept)
    row_mask_B = torch.tensor([gid in kept_set for gid in ids], dtype=torch.bool)
    return kept, row_mask_B
