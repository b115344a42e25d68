"""Ulysses sequence parallelism (DeepSpeed-Ulysses, as in verl) for the packed policy forward.

Layout. The job is a `dp x sp` grid (`DistEnv`): consecutive ranks form one SP group and hold the *same*
micro-batch. Its packed row (packing.py) is padded to a multiple of `sp` and rank `r` keeps tokens
`[r*n, (r+1)*n)`, `n = N/sp`, of `input_ids` and `position_ids`, so embeddings, MLPs, norms and RoPE (positions are
per token) see 1/sp of the tokens. Attention needs every token of a sequence, so around it an all-to-all turns
`[n, all heads]` into `[N, heads/sp]`, the varlen kernel runs on the full `cu_seqlens` (the padding is one extra
trailing segment, so no real token ever attends to it), and a second all-to-all turns `[N, heads/sp]` back into
`[n, all heads]`. When the model has fewer KV heads than `sp`, each KV head is repeated `sp / num_kv_heads` times
first (verl does the same): q head `i` still meets kv head `i // (Hq/Hkv)` because the `Hq/sp` q heads a rank holds
are a contiguous slice of one GQA group.

Log-probs. Each rank runs the chunked LM head only on the prediction positions it holds; `gather_predictions` then
concatenates the per-rank values so that every SP rank sees the whole micro-batch and computes the same loss.

Why the gradient is neither lost nor counted `sp` times. Let `L_g` be the loss of SP group `g` (its micro-batches,
normalised by token/sequence counts of the whole mini-batch, summed over the *dp* groups only: every SP rank holds the
same rows, so counting over the world would count each one `sp` times). Every rank of group `g` computes the same
`L_g` from the gathered values. `gather_predictions`' backward keeps only this rank's slice of the incoming gradient
(no reduction: torch's autograd all_gather would *sum* the `sp` identical copies and multiply the gradient by `sp`).
From there on each operation of the forward ran on exactly one rank (its tokens for the MLPs and the LM head, its
heads for attention; the all-to-all's backward routes gradients back to the rank that produced the input), so the
per-rank parameter gradients `c_{g,r}` add up to the true gradient: `sum_r c_{g,r} = dL_g/dθ`. FSDP2 (sharded over the
whole world, as in verl: SP ranks are also FSDP ranks) and the replicated-parameter hook both *average* over all
`W = dp*sp` ranks, and `Actor` multiplies each rank's loss by `W`, so the update is
`W/W * sum_{g,r} c_{g,r} = sum_g dL_g/dθ = dL/dθ`, the single-process gradient. (Sharding FSDP over dp only would
leave the `sp` partial gradients of one shard unreduced; the whole-world mesh reduces them for free.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyrl.errors import ConfigError


@dataclass(frozen=True)
class SeqParallel:
    """This rank's place in its Ulysses group (the ranks sharing one micro-batch)."""

    group: Any  # torch ProcessGroup of the `size` consecutive ranks
    rank: int  # position inside the group: which 1/size of the tokens this rank holds
    size: int  # sequence-parallel degree


def check_heads(num_heads: int, num_kv_heads: int, sp: int) -> None:
    """Ulysses splits attention heads over the SP ranks; refuse layouts that do not split evenly."""
    if num_heads % sp or (num_kv_heads % sp and sp % num_kv_heads):
        raise ConfigError(
            f"ulysses_sequence_parallel_size={sp} must divide the model's {num_heads} attention heads and either "
            f"divide or be a multiple of its {num_kv_heads} key/value heads; pick such a size.")


# ------------------------------------------------------------------------------------------------ layout (pure)
def pad_packed(input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
               multiple: int):
    """Pad a packed row `[1, N]` to a multiple of `multiple` with one trailing segment (its own `cu_seqlens` entry,
    positions 0..pad-1), so real tokens never attend to it. Returns (input_ids, position_ids, cu_seqlens, max_seqlen).
    """
    N = input_ids.shape[1]
    pad = -N % multiple
    if pad == 0:
        return input_ids, position_ids, cu_seqlens, max_seqlen
    ids = F.pad(input_ids, (0, pad), value=0)
    pos = torch.cat([position_ids, torch.arange(pad, device=position_ids.device,
                                                dtype=position_ids.dtype).unsqueeze(0)], dim=1)
    cu = torch.cat([cu_seqlens, cu_seqlens.new_tensor([N + pad])])
    return ids, pos, cu, max(max_seqlen, pad)


def owned_predictions(pred_index: torch.Tensor, num_tokens: int, sp: int) -> list[int]:
    """Split points of the (ascending) prediction positions by owner: rank `r` owns predictions
    `[bounds[r], bounds[r+1])`, those whose position lies in its token slice. One host sync (the split sizes)."""
    n = num_tokens // sp
    edges = torch.arange(sp + 1, device=pred_index.device) * n
    return torch.searchsorted(pred_index, edges).tolist()


