"""The policy training engine: log-probs, the PPO update, and weights for the rollout engine.

It owns the model, optimizer and LR schedule; the loss math comes from `polyrl.algorithms` (pure functions). Loss
normalisers are computed per *mini-batch* and passed down to every micro-batch, so gradient accumulation gives the
same update whatever the micro-batch size (tested: 1x8 == 8x1).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from polyrl.algorithms import agg_loss, entropy_from_logits, kl_penalty, policy_loss
from polyrl.algorithms.losses import PolicyLossConfig as LossKnobs
from polyrl.training.batch import Batch, select, split_rows, trim_columns


def response_logits(model, mb: Batch, temperature: float) -> torch.Tensor:
    T = mb["responses"].shape[1]
    out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"],
                use_cache=False)
    logits = out.logits[:, -T - 1:-1].float()
    return logits / temperature if temperature not in (0.0, 1.0) else logits


def logprobs_and_entropy(model, mb: Batch, temperature: float, with_entropy: bool):
    logits_BTV = response_logits(model, mb, temperature)
    logp_BTV = torch.log_softmax(logits_BTV, dim=-1)
    logp_BT = logp_BTV.gather(-1, mb["responses"].unsqueeze(-1)).squeeze(-1)
    ent_BT = entropy_from_logits(logits_BTV) if with_entropy else None
    return logp_BT, ent_BT


@torch.no_grad()
def compute_logprobs(model, batch: Batch, *, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """Per-token log-probs of the responses, [B, T], in micro-batches of `micro_batch_size` rows."""
    was_training = model.training
    model.eval()
    B, T = batch["responses"].shape
    out = torch.zeros((B, T), device=batch["responses"].device)
    for rows in split_rows(B, micro_batch_size):
        mb = trim_columns(select(batch, rows))
        logp, _ = logprobs_and_entropy(model, mb, temperature, with_entropy=False)
        out[rows, : logp.shape[1]] = logp
    model.train(was_training)
    return out


def make_scheduler(optimizer, *, total_steps: int, warmup_steps: int, kind: str, min_lr_ratio: float,
                   num_cycles: float):
    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        cos = 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * min(progress, 1.0)))
        return min_lr_ratio + (1.0 - min_lr_ratio) * cos

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class UpdateSettings:
    """What one `update` needs from the config, resolved to sequence counts."""

    mini_batch_size: int  # sequences per optimizer step
    micro_batch_size: int  # sequences per forward/backward
    ppo_epochs: int
    temperature: float
    loss_mode: str
    loss_agg_mode: str
    knobs: LossKnobs
    grad_clip: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    shuffle: bool = False
    calculate_entropy: bool = True
    old_from_current: bool = False  # on-policy single pass: old log-probs are the current ones (no extra pass)


class Actor:
    def __init__(self, model, optimizer, scheduler):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.params = [p for p in model.parameters() if p.requires_grad]

    def update(self, batch: Batch, s: UpdateSettings, generator: torch.Generator | None = None) -> dict[str, float]:
        self.model.train()
        B, T = batch["responses"].shape
        if s.knobs.loss_scale_factor is None:  # fix the seq-mean-token-sum-norm divisor before columns get trimmed
            s = dataclasses.replace(s, knobs=dataclasses.replace(s.knobs, loss_scale_factor=float(T)))
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        skipped = 0

        def add(key, value, weight=1.0):
            sums[key] = sums.get(key, 0.0) + value.detach().float() * weight
            counts[key] = counts.get(key, 0) + weight

        for _ in range(s.ppo_epochs):
            order = torch.randperm(B, generator=generator) if s.shuffle else torch.arange(B)
            for mini_rows in split_rows(B, s.mini_batch_size):
                mini = select(batch, order[mini_rows].to(batch["responses"].device))
                num_tokens = mini["response_mask"].sum()
                num_seqs = mini["responses"].shape[0]
                self.optimizer.zero_grad(set_to_none=True)
                for rows in split_rows(num_seqs, s.micro_batch_size):
                    mb = trim_columns(select(mini, rows))
                    frac = mb["response_mask"].sum() / num_tokens.clamp_min(1)
                    need_entropy = s.entropy_coeff != 0 or s.calculate_entropy
                    logp, ent = logprobs_and_entropy(self.model, mb, s.temperature, need_entropy)
                    mask = mb["response_mask"]
                    old = logp.detach() if s.old_from_current else mb["old_log_probs"]
                    pg_loss, pg_metrics = policy_loss(
                        s.loss_mode, old_log_prob_BT=old, log_prob_BT=logp, advantages_BT=mb["advantages"],
                        response_mask_BT=mask, loss_agg_mode=s.loss_agg_mode, cfg=s.knobs,
                        num_tokens=num_tokens, num_seqs=num_seqs)
                    loss = pg_loss
                    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=s.knobs.loss_scale_factor)
                    if ent is not None:
                        ent_loss = agg_loss(ent, mask, s.loss_agg_mode, **agg)
                        add("actor/entropy", ent_loss)
                        if s.entropy_coeff != 0:
                            loss = loss - s.entropy_coeff * ent_loss
                    if s.use_kl_loss:
                        kl = kl_penalty(s.kl_loss_type, logp, mb["ref_log_probs"])
                        kl_loss = agg_loss(kl, mask, s.loss_agg_mode, **agg)
                        loss = loss + s.kl_loss_coef * kl_loss
                        add("actor/kl_loss", kl_loss)
                        add("actor/kl_coef", torch.tensor(s.kl_loss_coef), 0.0)
                    loss.backward()
                    add("actor/pg_loss", pg_loss)
                    for k, v in pg_metrics.items():
                        add(k, v, frac)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, s.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                else:  # a NaN/Inf update would poison the weights: skip it, keep the weights, count it
                    skipped += 1
                    self.optimizer.zero_grad(set_to_none=True)
                add("actor/grad_norm", grad_norm)
                counts["_mini"] = counts.get("_mini", 0) + 1
        self.scheduler.step()
        num_mini = counts.pop("_mini")
        metrics = {}
        for k, v in sums.items():
            if k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
                metrics[k] = float(v) / num_mini  # these were summed over micro-batches of a mini-batch
            elif k == "actor/grad_norm":
                metrics[k] = float(v) / num_mini
            elif counts[k]:
                metrics[k] = float(v) / counts[k]
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["actor/nonfinite_skipped"] = skipped
        return metrics
