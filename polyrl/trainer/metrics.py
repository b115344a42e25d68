"""Step metrics under verl's names, computed from one step's batch (`compute_data_metrics` in verl)."""

from __future__ import annotations

import torch


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.float()
    return {f"{prefix}/mean": float(x.mean()), f"{prefix}/max": float(x.max()), f"{prefix}/min": float(x.min())}


def data_metrics(batch: dict, *, max_response_length: int, index: list) -> dict[str, float]:
    mask = batch["response_mask"].bool()
    m: dict[str, float] = {}
    seq_scores = batch["token_level_scores"].sum(-1)
    seq_rewards = batch["token_level_rewards"].sum(-1)
    m.update(_stats("critic/score", seq_scores))
    m.update(_stats("critic/rewards", seq_rewards))
    adv = batch["advantages"][mask]
    ret = batch["returns"][mask]
    if adv.numel():
        m.update(_stats("critic/advantages", adv))
        m.update(_stats("critic/returns", ret))
    if "values" in batch:
        m.update(_stats("critic/values", batch["values"][mask]))
    resp_len = batch["response_lengths"].float()
    prompt_len = batch["prompt_lengths"].float()
    m.update(_stats("response_length", resp_len))
    m["response_length/clip_ratio"] = float((resp_len >= max_response_length).float().mean())
    m.update(_stats("prompt_length", prompt_len))
    # GRPO health: fraction of prompt groups whose samples all got the same reward (no learning signal)
    groups: dict = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(float(seq_scores[i]))
    zero_std = [float(max(v) == min(v)) for v in groups.values() if len(v) > 1]
    if zero_std:
        m["critic/rewards/zero_std_ratio"] = sum(zero_std) / len(zero_std)
    return m


def rollout_logprob_gap(rollout_logp_BT: torch.Tensor, train_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                        with_kl: bool = False) -> dict[str, float]:
    """|p_rollout - p_train| per token: how far the engine's numbers are from the trainer's (verl's metric); with
    `with_kl` (MoE) also the mismatch KL E[log p_rollout - log p_train] as verl's `rollout_corr/kl`."""
    m = mask_BT.bool()
    diff = (rollout_logp_BT.exp() - train_logp_BT.exp()).abs()[m]
    if not diff.numel():
        return {}
    out = {"training/rollout_probs_diff_mean": float(diff.mean()), "training/rollout_probs_diff_max": float(diff.max())}
    if with_kl:
        out["rollout_corr/kl"] = float((rollout_logp_BT - train_logp_BT)[m].mean())
    return out
