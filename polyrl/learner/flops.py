"""Training FLOPs of a dense decoder-only transformer and MFU, by verl's `flops_counter` convention.

    FLOPs = 6 * N * tokens + 12 * L * H * head_dim * sum(seqlen^2)

N counts the matmul weights a token passes through: per layer q/k/v/o projections and the 3 MLP matrices, plus the
LM head. verl also counts the embedding table as a matmul (`vocab * hidden * 2`); we do not (a lookup is no FLOPs),
which gives a lower, honest MFU. The attention term is verl's/PaLM's: it counts the full (non-causal) score matrix
forward and backward, so causal kernels doing half of it are still credited with all of it, as in every published
MFU we compare to. The LM head may run on fewer tokens than the trunk (we only need logits at response positions):
pass `lm_head_tokens`. Peak is dense bf16 without sparsity: 989 TFLOP/s on H100/H200 (verl, torchtitan).
"""

from __future__ import annotations

import torch

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "H20": 148e12, "A100": 312e12, "A800": 312e12,
                   "L40S": 362e12, "B200": 2250e12}


def _get(cfg, name, default=None):
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def is_sparse_layer(cfg, layer: int) -> bool:
    """Whether decoder layer `layer` of an HF MoE config (qwen3_moe, qwen2_moe) routes to experts."""
    experts = _get(cfg, "num_experts") or 0
    return experts > 0 and layer not in (_get(cfg, "mlp_only_layers") or []) and \
        (layer + 1) % (_get(cfg, "decoder_sparse_step") or 1) == 0


def mlp_active_intermediate(cfg, layer: int) -> int:
    """The MLP width one token passes through in `layer`: the dense intermediate, or top_k routed experts' widths
    plus a shared expert's (qwen2_moe) in an MoE layer."""
    if not is_sparse_layer(cfg, layer):
        return _get(cfg, "intermediate_size")
    width = _get(cfg, "moe_intermediate_size") or _get(cfg, "intermediate_size")  # Mixtral: experts are that wide
    return _get(cfg, "num_experts_per_tok") * width + \
        (_get(cfg, "shared_expert_intermediate_size") or 0)


def matmul_params(cfg) -> tuple[int, int]:
    """(per-token trunk matmul weights over all layers, LM-head weights) of an HF Llama/Qwen2-style config; for an
    MoE config the weights a token passes through (its top_k experts and the router: the *active* parameters)."""
    h, L = _get(cfg, "hidden_size"), _get(cfg, "num_hidden_layers")
    heads, kv = _get(cfg, "num_attention_heads"), _get(cfg, "num_key_value_heads") or _get(cfg, "num_attention_heads")
    hd = _get(cfg, "head_dim") or h // heads
    vocab = _get(cfg, "vocab_size")
    attn = h * (heads * hd + 2 * kv * hd) + heads * hd * h
    mlp = 0
    for layer in range(L):
        mlp += 3 * h * mlp_active_intermediate(cfg, layer)
        if is_sparse_layer(cfg, layer):  # the router, and a shared expert's scalar gate
            mlp += h * _get(cfg, "num_experts") + (h if _get(cfg, "shared_expert_intermediate_size") else 0)
    return L * attn + mlp, vocab * h


def training_flops(cfg, seqlens: list[int], lm_head_tokens: int | None = None, attn_pairs: int | None = None) -> float:
    """FLOPs of one forward+backward over sequences of `seqlens` tokens (no recomputation counted). `attn_pairs`
    replaces `sum(seqlen^2)` when the attention is not one square per sequence (shared prompts: packing.py)."""
    trunk, head = matmul_params(cfg)
    tokens = sum(seqlens)
    head_tokens = tokens if lm_head_tokens is None else lm_head_tokens
    h, L, heads = _get(cfg, "hidden_size"), _get(cfg, "num_hidden_layers"), _get(cfg, "num_attention_heads")
    hd = _get(cfg, "head_dim") or h // heads
    attn = 12 * L * heads * hd * (sum(s * s for s in seqlens) if attn_pairs is None else attn_pairs)
    return 6.0 * (trunk * tokens + head * head_tokens) + attn


def peak_flops(device: torch.device | str | None = None) -> float:
    """Dense bf16 peak of the current GPU by name (989e12 for H100/H200); 0.0 when unknown or on CPU."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return 0.0
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    return 0.0


def mfu(flops: float, seconds: float, *, num_gpus: int = 1, peak: float | None = None) -> float:
    """Model FLOPs utilisation: achieved FLOP/s per GPU over the peak (0.0 when the peak is unknown)."""
    peak = peak_flops() if peak is None else peak
    if peak <= 0 or seconds <= 0:
        return 0.0
    return flops / seconds / num_gpus / peak
