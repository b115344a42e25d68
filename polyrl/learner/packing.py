"""Sequence packing: a micro-batch of padded rows becomes one padding-free row of `sum(lengths)` tokens.

Why: a padded `[B, P+T]` micro-batch spends attention and MLP FLOPs on pad tokens; GRPO response lengths vary a lot,
so padding is often half the tensor. Packing removes it (verl's `use_remove_padding`).

How, with unmodified HF models: the packed row is `input_ids [1, N]` with `position_ids` restarting at 0 for every
sequence (RoPE sees the same positions as in the padded row), and attention is isolated per sequence by a varlen
kernel that receives `cu_seq_lens` through the model's `**kwargs` (HF forwards them to the attention function, as for
flash-attention-2). We register that kernel as the attention implementation `polyrl_varlen`; it is switched on only
inside `packed_attention(model)`, so `generate` on the same module keeps its own implementation. The name is not
registered as a mask function, so HF builds no `[N, N]` mask at all.

Kernels: CUDA uses `torch.nn.attention.varlen.varlen_attn` (flash-attention varlen, in torch >= 2.9; no flash-attn
package needed). Elsewhere (CPU) each sequence is a block of a block-diagonal causal mask fed to SDPA, which is
exact but O(N^2) memory: fine for tests, not for long packs. Note that plain `sdpa` with restarting position ids is
*not* something to rely on: whether HF turns position ids into a packed mask depends on the version and on whether an
attention mask is passed; the explicit `cu_seq_lens` path does not depend on either.

Shared prompts (`pack(mb, share_prompts=True)`, on in the trainer): rows with the same prompt, a GRPO prompt's n
samples, carry one copy of it; the responses attend to that copy (shared_prefix.py). Same log-probs, fewer tokens.

Ulysses sequence parallelism (polyrl/distributed/ulysses.py) reuses all of this: each SP rank feeds its slice of the
packed row with the whole row's `cu_seq_lens` and its `SeqParallel` group as the extra kwarg `polyrl_sp`, and
`varlen_attention_forward` exchanges heads for tokens around the same kernels.
"""

from __future__ import annotations

import inspect
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from polyrl.learner.batch import Batch
from polyrl.learner.shared_prefix import shared_prompt_attention

ATTN_NAME = "polyrl_varlen"


@dataclass
class Packed:
    """One micro-batch packed into a single row, plus where its response log-probs go in the padded layout."""

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N], restarting at 0 per sequence
    cu_seqlens: torch.Tensor  # [B+1] int32, sequence starts in the packed row
    max_seqlen: int
    pred_index: torch.Tensor  # [M] packed positions whose output predicts a response token
    targets: torch.Tensor  # [M] the response tokens they predict
    rows: torch.Tensor  # [M] row of each target in the padded [B, T] response layout
    cols: torch.Tensor  # [M] column of each target
    shared: "SharedPrompts | None" = None  # set when rows share prompts (shared_prefix.py); cu_seqlens then
    # covers each distinct prompt once, then every response
    routes: torch.Tensor | None = None  # [N, num_moe_layers, top_k]: the batch's `routed_experts` (MoE replay)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


@dataclass
class SharedPrompts:
    """Keys of a packed row whose prompts are shared (shared_prefix.py): the row holds each distinct prompt once,
    then every response grouped by prompt; query segment s (`Packed.cu_seqlens`) attends to the rows
    `kv_index[cu_kv[s]:cu_kv[s+1]]` (a prompt: itself; a response: its prompt, then itself)."""

    num_prompt: int  # tokens [0, num_prompt) are the prompts
    cu_kv: torch.Tensor  # [S+1] int32
    kv_index: torch.Tensor  # [cu_kv[-1]] int64
    max_kv: int


def prompt_groups(mb: Batch) -> torch.Tensor:
    """Group id per row: rows with the same prompt tokens (a GRPO prompt's n samples) share an id, 0..G-1."""
    P = mb["input_ids"].shape[1] - mb["responses"].shape[1]
    ids = torch.where(mb["attention_mask"][:, :P].bool(), mb["input_ids"][:, :P], -1)
    return torch.unique(ids, dim=0, return_inverse=True)[1]