def shard_packed(packed, sp: SeqParallel):
    """This rank's part of a `Packed` micro-batch (packing.py): its 1/sp of the padded row, the full `cu_seqlens`,
    and the predictions it owns (positions made local). Also returns the split points for `gather_predictions`."""
    ids, pos, cu, max_len = pad_packed(packed.input_ids, packed.position_ids, packed.cu_seqlens, packed.max_seqlen,
                                       sp.size)
    N = ids.shape[1]
    n = N // sp.size
    bounds = owned_predictions(packed.pred_index, N, sp.size)
    mine = slice(bounds[sp.rank], bounds[sp.rank + 1])
    local = dataclasses.replace(
        packed, input_ids=ids[:, sp.rank * n:(sp.rank + 1) * n], position_ids=pos[:, sp.rank * n:(sp.rank + 1) * n],
        cu_seqlens=cu, max_seqlen=max_len, pred_index=packed.pred_index[mine] - sp.rank * n,
        targets=packed.targets[mine], rows=packed.rows[mine], cols=packed.cols[mine])
    return local, bounds


# ------------------------------------------------------------------------------------------------ collectives
def _all_to_all(x: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    """Autograd-aware all-to-all over dim 0 (chunk `j` goes to rank `j`; backward is the reverse all-to-all).

    The functional collective (traceable by torch.compile, unlike torch.distributed.nn's, which is deprecated)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, sp.group))


def seq_to_heads(x_nHD: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    """[n, H, D] (my tokens, all heads) -> [N, H/sp, D] (all tokens, my heads)."""
    n, H, D = x_nHD.shape
    x = x_nHD.reshape(n, sp.size, H // sp.size, D).transpose(0, 1)  # [sp, n, h, D]: chunk j = heads of rank j
    return _all_to_all(x, sp).reshape(sp.size * n, H // sp.size, D)  # received chunk j = tokens of rank j


def heads_to_seq(x_NhD: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    """[N, h, D] (all tokens, my heads) -> [n, h*sp, D] (my tokens, all heads); inverse of `seq_to_heads`."""
    N, h, D = x_NhD.shape
    x = _all_to_all(x_NhD.reshape(sp.size, N // sp.size, h, D), sp)  # received chunk j = my tokens, heads of rank j
    return x.transpose(0, 1).reshape(N // sp.size, sp.size * h, D)


def repeat_kv_for(x_nHD: torch.Tensor, sp: int) -> torch.Tensor:
    """Repeat each KV head `sp / Hkv` times when there are fewer KV heads than SP ranks (each rank needs one)."""
    H = x_nHD.shape[1]
    return x_nHD.repeat_interleave(sp // H, dim=1) if H < sp else x_nHD


@torch.compiler.disable  # compile_layers: keep the collectives and the kernel eager (a graph break), not traced
def ulysses_attention(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    """`attend(q, k, v) -> out` on all tokens and 1/sp of the heads, from and back to this rank's tokens.

    q [n, Hq, D], k/v [n, Hkv, D] -> [n, Hq, D]."""
    k, v = repeat_kv_for(k, sp.size), repeat_kv_for(v, sp.size)
    out = attend(seq_to_heads(q, sp), seq_to_heads(k, sp), seq_to_heads(v, sp))
    return heads_to_seq(out, sp)


class _GatherOwnGrad(torch.autograd.Function):
    """All-gather of variable-length 1-D pieces; backward keeps this rank's slice of the gradient, unreduced,
    because every SP rank computes the same loss from the gathered tensor (see the module docstring)."""

    @staticmethod
    def forward(ctx, x_m, bounds, sp):
        ctx.mine = (bounds[sp.rank], bounds[sp.rank + 1])
        sizes = [bounds[j + 1] - bounds[j] for j in range(sp.size)]
        width = max(sizes)
        buf = F.pad(x_m.detach(), (0, width - x_m.shape[0]))
        parts = [torch.empty_like(buf) for _ in range(sp.size)]
        dist.all_gather(parts, buf.contiguous(), group=sp.group)
        return torch.cat([p[:s] for p, s in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad_M):
        start, end = ctx.mine
        return grad_M[start:end], None, None


def gather_predictions(values_m: torch.Tensor, bounds: list[int], sp: SeqParallel,
                       anchor_m: torch.Tensor | None = None) -> torch.Tensor:
    """Per-prediction values of every SP rank, in prediction order: [m_r] on rank r -> [M] on every rank.

    A rank can hold no prediction at all (its slice is prompt tokens); its backward must run anyway, through the
    same collectives as the other ranks (attention all-to-alls, FSDP reduce-scatters, the LM head's gradient
    all-reduce). `anchor_m`, an empty `[0]` tensor computed from the LM head and its input, keeps it in the graph."""
    assert values_m.shape[0] == bounds[sp.rank + 1] - bounds[sp.rank], (values_m.shape, bounds, sp.rank)
    if anchor_m is not None and anchor_m.requires_grad and not values_m.requires_grad:
        values_m = values_m + anchor_m.to(values_m.dtype)  # both empty: adds nothing, links the graph
    return _GatherOwnGrad.apply(values_m, bounds, sp)
