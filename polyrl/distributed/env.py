"""`DistEnv`: the one object that owns the process group, this rank's device and the device mesh.

Everything parallel in polyrl asks this object (never `os.environ` or `torch.distributed` directly), so a
single-process run is just `DistEnv` with `world_size == 1` and every collective below is a no-op.

Backend: nccl on CUDA, gloo on CPU. The data-parallel mesh is 1-D (`dp_shard`: plain FSDP over all ranks) unless
`fsdp_size` divides the world into shard groups, then it is 2-D (`dp_replicate`, `dp_shard`): HSDP, each group of
`fsdp_size` ranks holds one sharded copy and the groups all-reduce gradients.

Ulysses sequence parallelism (`sp_size > 1`, distributed/ulysses.py) views the world as `dp x sp`: `sp_size`
consecutive ranks (one node's NVLink neighbours) form an SP group that trains the same rows, split by tokens, so the
*data* is sharded over `dp_size = world_size / sp_size` groups (`dp_rank`, `dp_size`), while FSDP still shards the
model over the whole world (`mesh`). `env.data` is the data-parallel view: a `DistEnv` whose rank, world size and
collectives are those of the data shards (one rank per SP group), for whatever deals out or counts rows (prompt
sharding, batch balancing, loss normalisers, metric sums). With `sp_size == 1`, `env.data` is `env` itself.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from polyrl.errors import ConfigError


def launched_world_size() -> int:
    """Processes in this job as set by torchrun (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class DistEnv:
    rank: int = 0
    """Global rank of this process."""
    world_size: int = 1
    """Number of processes (FSDP shards the model over all of them)."""
    local_rank: int = 0
    """Rank on this node (selects the GPU)."""
    device: torch.device = torch.device("cpu")
    """This rank's device."""
    mesh: Any = None
    """torch DeviceMesh for FSDP2 (None in a single process)."""
    sp_size: int = 1
    """Ulysses sequence-parallel degree: consecutive ranks sharing one micro-batch."""
    sp_group: Any = None
    """ProcessGroup of this rank's SP group (None when sp_size == 1)."""
    dp_group: Any = None
    """ProcessGroup of the ranks with this rank's sp_rank, one per data shard (None: the whole world)."""
    group: Any = None
    """ProcessGroup this object's collectives run over (None: the whole world; `data` views set it)."""

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_size

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank trains (ranks of one SP group share it)."""
        return self.rank // self.sp_size

    @property
    def dp_size(self) -> int:
        """Number of data shards: processes that train different rows."""
        return self.world_size // self.sp_size

    @property
    def data(self) -> "DistEnv":
        """The data-parallel view: `rank`/`world_size` are `dp_rank`/`dp_size` and collectives run over the data
        shards (one rank per SP group), so rows an SP group shares are dealt, gathered and counted once."""
        if self.sp_size == 1:
            return self
        return DistEnv(rank=self.dp_rank, world_size=self.dp_size, local_rank=self.local_rank, device=self.device,
                       group=self.dp_group)

    @property
    def sp(self):
        """`ulysses.SeqParallel` for the packed forward, or None without sequence parallelism."""
        if self.sp_size == 1:
            return None
        from polyrl.distributed.ulysses import SeqParallel

        return SeqParallel(group=self.sp_group, rank=self.sp_rank, size=self.sp_size)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @classmethod
    def setup(cls, device: str = "auto", *, fsdp_size: int = -1, sp_size: int = 1, timeout_s: int = 600,
              cpu_offload: bool = False) -> "DistEnv":
        """Join the torchrun job described by the environment (or stay single-process) and build the mesh.

        `cpu_offload`: FSDP2's CPUOffloadPolicy keeps the shards (and their gradients) on the CPU, so the collectives
        over them (gradient norm, weight sync, checkpoint gathers) need a CPU backend: gloo beside nccl, as
        torchtitan does."""
        world = launched_world_size()
        if sp_size < 1 or world % sp_size:
            raise ConfigError(f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp_size} does not divide the "
                              f"{world} processes; use a divisor of {world}.")
        if world == 1:
            return cls(device=_pick_device(device, 0))
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        dev = _pick_device(device, local_rank)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            backend = "gloo" if dev.type != "cuda" else "cpu:gloo,cuda:nccl" if cpu_offload else "nccl"
            dist.init_process_group(backend,
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=dev if dev.type == "cuda" else None)
        sp_group = dp_group = None
        if sp_size > 1:
            from torch.distributed.device_mesh import init_device_mesh

            grid = init_device_mesh(dev.type, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
            sp_group, dp_group = grid.get_group("sp"), grid.get_group("dp")
        return cls(rank=rank, world_size=world, local_rank=local_rank, device=dev,
                   mesh=build_mesh(dev.type, world, fsdp_size), sp_size=sp_size, sp_group=sp_group,
                   dp_group=dp_group)

    # ------------------------------------------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduced copy of `t` over this env's ranks (`t` itself when single-process)."""
        if not self.is_distributed:
            return t
        out = t.detach().clone()
        dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op],
                        group=self.group)
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.is_distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` (of this env's ranks) on every rank."""
        if not self.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def share_with_sp_group(self, obj: Any) -> Any:
        """The SP group's first rank's `obj` on every rank of the group: the ranks of a group must train identical
        rows, and rollouts sampled on two GPUs need not be bit-identical even with one seed. Tensors (in dicts,
        lists, tuples) travel through the CPU and come back on this rank's device."""
        if self.sp_size == 1:
            return obj
        box = [_map_tensors(obj, lambda t: t.cpu())]
        dist.broadcast_object_list(box, group=self.sp_group, group_src=0)
        return _map_tensors(box[0], lambda t: t.to(self.device))

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier(group=self.group)

    @property
    def _owns_process_group(self) -> bool:
        return self.group is None and self.is_distributed and dist.is_initialized()  # views own no process group

    def close(self) -> None:
        if self._owns_process_group:
            dist.destroy_process_group()

    def finish(self) -> None:
        """The end of a successful run: wait for every rank (rank 0 may still be writing files after the last
        collective), then tear the process group down instead of leaving it to interpreter exit."""
        if self._owns_process_group:
            self.barrier()
        self.close()


def _map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def use_expandable_segments() -> None:
    """Let the CUDA caching allocator grow mapped segments instead of carving fixed blocks (PyTorch's
    `expandable_segments`, on by default in vLLM and torchtitan). Packed micro-batches change length every step and
    fragment fixed blocks: on 2 H100s (1.5B, responses up to 4k, auto token budget) step 1 fit and step 2 ran out of
    memory, with one process and with two. A user's own PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF setting of it
    is kept."""
    conf = os.environ.get("PYTORCH_ALLOC_CONF", "") + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" not in conf:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def local_device(name: str = "auto") -> torch.device:
    """The device this process will train on (trainer.device and torchrun's LOCAL_RANK), before the job is joined."""
    return _pick_device(name, int(os.environ.get("LOCAL_RANK", "0")))


def _pick_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.device={name} but no CUDA GPU is visible; use trainer.device=cpu or auto.")
        use_expandable_segments()
        return torch.device("cuda", local_rank if ":" not in name else int(name.split(":")[1]))
    return torch.device(name)


def build_mesh(device_type: str, world_size: int, fsdp_size: int):
    """1-D FSDP mesh, or 2-D HSDP (replicate x shard) when 0 < fsdp_size < world_size."""
    from torch.distributed.device_mesh import init_device_mesh

    if fsdp_size <= 0 or fsdp_size >= world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp_shard",))
    if world_size % fsdp_size:
        raise ConfigError(f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size} does not divide the "
                          f"{world_size} processes; use a divisor of {world_size} or -1 (shard over all).")
    return init_device_mesh(device_type, (world_size // fsdp_size, fsdp_size),
                            mesh_dim_names=("dp_replicate", "dp_shard"))
