"""Weight sync from the FSDP-sharded actor to each rank's rollout engine, one tensor at a time.

Each rank's engine holds a full replica (data-parallel rollout: every rank generates its own prompts), so every
rank needs every full weight. `full_tensors` yields `(hf_name, full_tensor)` pairs lazily: the all-gather of
parameter `i+1` starts only after the engine has copied parameter `i` in place, so the extra memory is one
parameter's full size, never a second copy of the model on any rank. All ranks must consume the stream in the same
order (it is a sequence of collectives); `PPOTrainer._weights_for_rollout` guarantees that by calling it everywhere.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The unsharded value of a DTensor (collective), or `t` itself for a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream HF-named full tensors out of (possibly sharded) ones; see the module docstring."""
    for name, t in named:
        yield name, full_tensor(t.detach())


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """Every full weight on every rank (tests and small models only: this *is* a full copy)."""
    return {k: full_tensor(v.detach()).clone() for k, v in model.state_dict().items()}


def layer_key(name: str) -> str:
    """Tensors of one decoder layer share a key (their bucket); every other tensor is a bucket of its own."""
    m = re.search(r"\.layers\.(\d+)\.", name)
    return m.group(0) if m else name


def full_tensors_by_layer(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`full_tensors`, one all-gather per decoder layer instead of one per tensor: the layer's FSDP2 row shards go
    into one flat buffer per dtype, one all-gather, and come out as full tensors. The transient
    memory is one layer's full weights (0.8 GB at Qwen3-32B in bf16), never the model. A tensor that is not a
    plain row shard (HSDP replicas are fine; anything else) falls back to `full_tensor`. For a tensor-parallel engine
    each rank then keeps its own slice (`tensor_parallel.TensorParallel.local_tensors`)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    key = None
    for name, t in named:
        k = layer_key(name)
        if bucket and k != key:
            yield from _gather_bucket(bucket)
            bucket = []
        key = k
        bucket.append((name, t.detach()))
    if bucket:
        yield from _gather_bucket(bucket)


def _row_shard_dim(t: torch.Tensor) -> int | None:
    """The mesh dim a DTensor is row-sharded over (every other mesh dim replicated), or None."""
    placements = getattr(t, "placements", None)
    if placements is None or t.dim() == 0:
        return None
    shard = [i for i, p in enumerate(placements) if p.is_shard()]
    if len(shard) != 1 or placements[shard[0]].dim != 0 or not all(p.is_shard() or p.is_replicate()
                                                                    for p in placements):
        return None
    return shard[0]


def _gather_bucket(bucket: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    import torch.distributed as dist

    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, t in bucket:
        d = _row_shard_dim(t)
        if d is None:
            yield name, full_tensor(t)
            continue
        groups.setdefault((id(t.device_mesh), d, t.dtype), []).append((name, t))
    for (_, mesh_dim, dtype), items in groups.items():
        group = items[0][1].device_mesh.get_group(mesh_dim)
        W = dist.get_world_size(group)
        pieces, shapes = [], []
        for _, t in items:
            rows, rest = t.shape[0], t[0].numel() if t.shape[0] else 0
            chunk = -(-rows // W)  # torch.chunk's (FSDP2's Shard(0)) rows per rank; the last ranks may hold fewer
            local = t.to_local().reshape(-1, rest)
            pieces.append(torch.nn.functional.pad(local, (0, 0, 0, chunk - local.shape[0])).reshape(-1))
            shapes.append((chunk, rest))
        flat = torch.cat(pieces)
        out = torch.empty(W * flat.numel(), dtype=dtype, device=flat.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name (torch 2.13)
        gather(out, flat, group=group)
        out = out.view(W, -1)
        off = 0
        for (name, t), (chunk, rest) in zip(items, shapes):
            whole = out[:, off:off + chunk * rest].reshape(W * chunk, rest)[: t.shape[0]]
            off += chunk * rest
            yield name, whole.reshape(t.shape)


class GatheredModel:
    """What `NativeEngine.from_hf` reads from an HF model (config, rope, a parameter's dtype, the state dict), for
    an FSDP2-sharded one: `state_dict()` streams full tensors from `stream()` (a collective every rank runs, e.g.
    `full_tensors_by_layer`), so a tensor-parallel engine is built from the trainer's shards without any GPU holding
    the full model."""

    def __init__(self, model, stream):
        self._base, self._stream = model, stream

    def state_dict(self):
        stream = self._stream

        class _Items:
            def items(self):
                return stream()

        return _Items()

    def __getattr__(self, name):
        base = self._base
        if hasattr(base, "get_base_model"):  # peft: the HF model's config and rotary embedding
            base = base.get_base_model()
        return getattr(base, name)
