"""`DistEnv`: the one object that owns the process group, this rank's device and the device mesh.

Everything parallel in polyrl asks this object (never `os.environ` or `torch.distributed` directly), so a
single-process run is just `DistEnv` with `world_size == 1` and every collective below is a no-op.

Backend: nccl on CUDA, gloo on CPU. The data-parallel mesh is 1-D (`dp_shard`: plain FSDP over all ranks) unless
`fsdp_size` divides the world into shard groups, then it is 2-D (`dp_replicate`, `dp_shard`): HSDP, each group of
`fsdp_size` ranks holds one sharded copy and the groups all-reduce gradients.
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
    """Number of data-parallel processes."""
    local_rank: int = 0
    """Rank on this node (selects the GPU)."""
    device: torch.device = torch.device("cpu")
    """This rank's device."""
    mesh: Any = None
    """torch DeviceMesh for FSDP2 (None in a single process)."""

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @classmethod
    def setup(cls, device: str = "auto", *, fsdp_size: int = -1, timeout_s: int = 600) -> "DistEnv":
        """Join the torchrun job described by the environment (or stay single-process) and build the mesh."""
        world = launched_world_size()
        if world == 1:
            return cls(device=_pick_device(device, 0))
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        dev = _pick_device(device, local_rank)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s),
                                    device_id=dev if dev.type == "cuda" else None)
        return cls(rank=rank, world_size=world, local_rank=local_rank, device=dev,
                   mesh=build_mesh(dev.type, world, fsdp_size))

    # ------------------------------------------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduced copy of `t` over all ranks (`t` itself when single-process)."""
        if not self.is_distributed:
            return t
        out = t.detach().clone()
        dist.all_reduce(out, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.is_distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    def close(self) -> None:
        if self.is_distributed and dist.is_initialized():
            dist.destroy_process_group()


def _pick_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.device={name} but no CUDA GPU is visible; use trainer.device=cpu or auto.")
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
