"""Mixture-of-Experts decoder MLPs for the native engine: `qwen3_moe` and `qwen2_moe` (with its gated shared expert).

The math is HF's (transformers' Qwen2/Qwen3 MoE blocks): router logits in the activation dtype, softmax over all
experts in fp32, top-k, optionally renormalised over the k (`norm_topk_prob`), the weights cast back to the activation
dtype; each token's k expert outputs are scaled by their weights and summed. Qwen2-MoE adds a shared expert scaled by
sigmoid(shared_expert_gate(x)).

Experts run as two grouped GEMMs (`torch._grouped_mm`, CPU and CUDA): the T*k (token, expert) pairs are sorted by
expert, each expert multiplies its contiguous run of rows, and the rows go back to token order. Every shape depends
on T and k only and the group offsets stay on the device (`searchsorted` over the sorted ids), so the decode step has
no host sync and CUDA graphs capture it (torch's CUTLASS kernel: bf16 on sm_90/sm_100; elsewhere on CUDA, where
torch's fallback syncs, small GEMMs gather each row's expert weight instead). `torch._grouped_mm` won every regime
`benchmarks/moe_decode.py --gemms` measured at Qwen3-30B-A3B's layer shape on an H100 (2026-11-27: decode at 256
tokens 475 us against 563 for a Triton grouped GEMM with 16-row tiles and 14,102 for a per-expert loop; prefill at
8,192 tokens 1,332 against 2,530 and 8,276), so the Triton kernel went (git keeps it, commit ac3fa6f) and the loop
stays only as the benchmark's and the tests' reference.

Weights: `Experts.gate_up` is [E, 2I, H] (gate rows first, then up rows: HF's fused `experts.gate_up_proj`) and
`Experts.down` [E, H, I] (HF's `experts.down_proj`); both are also reachable under HF's older per-expert names
(`experts.N.gate_proj.weight`, ...), see model.py's `_hf_targets`. For tensor parallelism an outside function may keep
a slice [lo, hi) of the intermediate dimension of every expert (`Experts.narrow_intermediate`): the down GEMM then
gives a partial sum for the caller to all-reduce.

Under `rollout.quantization=fp8` the experts hold e4m3 weights with one fp32 scale per output row of each expert
(`FP8Experts`, quantised as they load) and run `torch._scaled_grouped_mm` on Hopper with per-row activation scales;
elsewhere on CUDA they stay in the model dtype and the engine says so once (`quantize_experts`). On CPU the e4m3
numbers are emulated in fp32, as fp8_linear.py does.

Routing record (R3, `record_routes`): each MoE layer writes its top-k expert ids (int16) into a buffer indexed like the
KV cache, [cache slot, moe layer, k], at the slots the step's K/V go to (`AttnMeta.slot_mapping`); the engine gathers a
sequence's rows when it retires (engine.py `_copy_routes`).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from polyrl.rollout.native.model import ModelSpec

MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
ROUTE_DTYPE = torch.int16


def is_moe_layer(cfg, layer: int) -> bool:
    """HF's rule (Qwen2/3-MoE decoder layers): sparse unless listed in `mlp_only_layers`, every
    `decoder_sparse_step`-th layer."""
    num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0) or 0
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return layer not in (getattr(cfg, "mlp_only_layers", None) or []) and num_experts > 0 and (layer + 1) % step == 0


def sort_by_expert(ids_TK: torch.Tensor, num_experts: int):
    """(order, offsets): the flat (token, slot) pairs sorted by expert (stable) and each expert's end row, int32, all on
    the device (no host sync)."""
    flat = ids_TK.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    return order, offs


@functools.cache
def _cutlass_grouped_mm(device: torch.device) -> bool:
    """Whether torch._grouped_mm has its CUTLASS kernel here (bf16 on sm_90 / sm_100). Elsewhere on CUDA it loops
    over the groups after copying the offsets to the host: a sync that CUDA graphs cannot capture."""
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


GATHER_MAX_BYTES = 1 << 30  # the per-row weight gather (CUDA without the CUTLASS kernel) up to this many bytes



def grouped_linear(x_MK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, kind: str) -> torch.Tensor:
    """Row run e of x (rows offs[e-1]..offs[e]) times w[e]^T, for every expert e: [M, N]."""
    if kind == "grouped_mm":
        M, (_, N, K) = x_MK.shape[0], w_ENK.shape
        if x_MK.is_cuda and not (x_MK.dtype == torch.bfloat16 and _cutlass_grouped_mm(x_MK.device)) and \
                M * N * K * w_ENK.element_size() <= GATHER_MAX_BYTES:
            # sync-free where torch's own fallback is not (fp32 tests, small models on other GPUs): each row's
            # expert weight gathered, one batched GEMV
            rows = torch.arange(M, device=x_MK.device, dtype=offs_E.dtype)
            expert = torch.searchsorted(offs_E, rows, right=True)
            return torch.bmm(w_ENK[expert], x_MK[:, :, None])[..., 0]
        return torch._grouped_mm(x_MK, w_ENK.transpose(-2, -1), offs=offs_E)
    assert kind == "loop", kind
    out = x_MK.new_empty(x_MK.shape[0], w_ENK.shape[1])
    start = 0
    for e, end in enumerate(offs_E.tolist()):  # host sync: eager prefill / benchmarks only
        if end > start:
            out[start:end] = x_MK[start:end] @ w_ENK[e].t()
        start = end
    return out


def _silu_mul(gate_up: torch.Tensor, fp8: bool = False):
    if gate_up.is_cuda:
        from polyrl.rollout.native.fused import silu_mul

        return silu_mul(gate_up, fp8=fp8)
    gate, up = gate_up.chunk(2, dim=-1)
    act = nn.functional.silu(gate) * up
    if not fp8:
        return act
    from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows

    return FP8Rows(*quantize_fp8_rows(act))


class Experts(nn.Module):
    """E gated-SiLU experts as two 3-D weights; forward(x, ids, weights) = sum_k weight_k * expert_{ids_k}(x)."""

    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, inter), requires_grad=False)

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor, kind: str = "grouped_mm"):
        T, K = ids_TK.shape
        order, offs = sort_by_expert(ids_TK, self.num_experts)
        xs = x_TD[order // K]  # [T*K, D], grouped by expert
        act = _silu_mul(self._gate_up(xs, offs, kind), fp8=self._fp8_act)
        y = self._down(act, offs, kind) * w_TK.reshape(-1)[order, None]
        # back to (token, slot) order, then the k outputs of a token summed (fp32 accumulation, one rounding)
        return torch.empty_like(y).index_copy_(0, order, y).view(T, K, -1).sum(1)

    _fp8_act = False

    def _gate_up(self, xs, offs, kind):
        return grouped_linear(xs, self.gate_up, offs, kind)

    def _down(self, act, offs, kind):
        return grouped_linear(act, self.down, offs, kind)

    @torch.no_grad()
    def narrow_intermediate(self, lo: int, hi: int) -> None:
        """Keep intermediate columns [lo, hi) of every expert (tensor parallelism, from outside): the gate and up
        rows of that range and the matching down columns; the output becomes this shard's partial sum. FP8 experts
        keep their row scales (a gate/up row's scale moves with it; a down row's covers all its columns, so it stays
        valid for a slice of them)."""
        E, I, H, n = self.num_experts, self.inter, self.hidden, hi - lo
        self.gate_up = nn.Parameter(self.gate_up.data.view(E, 2, I, H)[:, :, lo:hi].reshape(E, 2 * n, H).clone(),
                                    requires_grad=False)
        self.down = nn.Parameter(self.down.data[:, :, lo:hi].contiguous(), requires_grad=False)
        if hasattr(self, "gate_up_scale"):
            scale = self.gate_up_scale.data.view(E, 2, I)[:, :, lo:hi].reshape(E, 2 * n).clone()
            self.gate_up_scale = nn.Parameter(scale, requires_grad=False)
        self.inter = n


class FP8Experts(Experts):
    """Experts with e4m3 weights and one fp32 scale per (expert, output row); the activation is quantised per row.
    `torch._scaled_grouped_mm` on CUDA (Hopper), the same numbers in fp32 elsewhere."""

    def __init__(self, experts: Experts):
        nn.Module.__init__(self)
        from polyrl.rollout.native.attention import FP8

        self.num_experts, self.hidden, self.inter = experts.num_experts, experts.hidden, experts.inter
        self.out_dtype = experts.gate_up.dtype
        dev = experts.gate_up.device
        for name in ("gate_up", "down"):
            w = getattr(experts, name)
            setattr(self, name, nn.Parameter(torch.empty(w.shape, dtype=FP8, device=dev), requires_grad=False))
            setattr(self, name + "_scale", nn.Parameter(torch.ones(w.shape[:2], dtype=torch.float32, device=dev),
                                                        requires_grad=False))
            self.load_rows(name, 0, w.shape[0], w.data)
        self._fp8_act = True

    @torch.no_grad()
    def load_rows(self, name: str, lo: int, hi: int, w: torch.Tensor, expert: int | None = None) -> None:
        """Quantise experts [lo, hi) of weight `name` (a [hi - lo, N, K] tensor), or, with `expert`, rows [lo, hi)
        of that expert (a [hi - lo, K] tensor), into the e4m3 storage."""
        from polyrl.rollout.native.fp8_linear import quantize_weight_rows

        q_all, s_all = getattr(self, name).data, getattr(self, name + "_scale").data
        w = w.to(q_all.device)
        q, s = quantize_weight_rows(w.reshape(-1, w.shape[-1]))
        if expert is None:
            q_all[lo:hi].view(torch.uint8).copy_(q.view(torch.uint8).view(w.shape))
            s_all[lo:hi].copy_(s.view(w.shape[:-1]))
        else:
            q_all[expert, lo:hi].view(torch.uint8).copy_(q.view(torch.uint8))
            s_all[expert, lo:hi].copy_(s)

    def _gate_up(self, xs, offs, kind):
        return _fp8_grouped(xs, self.gate_up, self.gate_up_scale, offs, self.out_dtype)

    def _down(self, act, offs, kind):
        return _fp8_grouped(act, self.down, self.down_scale, offs, self.out_dtype)


def _fp8_grouped(x, w_ENK, s_EN, offs, out_dtype):
    from polyrl.rollout.native.attention import FP8Rows, quantize_fp8_rows

    if not isinstance(x, FP8Rows):
        if x.is_cuda:
            from polyrl.rollout.native.fused import quantize_fp8_rows_triton

            x = FP8Rows(*quantize_fp8_rows_triton(x))
        else:
            x = FP8Rows(*quantize_fp8_rows(x))
    if x.q.is_cuda:
        return torch._scaled_grouped_mm(x.q, w_ENK.transpose(-2, -1), x.scale, s_EN, offs=offs, out_dtype=out_dtype,
                                        use_fast_accum=True)  # as fp8_linear's fed rows
    xd = x.q.float() * x.scale[:, None]
    return torch._grouped_mm(xd, (w_ENK.float() * s_EN[..., None]).transpose(-2, -1), offs=offs).to(out_dtype)


class MoE(nn.Module):
    """A sparse MoE MLP: router (HF `mlp.gate`), experts, and Qwen2-MoE's shared expert with its sigmoid gate."""

    def __init__(self, s: "ModelSpec"):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = s.num_experts, s.num_experts_per_tok, s.norm_topk_prob
        self.router = nn.Linear(s.hidden_size, s.num_experts, bias=False)
        self.experts = Experts(s.num_experts, s.hidden_size, s.moe_intermediate_size)
        self.shared = SharedExpert(s.hidden_size, s.shared_expert_intermediate_size) \
            if s.shared_expert_intermediate_size else None
        self.shared_gate = nn.Linear(s.hidden_size, 1, bias=False) if self.shared is not None else None
        self.routes: torch.Tensor | None = None  # [cache slots, k] int16 view of the engine's routing record

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], weights [T, k] in x's dtype), HF's router."""
        probs = torch.softmax(self.router(x_TD).float(), dim=-1)
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return ids, w.to(x_TD.dtype)

    def forward(self, x_TD: torch.Tensor, slot_mapping: torch.Tensor | None = None):
        ids, w = self.route(x_TD)
        if self.routes is not None and slot_mapping is not None:
            self.routes.index_copy_(0, slot_mapping, ids.to(ROUTE_DTYPE))
        out = self.experts(x_TD, ids, w, "grouped_mm")
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x_TD)) * self.shared(x_TD)
        return out


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a gated-SiLU MLP with the dense MLP's fused `gate_up` layout."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.inter = inter
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down(_silu_mul(self.gate_up(x)))


def moe_layers(model) -> list[MoE]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]


def quantize_experts(model) -> None:
    """`rollout.quantization=fp8` for the experts: e4m3 with per-row scales where `torch._scaled_grouped_mm` runs (CPU
    emulation, CUDA sm_90); elsewhere they stay in the model dtype, said in one line."""
    layers = [m for m in moe_layers(model) if type(m.experts) is Experts]
    if not layers:
        return
    dev = layers[0].experts.gate_up.device
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] != 9:
        print(f"polyrl: rollout.quantization=fp8 keeps the MoE experts in {layers[0].experts.gate_up.dtype}: "
              "torch._scaled_grouped_mm's row-wise FP8 kernel needs compute capability 9.x (Hopper), this GPU is "
              f"{'.'.join(map(str, torch.cuda.get_device_capability(dev)))}")
        return
    for m in layers:
        m.experts = FP8Experts(m.experts)


def route_bytes_per_token(model) -> int:
    """Bytes the routing record takes per cached token: k int16 ids per MoE layer."""
    return sum(m.top_k for m in moe_layers(model)) * ROUTE_DTYPE.itemsize


def set_route_buffer(model, routes: torch.Tensor | None) -> None:
    """Point every MoE layer at its column of the routing record [cache slots, moe layers, k] (None: stop
    recording)."""
    for j, m in enumerate(moe_layers(model)):
        m.routes = routes[:, j] if routes is not None else None


class _ExpertRows:
    """`load_hf_weights`' target and owner for one expert's rows of a 3-D expert weight (HF's per-expert names), or
    the whole of it (FP8): reads and writes through the live parameter, never a stored view (offloading swaps a
    parameter's storage, and a view would keep the old one alive), quantising where the experts are FP8."""

    def __init__(self, experts: Experts, name: str, expert: int | None):
        self.experts, self.name, self.expert = experts, name, expert

    @property
    def data(self) -> torch.Tensor:
        w = getattr(self.experts, self.name).data
        return w if self.expert is None else w[self.expert]

    @torch.no_grad()
    def load_rows(self, lo: int, hi: int, w: torch.Tensor) -> None:
        if isinstance(self.experts, FP8Experts):
            self.experts.load_rows(self.name, lo, hi, w, self.expert)
        elif self.expert is None:
            getattr(self.experts, self.name).data[lo:hi].copy_(w, non_blocking=True)
        else:
            getattr(self.experts, self.name).data[self.expert, lo:hi].copy_(w, non_blocking=True)


def moe_hf_targets(prefix: str, m: MoE) -> dict:
    """HF names under `prefix` ("model.layers.N.mlp.") -> model.py's (tensor, row start, row end, owner) targets:
    the router, the experts under both HF layouts (fused 3-D `experts.gate_up_proj` / `experts.down_proj`, and the
    per-expert `experts.N.{gate,up,down}_proj.weight` of checkpoints and older transformers), the shared expert."""
    ex, I, H = m.experts, m.experts.inter, m.experts.hidden
    fp8 = isinstance(ex, FP8Experts)
    out = {prefix + "gate.weight": (m.router.weight, 0, m.num_experts, None),
           prefix + "experts.gate_up_proj": (ex.gate_up, 0, m.num_experts, _ExpertRows(ex, "gate_up", None) if fp8
                                             else None),
           prefix + "experts.down_proj": (ex.down, 0, m.num_experts, _ExpertRows(ex, "down", None) if fp8 else None)}
    for e in range(m.num_experts):
        q = f"{prefix}experts.{e}."
        gate_up, down = _ExpertRows(ex, "gate_up", e), _ExpertRows(ex, "down", e)
        out[q + "gate_proj.weight"] = (gate_up, 0, I, gate_up)
        out[q + "up_proj.weight"] = (gate_up, I, 2 * I, gate_up)
        out[q + "down_proj.weight"] = (down, 0, H, down)
    if m.shared is not None:
        s, Is = m.shared, m.shared.inter

        def rows(lin, lo, hi):
            return (lin.weight, lo, hi, lin if hasattr(lin, "load_rows") else None)

        out[prefix + "shared_expert.gate_proj.weight"] = rows(s.gate_up, 0, Is)
        out[prefix + "shared_expert.up_proj.weight"] = rows(s.gate_up, Is, 2 * Is)
        out[prefix + "shared_expert.down_proj.weight"] = rows(s.down, 0, H)
        out[prefix + "shared_expert_gate.weight"] = (m.shared_gate.weight, 0, 1, None)
    return out


PER_EXPERT_NAME = re.compile(r"^(.*\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


def fused_names_covered(seen: set[str], num_experts: int) -> set[str]:
    """The fused expert names (`...experts.gate_up_proj` / `down_proj`) whose every per-expert piece is in `seen`, so
    that a per-expert state dict satisfies the fused names `required_hf_names` lists."""
    pieces: dict[str, set[tuple[int, str]]] = {}
    for name in seen:
        m = PER_EXPERT_NAME.match(name)
        if m:
            pieces.setdefault(m.group(1), set()).add((int(m.group(2)), m.group(3)))
    out = set()
    for prefix, got in pieces.items():
        if {(e, "gate") for e in range(num_experts)} | {(e, "up") for e in range(num_experts)} <= got:
            out.add(prefix + "gate_up_proj")
        if {(e, "down") for e in range(num_experts)} <= got:
            out.add(prefix + "down_proj")
    return out


class RouteRecorder:
    """The engine's routing record for R3 (`NativeEngine(record_routes=True)`): top-k expert ids per MoE layer for
    every token the engine forwards, in a device buffer indexed like the KV cache ([cache slot, moe layer, k], -1
    where nothing was written). Shared prompt blocks share their rows; a forked partial block is copied with its K/V
    (`copy_blocks`). When a sequence retires (before its blocks can be reused; the stream orders the gather after its
    last forward) its rows are gathered to host memory (`retired`); `result` assembles `Generation.routed_experts`."""

    def __init__(self, model, block_size: int):
        self.model, self.block_size = model, block_size
        layers = moe_layers(model)
        if not layers:
            raise ValueError(f"record_routes=True needs a Mixture-of-Experts model; this "
                             f"{model.spec.model_type} model has no routed experts.")
        self.num_layers, self.top_k = len(layers), layers[0].top_k
        self.routes: torch.Tensor | None = None
        self.rows: dict[int, torch.Tensor] = {}

    def alloc(self, num_blocks: int, device) -> None:
        self.routes = torch.full((num_blocks * self.block_size, self.num_layers, self.top_k), -1, dtype=ROUTE_DTYPE,
                                 device=device)
        set_route_buffer(self.model, self.routes)

    def release(self) -> None:
        self.routes = None
        set_route_buffer(self.model, None)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        by_block = self.routes.view(-1, self.block_size, self.num_layers, self.top_k)
        by_block[dst] = by_block[src]

    def new_call(self) -> None:
        self.rows = {}

    def retired(self, seq) -> None:
        """Gather a finished sequence's rows (positions 0 .. length - 2: the ones forwarded; the last is being
        sampled). Preempted sequences (neither finished nor fully scheduled) are recomputed later: skipped."""
        if not (seq.done_scheduling or seq.finish_reason is not None):
            return
        import numpy as np

        pos = np.arange(seq.length - 1)
        slots = np.asarray(seq.blocks, dtype=np.int64)[pos // self.block_size] * self.block_size + pos % self.block_size
        idx = torch.from_numpy(slots)
        dev = self.routes.device
        if dev.type == "cuda":
            idx = idx.pin_memory().to(dev, non_blocking=True)
            host = torch.empty((len(pos), self.num_layers, self.top_k), dtype=ROUTE_DTYPE, pin_memory=True)
            host.copy_(self.routes[idx], non_blocking=True)
        else:
            host = self.routes[idx]
        self.rows[seq.row] = host

    def result(self, rows) -> list[torch.Tensor]:
        """Per output row: int16 [len(prompt) + len(response), moe layers, k], aligned with prompt + response
        positions; the last token (sampled, never forwarded) is -1, as is any position past what was gathered."""
        if self.routes is not None and self.routes.is_cuda:
            torch.cuda.current_stream(self.routes.device).synchronize()
        out = []
        for seq in rows:
            total = len(seq.tokens)  # prompt + response (tokens sampled after a stop token are dropped)
            r = torch.full((total, self.num_layers, self.top_k), -1, dtype=ROUTE_DTYPE)
            got = self.rows.get(seq.row)
            if got is not None:
                n = min(got.shape[0], total - 1)
                r[:n] = got[:n]
            out.append(r)
        return out
