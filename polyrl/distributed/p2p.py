"""Point-to-point links between the trainer and rollout processes of the off-policy job (trainer/async_ppo.py).

Each role runs in a torch.distributed world of its own (the trainer's FSDP ranks; the rollout replicas and their
tensor-parallel groups), so every collective of either side is the on-policy code's, unchanged. `Link` is the one
job-wide group beside them, used only point to point and only through its own handle:
- `send_object` / `recv_object`: pickled Python objects (batches, the start-up handshake) as CPU byte tensors over
  gloo.
- `WeightSender` / `WeightReceiver`: the trainer's weights, flattened into buckets (one dtype each, at most
  `bucket_bytes`, never spanning two decoder layers) and sent with isend (over NCCL between GPUs). A sender serves
  several rollout processes, each with its own cut of every tensor (a tensor-parallel rank's slice); both ends derive
  the same bucket plan from the same `(name, shape, dtype)` list, so only values travel.

A peer that died shows up as a RuntimeError inside a send or receive (gloo sees the connection close); the
pipeline (trainer/async_ppo.py) turns that into one sentence.
"""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

OBJECT_TAG = 1
WEIGHT_TAG = 2


class Link:
    """The job-wide point-to-point groups (every process of the job builds it, with its job rank): gloo for objects
    (and weights on CPU), NCCL for weights between GPUs. Built on the job's rendezvous store, under a prefix of its
    own, beside the two roles' worlds."""

    def __init__(self, store, rank: int, world_size: int, timeout: datetime.timedelta, cuda: bool):
        self.rank, self.world_size = rank, world_size
        self.objects = dist.ProcessGroupGloo(dist.PrefixStore("polyrl/link/gloo/", store), rank, world_size, timeout)
        self.weights = self.objects
        if cuda:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.weights = dist.ProcessGroupNCCL(dist.PrefixStore("polyrl/link/nccl/", store), rank, world_size,
                                                 opts)


def send_object(obj: Any, dst: int, group) -> list:
    """Start sending `obj` to rank `dst` of `group`; returns the pending works (keep them until waited on)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    return [(group.send([size], dst, OBJECT_TAG), size), (group.send([payload], dst, OBJECT_TAG), payload)]


def wait_all(works: list) -> None:
    for work, _ in works:
        work.wait()


def recv_object(src: int, group) -> Any:
    size = torch.zeros(1, dtype=torch.int64)
    group.recv([size], src, OBJECT_TAG).wait()
    payload = torch.empty(int(size), dtype=torch.uint8)
    group.recv([payload], src, OBJECT_TAG).wait()
    return pickle.loads(payload.numpy().tobytes())


@dataclass(frozen=True)
class Bucket:
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)


def bucket_plan(spec: Iterable[tuple[str, torch.Size, torch.dtype]], bucket_bytes: int,
                split: Callable[[str], str] | None = None) -> list[Bucket]:
    """Consecutive tensors grouped into buckets of one dtype and at most `bucket_bytes` (a bigger tensor alone);
    with `split`, a new bucket also starts where `split(name)` changes (`weights.layer_key`: a decoder layer each)."""
    buckets: list[Bucket] = []
    names, shapes, dtype, nbytes, key = [], [], None, 0, None
    for name, shape, dt in spec:
        size = shape.numel() * dt.itemsize
        k = split(name) if split else None
        if names and (dt != dtype or nbytes + size > bucket_bytes or k != key):
            buckets.append(Bucket(tuple(names), tuple(shapes), dtype))
            names, shapes, nbytes = [], [], 0
        names.append(name)
        shapes.append(shape)
        dtype, nbytes, key = dt, nbytes + size, k
    if names:
        buckets.append(Bucket(tuple(names), tuple(shapes), dtype))
    return buckets


def tensor_spec(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Size, torch.dtype]]:
    return [(n, t.shape, t.dtype) for n, t in named]


Cut = Callable[[str, torch.Tensor], torch.Tensor]  # (name, full tensor) -> what one receiver gets (its TP slice)


class WeightSender:
    """Trainer side: `send(named)` streams full tensors (in plan order) to every destination `(rank, cut)` it
    serves; each bucket is packed (a copy, so training may go on) and posted with isend. At most
    `max_in_flight_bytes` of packed buckets wait for their receivers (None: a whole version may; the sender then
    holds one copy of what it sends). A trainer rank that serves nobody still consumes the stream: with several
    trainer ranks it is a sequence of collectives (weights.full_tensors_by_layer)."""

    def __init__(self, group, dests: list[tuple[int, Cut | None]], plan: list[Bucket],
                 max_in_flight_bytes: int | None = None):
        self.group, self.dests, self.plan, self.max_in_flight = group, dests, plan, max_in_flight_bytes
        self._pending: list = []  # (work, the buffer it reads), oldest first
        self.error: RuntimeError | None = None  # a failed send: kept (see `check`), the stream still consumed

    def send(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Post every bucket; returns the bytes sent. The previous version is waited for first."""
        self.wait()
        buckets, sent = iter(self.plan), 0
        bucket, have = next(buckets, None), [[] for _ in self.dests]
        for name, full in named:
            if not self.dests or self.error is not None:
                continue
            assert bucket is not None and name == bucket.names[len(have[0])], (name, bucket)
            for pieces, (_, cut) in zip(have, self.dests):
                t = cut(name, full) if cut is not None else full
                pieces.append(t.detach().reshape(-1))
            if len(have[0]) == len(bucket.names):
                for pieces, (rank, _) in zip(have, self.dests):
                    flat = torch.cat(pieces)
                    self._guard(lambda: self._pending.append((self.group.send([flat], rank, WEIGHT_TAG), flat)))
                    sent += flat.numel() * flat.element_size()
                    self._bound()
                bucket, have = next(buckets, None), [[] for _ in self.dests]
        assert not self.dests or self.error is not None or bucket is None, "the weights stream ended before the plan"
        return sent

    def _bound(self) -> None:
        if self.max_in_flight is None:
            return
        while self._pending and sum(b.numel() * b.element_size() for _, b in self._pending) > self.max_in_flight:
            work, _ = self._pending.pop(0)
            self._guard(work.wait)

    def _guard(self, fn) -> None:
        """A peer that died fails the send: keep the error for `check` and send no more, so the caller (one of
        several trainer ranks, all inside the stream's collectives) reaches the point where they stop together."""
        if self.error is not None:
            return
        try:
            fn()
        except RuntimeError as e:
            self.error, self._pending = e, []

    def wait(self) -> None:
        for work, _ in self._pending:
            self._guard(work.wait)
        self._pending = []

    def check(self) -> None:
        """Raise the error of a send that failed (a RuntimeError, as a failed receive's)."""
        if self.error is not None:
            raise RuntimeError(f"a weights send failed: {self.error}")


class WeightReceiver:
    """Rollout side: receives the buckets of `plan` from rank `src` into `(name, view)` pairs, in the plan's order."""

    def __init__(self, group, src: int, plan: list[Bucket], device: torch.device):
        self.group, self.src, self.plan, self.device = group, src, plan, device

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields each tensor (a view into its bucket) as soon as its bucket has arrived."""
        for b in self.plan:
            flat = torch.empty(b.numel, dtype=b.dtype, device=self.device)
            self.group.recv([flat], self.src, WEIGHT_TAG).wait()
            offset = 0
            for name, shape in zip(b.names, b.shapes):
                yield name, flat[offset:offset + shape.numel()].view(shape)
                offset += shape.numel()