def pack(mb: Batch, share_prompts: bool = False) -> Packed:
    """Pack `[left-padded prompt | right-padded response]` rows (see batch.py) into one row without padding; with
    `share_prompts`, rows with the same prompt carry one copy of it (shared_prefix.py) when any prompt repeats."""
    if share_prompts and mb["responses"].shape[0] > 1:
        group = prompt_groups(mb)
        P = mb["input_ids"].shape[1] - mb["responses"].shape[1]
        repeats, empty_prompt = torch.stack([group.max() + 1 < len(group),
                                             ~mb["attention_mask"][:, :P].bool().any(1).all()]).tolist()
        if repeats and not empty_prompt:
            return _pack_shared(mb, group)
    am = mb["attention_mask"].bool()
    B, L = am.shape
    T = mb["responses"].shape[1]
    P = L - T
    flat = am.flatten().nonzero().squeeze(-1)
    lengths = am.sum(1)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=am.device)
    cu[1:] = lengths.cumsum(0)
    prompt_len = am[:, :P].sum(1)
    resp_used = am[:, P:]  # which response columns hold real tokens
    rows, cols = resp_used.nonzero(as_tuple=True)
    # response token (b, t) sits at packed position cu[b] + prompt_len[b] + t; the output one earlier predicts it
    pred_index = cu[:-1].long()[rows] + prompt_len[rows] + cols - 1
    return Packed(
        input_ids=mb["input_ids"].flatten()[flat].unsqueeze(0),
        position_ids=mb["position_ids"].flatten()[flat].unsqueeze(0),
        cu_seqlens=cu,
        max_seqlen=int(lengths.max()) if B else 0,
        pred_index=pred_index,
        targets=mb["responses"][rows, cols],
        rows=rows,
        cols=cols,
        routes=mb["routed_experts"].flatten(0, 1)[flat] if "routed_experts" in mb else None,
    )


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(len(x) + 1, dtype=torch.int32, device=x.device)
    out[1:] = x.cumsum(0)
    return out


def _pack_shared(mb: Batch, group: torch.Tensor) -> Packed:
    """`[prompt_0 | ... | prompt_G-1 | responses of group 0 | ... ]`, positions as in the unshared rows."""
    am = mb["attention_mask"].bool()
    B, L = am.shape
    T = mb["responses"].shape[1]
    P = L - T
    dev = am.device
    order = torch.argsort(group * B + torch.arange(B, device=dev))  # rows grouped by prompt, stable
    g_sorted = group[order]
    is_lead = torch.ones(B, dtype=torch.bool, device=dev)
    is_lead[1:] = g_sorted[1:] != g_sorted[:-1]
    lead = order[is_lead]  # the first row of each group supplies its prompt; group g is lead[g]
    prompt_len = am[lead, :P].sum(1)
    resp_len = am[:, P:].sum(1)
    p_start = _exclusive_cumsum(prompt_len)
    num_prompt = int(p_start[-1])
    r_start = torch.empty(B, dtype=torch.long, device=dev)
    r_start[order] = num_prompt + _exclusive_cumsum(resp_len[order])[:-1].long()
    prompt_at, resp_at = am[lead, :P].nonzero(as_tuple=True), am[order, P:].nonzero(as_tuple=True)  # 1 sync each, not 2
    take = lambda key: torch.cat([mb[key][lead, :P][prompt_at], mb[key][order, P:][resp_at]])  # noqa: E731
    rows, cols = am[:, P:].nonzero(as_tuple=True)
    g = group[rows]
    # response token t is predicted by the output one earlier: its own token t-1, or for t = 0 the prompt's last
    pred_index = torch.where(cols == 0, p_start[g].long() + prompt_len[g] - 1, r_start[rows] + cols - 1)
    # query segments: each prompt, then each response; key segments: a prompt itself, a response its prompt + itself
    resp_sorted = resp_len[order]
    seg_q = torch.cat([prompt_len, resp_sorted])
    starts = torch.cat([p_start[:-1].long(), torch.stack([p_start[g_sorted].long(), r_start[order]], 1).flatten()])
    lens = torch.cat([prompt_len, torch.stack([prompt_len[g_sorted], resp_sorted], 1).flatten()])
    cu_kv = _exclusive_cumsum(torch.cat([prompt_len, prompt_len[g_sorted] + resp_sorted]))
    max_len, max_kv, kv_total = torch.stack([seg_q.max(), (cu_kv[1:] - cu_kv[:-1]).max(), cu_kv[-1]]).tolist()
    pieces = _exclusive_cumsum(lens)[:-1].long()
    kv_index = torch.repeat_interleave(starts - pieces, lens, output_size=kv_total) + torch.arange(kv_total, device=dev)
    return Packed(
        input_ids=take("input_ids").unsqueeze(0),
        position_ids=take("position_ids").unsqueeze(0),
        cu_seqlens=_exclusive_cumsum(seg_q),
        max_seqlen=max_len,
        pred_index=pred_index,
        targets=mb["responses"][rows, cols],
        rows=rows,
        cols=cols,
        shared=SharedPrompts(num_prompt=num_prompt, cu_kv=cu_kv, kv_index=kv_index, max_kv=max_kv),
        routes=take("routed_experts") if "routed_experts" in mb else None,
    )


