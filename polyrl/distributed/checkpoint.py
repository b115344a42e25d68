"""Sharded checkpoints with torch.distributed.checkpoint (DCP), in the same atomic layout as `utils/checkpoint.py`.

    <root>/global_step_N/dcp/          model + optimizer, one file per tensor shard plus `.metadata` (DCP's format)
    <root>/global_step_N/extra.pt      step, scheduler, sampler, RNG (plain objects, loaded with weights_only=True)
    <root>/global_step_N/huggingface/  optional full-weight HF export, written by rank 0
    <root>/latest_checkpointed_iteration.txt

Every rank writes its own shards (no rank ever holds the whole optimizer state), into one tmp folder whose name
rank 0 chooses and broadcasts; after a barrier rank 0 fsyncs, renames it to `global_step_N` and only then replaces
the "latest" file, exactly as the single-process `CheckpointManager` does. DCP stores tensors by fully-qualified
name with their global shapes, so a checkpoint written by N processes loads at any other count, including a plain
single process with no process group (resharding happens at load time).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from polyrl.distributed.env import DistEnv
from polyrl.utils.checkpoint import LATEST, CheckpointManager, _fsync_dir, _fsync_tree, _write_atomic_text

DCP_DIR = "dcp"


def is_sharded(path: str | Path) -> bool:
    return (Path(path) / DCP_DIR / ".metadata").is_file()


def optimizer_key(name: str) -> str:
    """The DCP key of a module's optimizer state: `optimizer` beside `model` (the policy), else `<name>_optimizer`."""
    return "optimizer" if name == "model" else f"{name}_optimizer"


