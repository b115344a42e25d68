"""Token sampling on the device, with no host sync: temperature, top-k, top-p, a seeded generator.

The returned logprob is log_softmax(logits / temperature) of the chosen token (temperature 1 when greedy), taken
before top-k/top-p filtering: that is what the trainer recomputes from the same logits, so the two can be compared
(`training/rollout_probs_diff_mean`). Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which
draws exactly from p with one random tensor and no cumulative sums.
"""

from __future__ import annotations

import torch


def sample(
    logits_RV: torch.Tensor,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (token ids [R] int64, logprobs [R] float32)."""
    logits = logits_RV.float()
    if temperature == 0.0:
        tok = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)
    logits = logits / temperature
    logp = torch.log_softmax(logits, -1)
    filtered = logits
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(filtered, dim=-1, descending=True)
        probs_sorted = torch.softmax(sorted_logits, -1)
        mass_before = probs_sorted.cumsum(-1) - probs_sorted  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, idx, sorted_logits)
    if filtered is logits:  # no filtering: p is exp(logp) already
        probs = logp.exp()
    else:
        probs = torch.softmax(filtered, -1)
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-20)  # 0/0 would be NaN
    tok = (probs / race).argmax(-1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)
