"""Point-to-point links between the trainer and the rollout process of one torch.distributed job (async_ppo.py).

Two one-way streams, so neither side can block the other by sending at the same time:
- `send_object` / `recv_object`: pickled Python objects (rollout batches, the start-up handshake) as CPU byte tensors,
  always over gloo (with NCCL on the GPUs the job is `cpu:gloo,cuda:nccl`, and CPU tensors take gloo), on a gloo
  group of their own (`object_link`), so that a thread may send objects while another receives weights.
- `WeightSender` / `WeightReceiver`: the trainer's weights, flattened into buckets of at most `bucket_bytes` (one
  dtype per bucket) and sent with `isend`, so the trainer goes on to its next stage while they travel (over NCCL on
  GPUs). Both ends derive the same bucket plan from the same `(name, shape, dtype)` list: only values travel.

A peer that died shows up as a RuntimeError inside a send or receive (gloo sees the connection close); the
pipeline (trainer/async_ppo.py) turns that into one sentence.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

OBJECT_TAG = 1
WEIGHT_TAG = 2


def object_link():
    """The gloo group objects travel on; every rank of the job calls this once, in the same order."""
    return dist.new_group(list(range(dist.get_world_size())), backend="gloo")


def send_object(obj: Any, dst: int, group=None) -> list:
    """Start sending `obj` to rank `dst` (over `group`, an `object_link`); returns the pending works (keep them until
    they are waited on)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    return [dist.isend(size, dst, group=group, tag=OBJECT_TAG), dist.isend(payload, dst, group=group, tag=OBJECT_TAG)]


def recv_object(src: int, group=None) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group, tag=OBJECT_TAG)
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(payload, src, group=group, tag=OBJECT_TAG)
    return pickle.loads(payload.numpy().tobytes())


@dataclass(frozen=True)
class Bucket:
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)


def bucket_plan(spec: Iterable[tuple[str, torch.Size, torch.dtype]], bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors grouped into buckets of one dtype and at most `bucket_bytes` (a bigger tensor alone)."""
    buckets: list[Bucket] = []
    names, shapes, dtype, nbytes = [], [], None, 0
    for name, shape, dt in spec:
        size = shape.numel() * dt.itemsize
        if names and (dt != dtype or nbytes + size > bucket_bytes):
            buckets.append(Bucket(tuple(names), tuple(shapes), dtype))
            names, shapes, nbytes = [], [], 0
        names.append(name)
        shapes.append(shape)
        dtype, nbytes = dt, nbytes + size
    if names:
        buckets.append(Bucket(tuple(names), tuple(shapes), dtype))
    return buckets


def tensor_spec(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Size, torch.dtype]]:
    return [(n, t.shape, t.dtype) for n, t in named]


class WeightSender:
    """Trainer side: `send(named_tensors)` packs each bucket (a copy, so training may go on) and posts its isend."""

    def __init__(self, dst: int, bucket_bytes: int):
        self.dst, self.bucket_bytes = dst, bucket_bytes
        self._pending: list = []  # works and the buffers they read, alive until waited

    def send(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Post every bucket; returns the bytes sent. The previous send is waited for first (one in flight)."""
        self.wait()
        named = list(named)
        tensors = dict(named)
        sent = 0
        for b in bucket_plan(tensor_spec(named), self.bucket_bytes):
            flat = torch.cat([tensors[n].detach().reshape(-1) for n in b.names])
            self._pending.append((dist.isend(flat, self.dst, tag=WEIGHT_TAG), flat))
            sent += flat.numel() * flat.element_size()
        return sent

    def wait(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []


class WeightReceiver:
    """Rollout side: receives the buckets `WeightSender` posts into `(name, view)` pairs, in the sender's order."""

    def __init__(self, src: int, spec: list[tuple[str, torch.Size, torch.dtype]], bucket_bytes: int,
                 device: torch.device):
        self.src, self.device = src, device
        self.plan = bucket_plan(spec, bucket_bytes)

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields each tensor (a view into its bucket) as soon as its bucket has arrived."""
        for b in self.plan:
            flat = torch.empty(b.numel, dtype=b.dtype, device=self.device)
            dist.recv(flat, self.src, tag=WEIGHT_TAG)
            offset = 0
            for name, shape in zip(b.names, b.shapes):
                yield name, flat[offset:offset + shape.numel()].view(shape)
                offset += shape.numel()