def _model_optim_state(modules: dict) -> dict[str, Any]:
    """The trainable weights and their optimizer state of each (model, optimizer) pair in `modules` (name -> pair),
    under the pair's name and `optimizer_key(name)` (frozen weights, e.g. a LoRA base, are the model's own)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    out = {}
    for name, (model, optimizer) in modules.items():
        out[name], out[optimizer_key(name)] = get_state_dict(model, optimizer,
                                                             options=StateDictOptions(ignore_frozen_params=True))
    return out


def save_sharded(manager: CheckpointManager, step: int, modules: dict, extra: dict, env: DistEnv,
                 writers: dict[str, Callable[[Path], None]] | None = None) -> Path:
    """Collective: every rank calls it. `modules`: name -> (model, optimizer), the policy's under `model`. `writers`
    (name -> fn(dir)) are called on every rank with the folder they may write into (rank 0's is the real one), so
    they can run collectives such as gathering full weights."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    root = manager.root
    final = root / f"global_step_{step}"
    tmp = None
    if env.is_rank0:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"global_step_{step}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    tmp = Path(env.broadcast_object(str(tmp)))
    # one file per tensor: DCP's file writer keeps every CPU copy it wrote to a file until that file is closed (torch
    # 2.11-2.13), so one file per rank held the rank's whole shard in host memory during the save (a 20B full fine-tune
    # on 4 GPUs: 245 GB of copies beside the 245 GB written, and the host ran out of memory)
    writer = FileSystemWriter(tmp / DCP_DIR, single_file_per_rank=False)
    dcp.save(_model_optim_state(modules), storage_writer=writer)
    for name, write in (writers or {}).items():
        write(tmp / name)
    if env.is_rank0:
        torch.save(extra, tmp / "extra.pt")
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step after a resume: replace it whole
            old = root / f"global_step_{step}.old-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        _write_atomic_text(root / LATEST, str(step))
        manager._prune()
    env.barrier()  # nobody reads "latest" or moves on before the rename is visible
    return final


def load_sharded(path: str | Path, modules: dict) -> dict[str, Any]:
    """Load each (model, optimizer) pair of `modules` (name -> pair, as saved) from its shards into this process's
    (sharded or plain) modules; returns the `extra` dict."""
    from torch.distributed.checkpoint import FileSystemReader

    from polyrl.errors import ConfigError

    path = Path(path)
    saved = FileSystemReader(path / DCP_DIR).read_metadata().state_dict_metadata
    for name, (model, optimizer) in modules.items():
        if not any(key.startswith(f"{name}.") for key in saved):
            raise ConfigError(f"Checkpoint '{path}' holds no {name} state, which this run trains; resume a checkpoint "
                              "of the same setup or set trainer.resume_mode=disable.")
        _load_pair(path, name, model, optimizer, saved)
    return torch.load(path / "extra.pt", map_location="cpu", weights_only=True)


def _load_pair(path: Path, name: str, model, optimizer, saved) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    okey = optimizer_key(name)
    state = _model_optim_state({name: (model, optimizer)})
    groups = [dict(g) for g in state[okey]["param_groups"]]
    dcp.load({name: state[name]}, checkpoint_id=str(path / DCP_DIR))
    # a parameter that never had a gradient (the DiT's last block's text-stream outputs, some LoRA adapters there) has
    # no saved optimizer state...
    dcp.load({okey: state[okey]}, checkpoint_id=str(path / DCP_DIR), planner=DefaultLoadPlanner(allow_partial_load=True))
    # ...but get_state_dict gave every parameter a state (a zero-gradient step: step 1, zero moments): drop the ones
    # the checkpoint lacks, so that they stay stateless as in the run that saved it (the step count is AdamW's bias
    # correction the day such a parameter gets a gradient)
    stateful = {key.removeprefix(f"{okey}.state.").rsplit(".", 1)[0] for key in saved
                if key.startswith(f"{okey}.state.")}
    for fqn in [fqn for fqn in state[okey]["state"] if fqn not in stateful]:
        del state[okey]["state"][fqn]
    # per-parameter state is keyed by name, but the *grouping* depends on the process count (sharded and replicated
    # parameters are separate groups only when sharded): keep this process's groups, with the saved hyper-parameters
    # (all groups share them; the LR in them is where the schedule was)
    hyper = state[okey]["param_groups"][0]
    state[okey]["param_groups"] = [{**g, **{k: v for k, v in hyper.items() if k != "params"}} for g in groups]
    # not strict: the frozen weights are not in the checkpoint (dcp.load above already failed on a missing trainable one)
    set_state_dict(model, optimizer, model_state_dict=state[name], optim_state_dict=state[okey],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))


def gather_full_state_dict(named, env: DistEnv) -> dict[str, torch.Tensor]:
    """Full CPU tensors on rank 0 (empty dict elsewhere), gathered one tensor at a time (collective)."""
    from polyrl.distributed.weights import full_tensors

    out = {}
    for name, t in full_tensors(named):
        if env.is_rank0:
            out[name] = t.to("cpu", copy=True)
    return out


def without_aliases(full: dict[str, torch.Tensor], like) -> dict[str, torch.Tensor]:
    """Drop names that `like` (an HF model, LoRA layers and all) stores as aliases of an earlier weight (tied
    embeddings), as `save_pretrained` would on its own state dict."""
    seen, keep = set(), {}
    for name, t in like.state_dict().items():
        if ".lora_" in name:
            continue
        name = name.replace(".base_layer", "")  # peft's wrapped layers: `full` has the HF names (merged_state_dict)
        key = (t.data_ptr(), t.shape)
        if key not in seen and name in full:
            keep[name] = full[name]
        seen.add(key)
    return keep


def regroup_scheduler_state(state: dict, num_groups: int) -> dict:
    """An LR scheduler's state saved with another number of optimizer groups (see `load_sharded`): per-group lists
    are cut or extended to `num_groups` (all groups share one schedule, so element 0 stands for all)."""
    out = dict(state)
    for key, value in state.items():
        if key in ("base_lrs", "_last_lr", "lr_lambdas") and isinstance(value, list) and len(value) != num_groups:
            out[key] = [value[0]] * num_groups
    return out
