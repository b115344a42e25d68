"""The native engine's own decoder: Qwen2 / Qwen2.5 / Qwen3 / Llama, and Qwen2-MoE / Qwen3-MoE (moe.py), in one small
module.

Same math as the HF modules (RMSNorm in fp32 then cast, RoPE tables cast to the activation dtype, residual adds in the
activation dtype), so greedy decoding matches HF token for token in fp32 and logprobs stay close in bf16. What differs
is the layout: q/k/v are one `qkv` matmul and gate/up one `gate_up` matmul (fewer, larger GEMMs per decode step), and
attention reads a paged KV cache through `attention.py` instead of a per-call dense cache.

The module knows nothing about scheduling: it maps (flat token ids, positions, AttnMeta) to hidden states.
`load_hf_weights` is the one place that knows HF parameter names; `from_hf` and `update_weights` both use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from polyrl.rollout.native.attention import FUSED_ROPE, AttnMeta, paged_attention, write_kv
from polyrl.rollout.native.moe import (MOE_MODEL_TYPES, PER_EXPERT_NAME, MoE, fused_names_covered, is_moe_layer,
                                      moe_hf_targets)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama") + MOE_MODEL_TYPES
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModel(ValueError):
    """The native engine cannot run this model (an architecture or feature it lacks); the `hf` backend may
    (engine.py's `build_native_rollout` falls back to it). `reason` is the fact alone, for that log line."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}; the native engine runs model_type in {SUPPORTED_MODEL_TYPES}; use "
                         "actor_rollout_ref.rollout.name=hf for this model.")
        self.reason = reason


