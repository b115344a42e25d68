"""Token sampling shared by the rollout backends: temperature, top-k, top-p, on device, no host syncs.

Log-probs are taken from the full tempered distribution `log_softmax(logits / T)` (T = 1 for greedy), which is
exactly what the trainer recomputes; top-k/top-p only restrict which token is drawn (as vLLM reports them).
"""

from __future__ import annotations

import torch


def sample_tokens(logits_BV: torch.Tensor, *, temperature: float, top_k: int = -1, top_p: float = 1.0,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    logits_BV = logits_BV.float()
    if temperature == 0.0:
        tokens_B = logits_BV.argmax(dim=-1)
        logp_BV = torch.log_softmax(logits_BV, dim=-1)
        return tokens_B, logp_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
    scaled_BV = logits_BV / temperature
    logp_BV = torch.log_softmax(scaled_BV, dim=-1)
    masked_BV = scaled_BV
    if top_k is not None and 0 < top_k < scaled_BV.shape[-1]:
        kth_B1 = torch.topk(scaled_BV, top_k, dim=-1).values[:, -1:]
        masked_BV = masked_BV.masked_fill(masked_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, idx_BV = torch.sort(masked_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_BV = (probs_BV.cumsum(-1) - probs_BV) >= top_p
        sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
        masked_BV = torch.full_like(masked_BV, float("-inf")).scatter(-1, idx_BV, sorted_BV)
    probs_BV = torch.softmax(masked_BV, dim=-1)
    tokens_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
    return tokens_B, logp_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