def trunk_work(mb: Batch, share_prompts: bool) -> tuple[list[int], int]:
    """(token count of each packed segment, attended (query, key) pairs counted as verl does: s^2 per sequence) of a
    micro-batch: what its forward actually computes, for MFU. Shared prompts count once; a response's pairs are
    its own square plus twice (prompt x response)."""
    am = mb["attention_mask"].bool()
    T = mb["responses"].shape[1]
    P = am.shape[1] - T
    prompt_len, resp_len = am[:, :P].sum(1), am[:, P:].sum(1)
    if not share_prompts:
        lengths = (prompt_len + resp_len).tolist()
        return lengths, sum(s * s for s in lengths)
    group = prompt_groups(mb)
    first = torch.full((int(group.max()) + 1,), len(group), device=group.device).scatter_reduce(
        0, group, torch.arange(len(group), device=group.device), "amin")
    p, r, rp = prompt_len[first].tolist(), resp_len.tolist(), prompt_len.tolist()
    return p + r, sum(x * x for x in p) + sum(y * y + 2 * x * y for x, y in zip(rp, r))


def unpack(values_M: torch.Tensor, packed: Packed, shape: tuple[int, int]) -> torch.Tensor:
    """Scatter per-response-token values back into the padded `[B, T]` layout (zeros elsewhere; differentiable)."""
    out = values_M.new_zeros(shape)
    return out.index_put((packed.rows, packed.cols), values_M)


def attention_kwargs(packed: Packed, sp=None) -> dict:
    """What the model's forward passes down to `varlen_attention_forward` (flash-attention-2's kwarg names), plus
    the Ulysses group (`polyrl.distributed.ulysses.SeqParallel`) when this rank holds 1/sp of the packed row."""
    kw = dict(cu_seq_lens_q=packed.cu_seqlens, cu_seq_lens_k=packed.cu_seqlens, max_length_q=packed.max_seqlen,
              max_length_k=packed.max_seqlen)
    if packed.shared is not None:  # flat kwargs (tensors and ints), so compiled layers see no new object type
        sh = packed.shared
        kw.update(polyrl_cu_kv=sh.cu_kv, polyrl_kv_index=sh.kv_index, polyrl_max_kv=sh.max_kv)
    if sp is not None:
        kw["polyrl_sp"] = sp
    return kw


# ------------------------------------------------------------------------------------------------ attention kernels
def _varlen_cuda():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, params


def _cuda_varlen(q, k, v, cu, max_len, scale, cu_k=None, max_k=None):
    """q [N, Hq, D], k/v [N, Hkv, D] in bf16/fp16 -> [N, Hq, D], causal within each sequence (with separate key
    segments `cu_k`: causal from each segment's bottom-right, flash-attention's rule when keys outnumber queries)."""
    varlen_attn, params = _VARLEN
    kw = {"scale": scale}
    if "is_causal" in params:  # torch 2.9-2.11 spelling
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu, cu if cu_k is None else cu_k, max_len, max_len if max_k is None else max_k, **kw)