@dataclass
class ModelSpec:
    """The shape facts the engine needs, read from an HF config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    # MoE (moe.py); num_experts == 0: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0: none
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is sparse

    @classmethod
    def from_hf_config(cls, cfg) -> "ModelSpec":
        mt = getattr(cfg, "model_type", None)
        if mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"rollout.name=native has no decoder for model_type={mt!r}")
        if getattr(cfg, "use_sliding_window", False) or any(
            t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])
        ):
            raise UnsupportedModel(f"rollout.name=native has no sliding-window attention (model_type={mt!r} with "
                                   "sliding window layers)")
        if getattr(cfg, "mlp_bias", False):
            raise UnsupportedModel(f"rollout.name=native has no MLP bias (model_type={mt!r})")
        if mt != "qwen2" and getattr(cfg, "attention_bias", False):  # o_proj has a bias too there
            raise UnsupportedModel(f"rollout.name=native has no attention output bias (model_type={mt!r} with "
                                   "attention_bias=True)")
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"rollout.name=native supports hidden_act='silu', got {act!r}")
        heads = cfg.num_attention_heads
        moe = {}
        if mt in MOE_MODEL_TYPES:
            moe = dict(num_experts=getattr(cfg, "num_experts", None) or cfg.num_local_experts,
                       num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
                       shared_expert_intermediate_size=getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
                       norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)),
                       moe_layers=tuple(i for i in range(cfg.num_hidden_layers) if is_moe_layer(cfg, i)))
        return cls(
            model_type=mt,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            qkv_bias=True if mt == "qwen2" else bool(getattr(cfg, "qkv_bias", True)) if mt == "qwen2_moe" else
            bool(getattr(cfg, "attention_bias", False)),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            max_position_embeddings=cfg.max_position_embeddings,
            **moe,
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def apply_rope(x_THD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    half = x_THD.shape[-1] // 2
    rot = torch.cat((-x_THD[..., half:], x_THD[..., :half]), dim=-1)
    return x_THD * cos_TD[:, None, :] + rot * sin_TD[:, None, :]


class Attention(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = s.num_heads, s.num_kv_heads, s.head_dim
        self.q_size, self.kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.qkv = nn.Linear(s.hidden_size, self.q_size + 2 * self.kv_size, bias=s.qkv_bias)
        self.o = nn.Linear(self.q_size, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps) if s.qk_norm else None
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, kv_heads, head_dim], set by the engine
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None  # FP8 KV only: [num_blocks, block_size, kv_heads] fp32
        self.v_scale: torch.Tensor | None = None

    def forward(self, x_TD, cos, sin, meta: AttnMeta):
        T = x_TD.shape[0]
        q, k, v = self.qkv(x_TD).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        write_kv(self.k_cache, self.v_cache, k, v, meta.slot_mapping, self.k_scale, self.v_scale)
        o = paged_attention(q, self.k_cache, self.v_cache, meta, self.head_dim**-0.5, self.k_scale, self.v_scale)
        return self.o(o.reshape(T, self.q_size))

    def forward_fused(self, x_TD, positions_T, cos_table, sin_table, meta: AttnMeta):
        from polyrl.rollout.native.fused import rope_kv

        T = x_TD.shape[0]
        qn, kn = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        if meta.use_kernel and meta.decode_kernel == "v2" and FUSED_ROPE:  # rope_kv's work inside the decode launch
            from polyrl.rollout.native.paged_decode_v2 import paged_decode_rope

            o = paged_decode_rope(self.qkv(x_TD), positions_T, cos_table, sin_table, self.k_cache, self.v_cache, meta,
                                  self.head_dim**-0.5, self.num_heads, self.k_scale, self.v_scale, qn, kn, eps)
            return self.o(o.reshape(T, self.q_size))
        q = rope_kv(self.qkv(x_TD), positions_T, cos_table, sin_table, self.k_cache, self.v_cache, meta.slot_mapping,
                    self.num_heads, self.num_kv_heads, self.head_dim, qn, kn, eps, self.k_scale, self.v_scale)
        o = paged_attention(q, self.k_cache, self.v_cache, meta, self.head_dim**-0.5, self.k_scale, self.v_scale)
        return self.o(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.inter = s.intermediate_size
        self.gate_up = nn.Linear(s.hidden_size, 2 * s.intermediate_size, bias=False)
        self.down = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, s: ModelSpec, index: int = 0):
        super().__init__()
        self.ln1 = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.attn = Attention(s)
        self.ln2 = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MoE(s) if index in s.moe_layers else MLP(s)

    def forward(self, x, cos, sin, meta):
        x = x + self.attn(self.ln1(x), cos, sin, meta)
        h = self.ln2(x)
        return x + (self.mlp(h, meta.slot_mapping) if isinstance(self.mlp, MoE) else self.mlp(h))


# bf16 down projections run as split-K over K slices (`sliced_linear`, one batched cuBLAS call; the next
# add_rmsnorm sums the partials): weight (N, K) -> (rows from, rows to, slices), where measured to win. H100, cold
# weights (`seed_workloads.py --gemms --gemm-bmm-splits`): the 1.5B down, 4 slices, 12.9 / 13.3 / 15.5 us at 64 / 128
# / 256 rows against cuBLAS's 15.9 / 17.2 / 18.6 (other row counts, most prefill chunks among them: not measured,
# so plain). An empty table is the plain GEMM everywhere (tests/test_native_rollout_gpu.py compares the two).
SLICED_DOWN = {(1536, 8960): (64, 256, 4)}


def sliced_down_parts(down: nn.Module, rows: int) -> int:
    """How many K slices the fused decode path splits this down projection into at `rows` rows (1: a plain GEMM)."""
    if type(down) is not nn.Linear or down.bias is not None or not down.weight.is_cuda:
        return 1
    lo, hi, parts = SLICED_DOWN.get(tuple(down.weight.shape), (0, 0, 1))
    return parts if lo <= rows <= hi else 1


def down_partials(down: nn.Module, rows: int):
    """How the fused decode path splits this down projection at `rows` rows: (f(down, act) -> [P, T, N] partial
    products that the next add_rmsnorm sums, or None for one GEMM; and the columns of each split for silu_mul to
    scale its FP8 output by, or None for one scale per row). f: bf16 K slices in one batched cuBLAS call
    (SLICED_DOWN), or the FP8 split-K kernel's partials (`fp8_linear.PARTIALS`)."""
    from polyrl.rollout.native.fp8_linear import partials_config, partials_slice

    parts, config = sliced_down_parts(down, rows), partials_config(down, rows)
    if parts > 1:
        return (lambda d, act: sliced_linear(act, d.weight, parts)), None
    if config is not None:
        return (lambda d, act: d.partials(act, config)), partials_slice(down, rows, config)
    return None, None


