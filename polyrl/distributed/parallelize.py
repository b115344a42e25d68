"""`parallelize(model, mesh, cfg)`: FSDP2 applied from outside the model code (torchtitan's shape).

Each transformer block is its own `fully_shard` unit (its parameters are all-gathered just before the block runs and
freed after, so peak memory holds one block's full weights, not the model's); the root call then shards what is
left (embeddings, final norm, lm_head). Parameter names are unchanged, so HF names still address every weight.

Knobs (verl's `fsdp_config` keys): `reshard_after_forward`, mixed precision (`mixed_precision.param_dtype` /
`reduce_dtype`, default bf16 compute with fp32 gradient reduction on GPU; CPU stays fp32 because gloo and CPU
matmuls gain nothing from bf16), `forward_prefetch` (explicit prefetch of the next block's all-gather), CPU offload
(`param_offload`, `optimizer_offload` or `offload_policy`: FSDP2 keeps parameters, gradients and hence optimizer
state on the CPU, all three together) and `fsdp_size` (the mesh, built by `DistEnv`).

Blocks and root of a diffusers DiT (the FlowGRPO trainer): its `*transformer_blocks` lists, and the transformer itself.
A DiT reads every weight inside its own forward, so the root unit shards the patch/text/time embeddings and output
projection too, and casts the forward's floating inputs (latents, embeddings, timesteps) to `param_dtype`: with fp32
weights and bf16 compute, every module then sees bf16 weights and bf16 inputs.

Which module is the FSDP root of a causal LM: the *decoder* (`model.get_decoder()`), not the whole causal LM,
because the actor's forward path runs the decoder and then reads `lm_head.weight` directly for chunked log-probs (no
`[tokens, vocab]` logits tensor). A parameter read outside its FSDP unit's forward would still be a shard, so the
parameters outside the blocks (embeddings, final norm, LM head; tied or not) stay plain replicated tensors, and a
gradient hook all-reduces their gradient contribution on every backward, averaging like FSDP does. Cost: those
weights and their Adam state are replicated on every rank (~2.8 GB fp32 with Adam for Qwen2.5-1.5B's tied
151936x1536 embedding); the blocks, which hold the rest, are sharded.
"""

from __future__ import annotations

import torch
from torch import nn

from polyrl.utils.device import to_dtype


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: a diffusers DiT's `*transformer_blocks` lists (FLUX has two: double- and single-stream),
    else the `ModuleList` with most params (an HF causal LM's decoder layers, also under a peft wrapper)."""
    lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList) and len(mod) > 0]
    dit = [mod for name, mod in lists if name.rsplit(".", 1)[-1].endswith("transformer_blocks")]
    if dit:
        return [block for mod in dit for block in mod]
    assert lists, "model has no ModuleList of blocks to shard"
    return list(max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))[1])


def mixed_precision_policy(cfg, device: torch.device, cast_inputs: bool = False):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device.type != "cuda":
        return MixedPrecisionPolicy()
    mp = cfg.mixed_precision or {}
    param = to_dtype(mp.get("param_dtype", cfg.dtype), "fsdp_config.mixed_precision.param_dtype")
    reduce = to_dtype(mp.get("reduce_dtype", "float32"), "fsdp_config.mixed_precision.reduce_dtype")
    # blocks: cast_forward_inputs=False: autocast (the actor's) decides activation dtypes, as in one process; FSDP
    # casting block inputs (e.g. fp32 RoPE cos/sin) to bf16 in forward but not in a checkpointed recompute breaks
    # gradient checkpointing ("recomputed values have different metadata"). A DiT's root casts (`cast_inputs`): its
    # forward is never recomputed, only the blocks inside it.
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, cast_forward_inputs=cast_inputs)


def parallelize(model: nn.Module, mesh, cfg, device: torch.device) -> nn.Module:
    """Shard `model` in place with FSDP2 per block and at the root; returns it (same object, same names)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    kw = dict(mesh=mesh, mp_policy=mixed_precision_policy(cfg, device), offload_policy=offload)
    blocks = transformer_blocks(model)
    block_params = {id(p) for b in blocks for p in b.parameters()}
    replicated = [p for p in model.parameters() if id(p) not in block_params]
    for i, block in enumerate(blocks):
        # the last block's weights are needed again first in backward: keeping them saves one all-gather
        reshard = cfg.reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard, **kw)
    root = _fsdp_root(model)
    if _is_dit(model):  # the root owns the rest (module docstring)
        fully_shard(root, reshard_after_forward=cfg.reshard_after_forward,
                    **{**kw, "mp_policy": mixed_precision_policy(cfg, device, cast_inputs=True)})
    else:
        fully_shard(root, reshard_after_forward=cfg.reshard_after_forward,
                    ignored_params={p for p in root.parameters() if id(p) not in block_params}, **kw)
        for p in replicated:  # FSDP leaves ignored parameters where they are: a policy loaded on the host (rollout TP)
            p.data = p.data.to(device)
        _all_reduce_grads_of(replicated)
    if cfg.forward_prefetch:
        prefetch_forward(blocks)
    return model


def prefetch_forward(blocks: list[nn.Module]) -> None:
    """`fsdp_config.forward_prefetch`: each block's forward first issues the next block's all-gather, so it overlaps
    this block's compute even when the CPU is not running ahead of the GPU (FSDP2's implicit prefetch needs that).
    Costs one more block's full weights in memory during forward."""
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])


def _is_dit(model: nn.Module) -> bool:
    """A diffusers transformer (blocks in `*transformer_blocks` lists), not a causal LM."""
    base = _base(model)
    return not hasattr(base, "get_decoder") and any(
        isinstance(mod, nn.ModuleList) and name.rsplit(".", 1)[-1].endswith("transformer_blocks")
        for name, mod in base.named_modules())


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _fsdp_root(model: nn.Module) -> nn.Module:
    """An HF causal LM's decoder (see the module docstring); a diffusers transformer is its own root."""
    base = _base(model)
    return base.get_decoder() if hasattr(base, "get_decoder") else base


def _all_reduce_grads_of(params: list[nn.Parameter]) -> None:
    """Average each backward's gradient contribution over all ranks before it is accumulated (DDP-style)."""
    import torch.distributed as dist

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)  # over the whole job: replicated on every rank, HSDP or not
        return grad / dist.get_world_size()

    for p in params:
        if p.requires_grad:
            p.register_hook(hook)


def parallelize_frozen(model: nn.Module, mesh, cfg, device: torch.device) -> nn.Module:
    """The reference policy: same sharding, no gradients, always resharded (it only runs forward)."""
    from dataclasses import replace

    return parallelize(model, mesh, replace(cfg, reshard_after_forward=True), device)


def param_groups(model: nn.Module) -> list:
    """Trainable parameters for the optimizer: one group per kind (FSDP-sharded DTensors, replicated plain tensors),
    because fused/foreach optimizers refuse a list that mixes the two. A plain list when nothing is sharded."""
    params = [p for p in model.parameters() if p.requires_grad]
    sharded = [p for p in params if hasattr(p, "full_tensor")]
    if not sharded:
        return params
    return [{"params": sharded}, {"params": [p for p in params if not hasattr(p, "full_tensor")]}]