def _cuda_varlen_kv(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """Separate query and key segments (shared prompts): the same kernel, keys gathered per segment."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    return _cuda_varlen(q, k, v, cu_q.to(torch.int32), max_q, scale, cu_k.to(torch.int32), max_k)


def _block_causal_sdpa(q, k, v, cu, scale):
    """Reference path: SDPA with a block-diagonal causal mask (exact, O(N^2) memory)."""
    N = q.shape[0]
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1, device=q.device), (cu[1:] - cu[:-1]).long(),
                                  output_size=N)
    idx = torch.arange(N, device=q.device)
    mask = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, N, D]
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                         enable_gqa=qh.shape[1] != kh.shape[1])
    return out[0].transpose(0, 1)


_VARLEN = _varlen_cuda()
_VARLEN_BROKEN: list[str] = []


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention-interface function: query [1, Hq, N, D], key/value [1, Hkv, N, D] -> ([1, N, Hq, D], None).

    Under Ulysses (`polyrl_sp` in kwargs) N is this rank's 1/sp of the packed row and `cu_seq_lens_q` describes the
    whole row: the heads are exchanged around the kernel (distributed/ulysses.py)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise RuntimeError("polyrl_varlen attention was called without cu_seq_lens_q; it is only valid inside "
                           "polyrl.learner.packing.packed_attention() with a packed batch.")
    assert query.shape[0] == 1, "packed attention expects one packed row"
    q, k, v = _kernel_dtype(*(t[0].transpose(0, 1) for t in (query, key, value)))  # [N, H, D]
    sp = kwargs.get("polyrl_sp")
    shared = None
    if "polyrl_kv_index" in kwargs:  # shared prompts (shared_prefix.py)
        assert sp is None, "shared prompts are not split over a sequence-parallel group"
        shared = (kwargs["polyrl_cu_kv"], kwargs["polyrl_kv_index"], kwargs["polyrl_max_kv"])
    # the shared path hands its ints to the kernel as they come (under torch.compile, int() pins each value)
    max_len = kwargs["max_length_q"] if shared is not None else int(kwargs["max_length_q"])
    if sp is None:
        out = _varlen(q, k, v, cu, max_len, scaling, shared)
    else:
        from polyrl.distributed.ulysses import ulysses_attention

        attend = lambda q_, k_, v_: _varlen(q_, k_, v_, cu, max_len, scaling)  # noqa: E731
        out = ulysses_attention(attend, q, k, v, sp)
    # outside autocast, an fp32 model's next projection needs fp32 back from the bf16 kernel
    if not torch.is_autocast_enabled(out.device.type):
        out = out.to(query.dtype)
    return out.unsqueeze(0), None


def _cuda_kernel_usable(q) -> bool:
    return q.is_cuda and _VARLEN is not None and not _VARLEN_BROKEN


def _kernel_dtype(q, k, v):
    """RoPE against fp32 cos/sin (fp32 residual stream under autocast) promotes q/k to fp32: cast to the CUDA
    kernel's dtype here, before any Ulysses all-to-all, so that moves half the bytes."""
    if _cuda_kernel_usable(q) and q.dtype not in (torch.float16, torch.bfloat16):
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v


def _varlen(q, k, v, cu, max_len: int, scaling, shared=None):
    """q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D], causal within each `cu` segment: the CUDA kernel or SDPA. With
    `shared` = (cu_kv, kv_index, max_kv), the shared-prompt layout instead (shared_prefix.py)."""
    if _cuda_kernel_usable(q):
        q, k, v = _kernel_dtype(q, k, v)  # no-op unless called directly
        try:
            if shared is not None:
                return shared_prompt_attention(q, k, v, cu, max_len, *shared, scaling, varlen=_cuda_varlen_kv)
            return _cuda_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu.to(torch.int32), max_len, scaling)
        except (TypeError, RuntimeError) as e:  # an older torch spelling or an unsupported GPU: say so, stay correct
            _VARLEN_BROKEN.append(repr(e))
            warnings.warn(f"torch varlen_attn failed ({e!r}); packed attention falls back to SDPA with an explicit "
                          "mask (exact, O(N^2) memory).", stacklevel=2)
    dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if shared is not None:
        return shared_prompt_attention(q, k, v, cu, max_len, *shared, scaling)
    return _block_causal_sdpa(q, k, v, cu.long(), scaling)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, varlen_attention_forward)


_register()


def _configs(model):
    seen, out = set(), []
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


@contextmanager
def packed_attention(model):
    """Switch `model`'s attention to the varlen kernel for the duration of a packed forward/backward.

    The backward of non-reentrant checkpointing re-runs the forward after this context has exited, but the attention
    function is looked up at call time from the config, so the recomputation must also see `polyrl_varlen`: callers
    run forward *and* backward inside this context.
    """
    configs = _configs(model)
    before = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = ATTN_NAME
        yield
    finally:
        for c, b in zip(configs, before):
            c._attn_implementation = b
