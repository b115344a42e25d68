"""Token log-probs and entropy from hidden states, without materialising `[tokens, vocab]` fp32 logits.

A 151k-vocab model turns 16k tokens into 9.7 GB of fp32 logits, plus as much again for log-softmax and the gradient.
Here the LM head runs on `chunk_size` rows at a time; each chunk keeps only `logsumexp`, the target logit and the
entropy (three numbers per token), and with `checkpoint=True` its backward recomputes the chunk's logits instead of
saving them. Peak extra memory is one `[chunk, vocab]` block. Only positions that predict a response token are fed to
the head (prompt positions need no logits at all).

    logp(y)  = z_y / tau - logsumexp(z / tau)
    entropy  = logsumexp(z / tau) - sum_v softmax(z / tau)_v * z_v / tau
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint as _checkpoint


def _chunk(hidden_MD, weight_VD, bias_V, targets_M, temperature: float, with_entropy: bool):
    logits = torch.nn.functional.linear(hidden_MD, weight_VD, bias_V).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets_M.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logp, None
    ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, ent


def chunked_logprobs(hidden_MD: torch.Tensor, weight_VD: torch.Tensor, targets_M: torch.Tensor, *,
                     bias_V: torch.Tensor | None = None, temperature: float = 1.0, with_entropy: bool = False,
                     chunk_size: int = 2048, checkpoint: bool = True):
    """Per-row log-prob of `targets_M` (and entropy) under `softmax(hidden @ W.T + b) / temperature`, chunked.

    Returns (logp_M, ent_M or None), fp32. Equal to the naive full-logits computation up to fp32 summation order.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1; use e.g. 2048 rows per LM-head chunk.")
    M = hidden_MD.shape[0]
    need_ckpt = checkpoint and torch.is_grad_enabled() and (hidden_MD.requires_grad or weight_VD.requires_grad)
    logps, ents = [], []
    for start in range(0, M, chunk_size):
        h = hidden_MD[start:start + chunk_size]
        y = targets_M[start:start + chunk_size]
        if need_ckpt:
            lp, ent = _checkpoint(_chunk, h, weight_VD, bias_V, y, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk(h, weight_VD, bias_V, y, temperature, with_entropy)
        logps.append(lp)
        if ent is not None:
            ents.append(ent)
    if M == 0:
        empty = hidden_MD.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def naive_logprobs(hidden_MD, weight_VD, targets_M, *, bias_V=None, temperature: float = 1.0,
                   with_entropy: bool = False):
    """The reference: full fp32 logits, log_softmax, gather (what `chunked_logprobs` must equal)."""
    logits = torch.nn.functional.linear(hidden_MD, weight_VD, bias_V).float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets_M.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, ent
