"""Data-parallel FlowGRPO: the DiT sharded with FSDP2, rewards gathered for the advantages, trainable state
gathered for checkpoints. In a single process every function here is a no-op or a plain copy.

- Ranks start from rank 0's weights (broadcast before sharding): FSDP2 shards each rank's *own* copy, and a LoRA
  init draws from each rank's RNG.
- Compute runs in `compute_dtype`: the dtype most weights have (LoRA adapters kept in fp32 on a bf16 base then
  compute in bf16 too), or, on GPU, a lower `fsdp_config.mixed_precision.param_dtype`, which fp32 weights default
  to `fsdp_config.dtype` (bf16: verl's mixed precision, fp32 weights, gradients and AdamW state, sharded, with bf16
  forwards and backwards). FSDP2 casts each block's weights to it when it gathers them; the DiT's root unit owns the
  weights outside the blocks too and casts the forward's floating inputs, so every matmul sees one dtype. On GPU the
  gradient reduction runs in `fsdp_config.mixed_precision.reduce_dtype` (fp32 by default). A `param_dtype` wider
  than the weights is refused. One process does the same with fp32 masters (polyrl.learner.master_weights).
- Checkpoints hold the trainable weights and their AdamW state as *full* tensors, gathered one tensor at a time to
  rank 0, which writes them with the single-process `CheckpointManager` (atomic). The files are the same at any
  process count, so a checkpoint loads at any other count. Cost: rank 0's host memory holds the whole trainable
  state with both Adam moments (small for LoRA, 3x the weights for full fine-tuning).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch

from polyrl.distributed import DistEnv
from polyrl.distributed.weights import full_tensor
from polyrl.errors import ConfigError
from polyrl.utils.device import to_dtype


def weight_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype holding most of the module's weights (the base's, when LoRA adapters are kept in fp32)."""
    counts: Counter = Counter()
    for p in module.parameters():
        counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0]


_WIDTH = {torch.float32: 2, torch.bfloat16: 1, torch.float16: 1}


def compute_dtype(module: torch.nn.Module, fsdp_cfg, device: torch.device) -> torch.dtype:
    """The dtype the DiT's forwards and backwards run in on GPU: `fsdp_config.mixed_precision.param_dtype` when set
    (it may be lower than the weights: fp32 masters, bf16 compute); else, for fp32 weights, `fsdp_config.dtype`
    (bfloat16 by default: verl's mixed precision); else the weights' dtype. The CPU computes in the weights' dtype,
    as the LLM actor does."""
    dtype = weight_dtype(module)
    asked = (fsdp_cfg.mixed_precision or {}).get("param_dtype")
    key = "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"
    if asked is None and dtype == torch.float32:
        asked, key = fsdp_cfg.dtype, "actor_rollout_ref.actor.fsdp_config.dtype"
    if asked is None:
        return dtype
    want = to_dtype(asked, key)
    if want != dtype and _WIDTH.get(want, 0) >= _WIDTH.get(dtype, 0):
        name = str(dtype).removeprefix("torch.")
        raise ConfigError(
            f"{key}={asked} is not a lower precision than the transformer's {name} weights; set "
            "actor_rollout_ref.model.dtype=float32 to keep fp32 weights and compute in it, or leave param_dtype unset."
        )
    return want if torch.device(device).type == "cuda" else dtype


def shard_transformer(module: torch.nn.Module, env: DistEnv, fsdp_cfg) -> None:
    """FSDP2 per transformer block (polyrl.distributed.parallelize), in place, after syncing rank 0's weights."""
    if not env.is_distributed:
        return
    import torch.distributed as dist

    from polyrl.distributed.parallelize import parallelize

    name = str(compute_dtype(module, fsdp_cfg, env.device)).removeprefix("torch.")
    if fsdp_cfg.cpu_offload and env.device.type != "cuda":
        raise ConfigError(
            "actor_rollout_ref.actor.fsdp_config.param_offload/optimizer_offload/offload_policy move GPU memory to the "
            "CPU, but this run is on the CPU; turn them off."
        )
    with torch.no_grad():
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
    parallelize(module, env.mesh, replace(fsdp_cfg, dtype=name), env.device)


def gather_rows(env: DistEnv, values_B: torch.Tensor, row_ids: list[int], num_rows: int) -> torch.Tensor:
    """Every rank's rows placed at their global index: the whole batch's [num_rows] values on every rank."""
    out = torch.empty(num_rows, dtype=values_B.dtype)
    for ids, vals in env.all_gather_object((list(row_ids), values_B.detach().cpu())):
        out[torch.tensor(ids, dtype=torch.long)] = vals
    return out


# --------------------------------------------------------------------------- checkpoints

def _trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters by name, sharded: FSDP2 leaves a block that skips resharding after forward (the
    last one) with its unsharded parameters registered until the next backward, so reshard first."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def gather_trainable_state(module, optimizer, env: DistEnv, named=None) -> tuple[dict, dict]:
    """Collective. Full CPU copies of the trainable weights and of their optimizer state ("name/key" -> tensor),
    on rank 0 (empty dicts elsewhere). `named`: (name, parameter) pairs the optimizer steps, when they are not the
    module's own (fp32 masters, training/master_weights.py)."""
    weights, optim = {}, {}
    for name, p in named or _trainable(module):
        full = full_tensor(p.detach())
        if env.is_rank0:
            weights[name] = full.to("cpu", copy=True)
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            full = full_tensor(value) if torch.is_tensor(value) else torch.tensor(value)
            if env.is_rank0:
                optim[f"{name}/{key}"] = full.to("cpu", copy=True)
    return weights, optim


def load_trainable_state(module, optimizer, weights: dict, optim: dict, named=None) -> None:
    """Copy full tensors (from `gather_trainable_state`, any process count) into this rank's (sharded) parameters
    and optimizer state. Collective when the module is sharded (each sharded tensor is scattered)."""
    per_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in optim.items():
        name, k = key.rsplit("/", 1)
        per_param.setdefault(name, {})[k] = t
    with torch.no_grad():
        for name, p in named or _trainable(module):
            p.copy_(_like(p, weights[name]))
            if name in per_param:
                optimizer.state[p] = {k: t.clone() if t.ndim == 0 else _like(p, t) for k, t in per_param[name].items()}


def _like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `param`: this rank's shard of it, on the shard's device, when `param` is an FSDP2 DTensor."""
    if not hasattr(param, "device_mesh"):
        return full.to(param.device)
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh = param.device_mesh
    local = distribute_tensor(full.to(mesh.device_type), mesh, param.placements).to_local()
    # CPU offload keeps the local shards in host memory while the mesh is on the GPU
    return DTensor.from_local(local.to(param.to_local().device), mesh, param.placements, shape=param.shape,
                              stride=param.stride())
