"""The value model for PPO with GAE: a causal LM body with a scalar head, trained with verl's clipped value loss.

Like verl, the critic is initialised from a causal LM checkpoint (`critic.model.path`, defaulting to the actor's):
the LM's body is kept and its vocabulary head replaced by a fresh `hidden -> 1` linear layer. Values are read at the
positions that predict each response token (the same columns as the actor's log-probs), so `values[:, t]` is V of
the state before response token t.
"""

from __future__ import annotations

import torch
from torch import nn

from polyrl.algorithms import value_loss
from polyrl.algorithms.masked import masked_mean
from polyrl.learner.batch import Batch, select, split_rows, trim_columns


class ValueModel(nn.Module):
    def __init__(self, causal_lm):
        super().__init__()
        self.body = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else causal_lm.model
        hidden = causal_lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)  # start at V=0: GAE then begins as plain discounted returns
        nn.init.zeros_(self.value_head.bias)

    def forward(self, mb: Batch) -> torch.Tensor:
        T = mb["responses"].shape[1]
        h = self.body(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                      position_ids=mb["position_ids"], use_cache=False).last_hidden_state
        return self.value_head(h[:, -T - 1:-1].float()).squeeze(-1)


class Critic:
    def __init__(self, model: ValueModel, optimizer, *, cliprange_value: float, loss_agg_mode: str, grad_clip: float,
                 ppo_epochs: int, mini_batch_size: int, micro_batch_size: int):
        self.model, self.optimizer = model, optimizer
        self.cliprange_value, self.loss_agg_mode, self.grad_clip = cliprange_value, loss_agg_mode, grad_clip
        self.ppo_epochs, self.mini_batch_size, self.micro_batch_size = ppo_epochs, mini_batch_size, micro_batch_size

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        B, T = batch["responses"].shape
        out = torch.zeros((B, T), device=batch["responses"].device)
        for rows in split_rows(B, self.micro_batch_size):
            mb = trim_columns(select(batch, rows))
            v = self.model(mb)
            out[rows, : v.shape[1]] = v
        return out * batch["response_mask"]

    def update(self, batch: Batch) -> dict[str, float]:
        self.model.train()
        B = batch["responses"].shape[0]
        totals = {"critic/vf_loss": 0.0, "critic/vf_clipfrac": 0.0, "critic/grad_norm": 0.0}
        num_updates = 0
        for _ in range(self.ppo_epochs):
            for mini_rows in split_rows(B, self.mini_batch_size):
                mini = select(batch, mini_rows)
                num_tokens, num_seqs = mini["response_mask"].sum(), mini["responses"].shape[0]
                self.optimizer.zero_grad(set_to_none=True)
                for rows in split_rows(num_seqs, self.micro_batch_size):
                    mb = trim_columns(select(mini, rows))
                    vpreds = self.model(mb)
                    loss, clipfrac = value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"],
                                                self.cliprange_value, self.loss_agg_mode, num_tokens=num_tokens,
                                                num_seqs=num_seqs)
                    loss.backward()
                    frac = float(mb["response_mask"].sum() / num_tokens.clamp_min(1))
                    totals["critic/vf_loss"] += float(loss.detach())
                    totals["critic/vf_clipfrac"] += float(clipfrac) * frac
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                totals["critic/grad_norm"] += float(grad_norm)
                num_updates += 1
        return {k: v / max(1, num_updates) for k, v in totals.items()}


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over valid tokens (verl's critic/vf_explained_var)."""
    var_ret = masked_mean((returns_BT - masked_mean(returns_BT, mask_BT)) ** 2, mask_BT)
    resid = returns_BT - values_BT
    var_res = masked_mean((resid - masked_mean(resid, mask_BT)) ** 2, mask_BT)
    return float(1.0 - var_res / (var_ret + 1e-8))
