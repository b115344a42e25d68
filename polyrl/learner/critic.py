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
from polyrl.distributed.grads import clip_grad_norm_
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
    """The value model's passes. With several processes (`dp`, the data-parallel DistEnv) the model is FSDP2-sharded
    as the actor is: the loss is normalised by the mini-batch's token and sequence counts over all ranks and scaled
    by the rank count (FSDP averages gradients), so the update is one process's; ranks hold equal row counts
    (polyrl.distributed.data), so their fixed-size micro-batches pair up."""

    def __init__(self, model: ValueModel, optimizer, *, cliprange_value: float, loss_agg_mode: str, grad_clip: float,
                 ppo_epochs: int, mini_batch_size: int, micro_batch_size: int, dp=None):
        self.model, self.optimizer = model, optimizer
        self.cliprange_value, self.loss_agg_mode, self.grad_clip = cliprange_value, loss_agg_mode, grad_clip
        self.ppo_epochs, self.mini_batch_size, self.micro_batch_size = ppo_epochs, mini_batch_size, micro_batch_size
        self.dp = dp if dp is not None and dp.is_distributed else None
        self.params = [p for p in model.parameters() if p.requires_grad]

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
        scale = self.dp.world_size if self.dp is not None else 1
        totals = {"critic/vf_loss": 0.0, "critic/vf_clipfrac": 0.0}
        grad_norms = 0.0
        num_updates = 0
        for _ in range(self.ppo_epochs):
            for mini_rows in split_rows(B, self.mini_batch_size):
                mini = select(batch, mini_rows)
                num_tokens, num_seqs = self._global_counts(mini["response_mask"].sum(), mini["responses"].shape[0])
                self.optimizer.zero_grad(set_to_none=True)
                for rows in split_rows(mini["responses"].shape[0], self.micro_batch_size):
                    mb = trim_columns(select(mini, rows))
                    vpreds = self.model(mb)
                    loss, clipfrac = value_loss(vpreds, mb["returns"], mb["values"], mb["response_mask"],
                                                self.cliprange_value, self.loss_agg_mode, num_tokens=num_tokens,
                                                num_seqs=num_seqs)
                    (loss * scale).backward()
                    frac = mb["response_mask"].sum() / num_tokens.clamp_min(1)
                    totals["critic/vf_loss"] += loss.detach()
                    totals["critic/vf_clipfrac"] += clipfrac * frac
                grad_norm = clip_grad_norm_(self.params, self.grad_clip)  # plain or FSDP-sharded parameters
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                grad_norms += float(grad_norm)
                num_updates += 1
        keys = sorted(totals)  # each rank's share of the global losses: their sum is the job's
        summed = torch.stack([torch.as_tensor(totals[k], dtype=torch.float32).reshape(()) for k in keys])
        if self.dp is not None:
            summed = self.dp.all_reduce(summed.to(self._device))
        out = {k: float(v) / max(1, num_updates) for k, v in zip(keys, summed.tolist())}
        out["critic/grad_norm"] = grad_norms / max(1, num_updates)
        return out

    @property
    def _device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _global_counts(self, num_tokens: torch.Tensor, num_seqs: int):
        if self.dp is None:
            return num_tokens, num_seqs
        both = self.dp.all_reduce(torch.stack([num_tokens.float(), torch.tensor(float(num_seqs),
                                                                                device=num_tokens.device)]))
        return both[0], int(both[1])


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over valid tokens (verl's critic/vf_explained_var)."""
    var_ret = masked_mean((returns_BT - masked_mean(returns_BT, mask_BT)) ** 2, mask_BT)
    resid = returns_BT - values_BT
    var_res = masked_mean((resid - masked_mean(resid, mask_BT)) ** 2, mask_BT)
    return float(1.0 - var_res / (var_ret + 1e-8))