def sliced_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x W^T as `parts` partial products over slices of K, [parts, T, N], in one batched cuBLAS call on strided views
    (no copies); `fused.add_rmsnorm` sums them. A split-K for the GEMMs whose K is long and N narrow (a 1.5B model's
    down projection), where cuBLAS's single GEMM leaves SMs idle."""
    T, K = x.shape
    return torch.bmm(x.view(T, parts, K // parts).transpose(0, 1), weight.view(-1, parts, K // parts).permute(1, 2, 0))


class CausalLM(nn.Module):
    """Decoder + LM head. RoPE cos/sin are full fp32 tables indexed by position (HF's values), set by `set_rope`."""

    def __init__(self, s: ModelSpec):
        super().__init__()
        self.spec = s
        self.embed = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Block(s, i) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = None if s.tie_word_embeddings else nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.rope_cos = self.rope_sin = None
        self.fused = False  # CUDA: fused Triton elementwise kernels (fused.py); same math, ~4x fewer kernels
        self.split_down = True  # the fused path may hand down's partial products to the next add_rmsnorm

    def set_rope(self, inv_freq: torch.Tensor, attention_scaling: float, max_len: int, device) -> None:
        # inv_freq comes from the HF module, so llama3/linear scaling is already folded in
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq.float().cpu()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rope_cos = (emb.cos() * attention_scaling).to(device)
        self.rope_sin = (emb.sin() * attention_scaling).to(device)

    def forward(self, input_ids_T: torch.Tensor, positions_T: torch.Tensor, meta: AttnMeta) -> torch.Tensor:
        x = self.embed(input_ids_T)
        if self.fused:
            return self._forward_fused(x, positions_T, meta)
        cos = self.rope_cos[positions_T].to(x.dtype)
        sin = self.rope_sin[positions_T].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta)
        return self.norm(x)

    def _forward_fused(self, x, positions_T, meta):
        from polyrl.rollout.native.fp8_linear import takes_fp8_rows
        from polyrl.rollout.native.fused import add_rmsnorm, silu_mul

        # FP8 GEMMs whose input the producing kernel quantises (the same choice for every layer: same shapes)
        first, rows = self.layers[0], x.shape[0]
        dense = next((layer.mlp for layer in self.layers if isinstance(layer.mlp, MLP)), None)
        fp8_qkv = takes_fp8_rows(first.attn.qkv, rows)
        fp8_gate_up, fp8_down = (dense is not None and takes_fp8_rows(getattr(dense, name), rows)
                                 for name in ("gate_up", "down"))
        split_down, act_slice = (down_partials(dense.down, rows) if dense is not None and self.split_down
                                 else (None, None))
        residual = None
        for layer in self.layers:
            h, residual = add_rmsnorm(x, residual, layer.ln1.weight, layer.ln1.eps, fp8=fp8_qkv)
            x = layer.attn.forward_fused(h, positions_T, self.rope_cos, self.rope_sin, meta)
            if isinstance(layer.mlp, MoE):
                h, residual = add_rmsnorm(x, residual, layer.ln2.weight, layer.ln2.eps)
                x = layer.mlp(h, meta.slot_mapping)
                continue
            h, residual = add_rmsnorm(x, residual, layer.ln2.weight, layer.ln2.eps, fp8=fp8_gate_up)
            act = silu_mul(layer.mlp.gate_up(h), fp8=fp8_down, slice_cols=act_slice)
            # the next add_rmsnorm sums split partials (residual is set from the first layer on)
            x = split_down(layer.mlp.down, act) if split_down else layer.mlp.down(act)
        return add_rmsnorm(x, residual, self.norm.weight, self.norm.eps)[0]

    def logits(self, hidden_SD: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied to the embedding
            return nn.functional.linear(hidden_SD, self.embed.weight)
        return self.lm_head(hidden_SD)  # nn.Linear, or FP8Linear (engine_kwargs.native.fp8_lm_head; tied: a copy)


def _hf_targets(model: CausalLM) -> dict[str, tuple[torch.Tensor, int, int, nn.Module | None]]:
    """HF parameter name -> (our tensor, row start, row end, FP8 owner) so fused layouts take q/k/v and gate/up in
    place; the owner is set where the tensor is an FP8Linear's e4m3 weight (rows are quantised on the way in)."""
    s = model.spec
    out: dict[str, tuple[torch.Tensor, int, int, nn.Module | None]] = {}

    def whole(name, t):
        out[name] = (t, 0, t.shape[0], None)

    def rows(name, module, kind, lo, hi):
        t = getattr(module, kind)
        owner = module if kind == "weight" and hasattr(module, "load_rows") else None
        out[name] = (t, lo, hi, owner)

    whole("model.embed_tokens.weight", model.embed.weight)
    whole("model.norm.weight", model.norm.weight)
    if not s.tie_word_embeddings:
        rows("lm_head.weight", model.lm_head, "weight", 0, s.vocab_size)
    else:  # tied: HF state dicts may still list lm_head.weight; it is the embedding
        whole("lm_head.weight", model.embed.weight)
    qs, kvs, inter, hid = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size, s.hidden_size
    for i, blk in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = blk.attn
        for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
            rows(p + f"self_attn.q_proj.{kind}", a.qkv, kind, 0, qs)
            rows(p + f"self_attn.k_proj.{kind}", a.qkv, kind, qs, qs + kvs)
            rows(p + f"self_attn.v_proj.{kind}", a.qkv, kind, qs + kvs, qs + 2 * kvs)
        rows(p + "self_attn.o_proj.weight", a.o, "weight", 0, hid)
        if a.q_norm is not None:
            whole(p + "self_attn.q_norm.weight", a.q_norm.weight)
            whole(p + "self_attn.k_norm.weight", a.k_norm.weight)
        if isinstance(blk.mlp, MoE):
            out.update(moe_hf_targets(p + "mlp.", blk.mlp))
        else:
            rows(p + "mlp.gate_proj.weight", blk.mlp.gate_up, "weight", 0, inter)
            rows(p + "mlp.up_proj.weight", blk.mlp.gate_up, "weight", inter, 2 * inter)
            rows(p + "mlp.down_proj.weight", blk.mlp.down, "weight", 0, hid)
        whole(p + "input_layernorm.weight", blk.ln1.weight)
        whole(p + "post_attention_layernorm.weight", blk.ln2.weight)
    return out


_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def shared_weights(model: CausalLM, share: dict[str, torch.Tensor], dtype: torch.dtype,
                   device: torch.device | str) -> dict[str, torch.Tensor]:
    """The tensors of `share` (HF names) that can stand for an engine weight as they are: each one HF name fills
    whole (the experts, router, embedding, head, o_proj and norms; not q/k/v or a dense MLP's gate/up, which the
    engine fuses), in its dtype, on its device, contiguous. `model` may be on the meta device."""
    targets, device = _hf_targets(model), torch.device(device)
    out = {}
    for name, t in share.items():
        for pre in _PREFIXES:
            name = name.replace(pre, "")
        dst, lo, hi, owner = targets.get(name, (None, 0, 0, None))
        if (dst is not None and owner is None and lo == 0 and hi == dst.shape[0] and t.shape == dst.shape
                and t.dtype == dtype and t.device.type == device.type
                and (device.index is None or t.device.index == device.index) and t.is_contiguous()):
            out[name] = t
    return out


def materialize(model: CausalLM, device: torch.device | str, shared: dict[str, torch.Tensor]) -> None:
    """`model.to_empty(device)` but for the weights named in `shared` (`shared_weights`), which become those tensors
    (same storage: nothing allocated or copied; `model.shared` holds their ids)."""
    targets = _hf_targets(model)
    by_param = {id(targets[name][0]): t for name, t in shared.items()}
    made: dict[int, nn.Parameter] = {}  # old id -> new parameter (a parameter two modules hold stays one)
    for mod in model.modules():
        for key, p in mod._parameters.items():
            if p is not None and id(p) not in made:
                t = by_param.get(id(p))
                made[id(p)] = nn.Parameter(t.detach() if t is not None else torch.empty_like(p, device=device),
                                           requires_grad=p.requires_grad and t is None)
            if p is not None:
                mod._parameters[key] = made[id(p)]
        for key, buf in mod._buffers.items():
            if buf is not None:
                mod._buffers[key] = torch.empty_like(buf, device=device)
    model.shared = frozenset(id(made[i]) for i in by_param)
    model._targets = None  # built again over the materialised weights


@torch.no_grad()
def load_hf_weights(model: CausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy HF-named tensors into the fused layout in place (dtype/device converted). Returns the names loaded."""
    targets = getattr(model, "_targets", None)
    if targets is None:
        targets = model._targets = _hf_targets(model)
    seen = set()
    for name, t in named_tensors:
        for pre in _PREFIXES:
            name = name.replace(pre, "")
        if "lora_" in name:
            raise ValueError(
                f"update_weights got a LoRA tensor {name!r}; merge the adapters first "
                "(peft's merge_and_unload or the trainer's merged state dict) and send the merged weights."
            )
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in targets:
            raise ValueError(f"update_weights got an unknown parameter {name!r} for a {model.spec.model_type} model.")
        dst, lo, hi, owner = targets[name]
        view = dst.data[lo:hi]
        if tuple(t.shape) != tuple(view.shape):
            raise ValueError(f"parameter {name!r} has shape {tuple(t.shape)}, the engine expects {tuple(view.shape)}.")
        if owner is None and id(dst) in getattr(model, "shared", ()) and t.data_ptr() == view.data_ptr():
            pass  # a weight shared with the trainer (`materialize`): it is this tensor already
        elif owner is not None:
            owner.load_rows(lo, hi, t)
        else:
            view.copy_(t, non_blocking=True)
        seen.add(name)
    if model.spec.num_experts:  # per-expert names stand for the fused ones `required_hf_names` lists
        seen |= fused_names_covered(seen, model.spec.num_experts)
    if model.spec.tie_word_embeddings and model.lm_head is not None and seen & {"model.embed_tokens.weight",
                                                                                "lm_head.weight"}:
        model.lm_head.load_rows(0, model.spec.vocab_size, model.embed.weight)  # the FP8 head's copy of the embedding
    return seen


def required_hf_names(model: CausalLM) -> set[str]:
    names = {n for n in _hf_targets(model) if not PER_EXPERT_NAME.match(n)}
    if model.spec.tie_word_embeddings:
        names.discard("lm_head.weight")
    return names
