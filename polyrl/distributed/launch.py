"""Starting the processes: `torchrun` when the user ran it, polyrl relaunching itself when the config asks for more.

`torchrun --nproc_per_node=N -m polyrl.train KEY=VALUE ...` is the plain way. `python -m polyrl.distributed.launch
... trainer.n_gpus_per_node=N` (and `polyrl train`, once the CLI calls `maybe_launch`) does the same by re-executing
itself under `torch.distributed.run` (standalone rendezvous on one node); `trainer.nnodes > 1` goes through Ray (`ray_cluster.launch_on_ray`), which starts one torchrun agent
per node. Inside a torchrun child nothing is relaunched: `WORLD_SIZE`/`RANK` are already set.
"""

from __future__ import annotations

import os
import subprocess
import sys

from polyrl.errors import ConfigError


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def torchrun_command(nproc_per_node: int, target: list[str], *, nnodes: int = 1, node_rank: int = 0,
                     master_addr: str | None = None, master_port: int | None = None) -> list[str]:
    """argv of `torch.distributed.run` for `target` (`["-m", "polyrl.train", ...]` or `["script.py", ...]`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}"]
    if nnodes == 1 and master_addr is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--master_addr={master_addr}",
                f"--master_port={master_port}"]
    return cmd + list(target)


def processes_wanted(cfg) -> int:
    t = cfg.trainer
    if t.n_gpus_per_node < 1 or t.nnodes < 1:
        raise ConfigError(f"trainer.n_gpus_per_node={t.n_gpus_per_node} and trainer.nnodes={t.nnodes} must both be "
                          "at least 1.")
    return t.n_gpus_per_node * t.nnodes + rollout_pool_size(cfg)


def rollout_pool_size(cfg) -> int:
    """Processes of the off-policy pipeline's rollout pool (trainer/async_ppo.py); 0 while the engine is colocated."""
    arr = getattr(cfg, "actor_rollout_ref", None)
    if arr is None or getattr(arr, "hybrid_engine", True):  # the flow trainer's config has no such key
        return 0
    return cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node


def maybe_launch(cfg, argv: list[str], *, module: str = "polyrl.train") -> int | None:
    """Run `module argv` as the job the config describes, if that is more than this one process.

    Returns the job's exit status, or None when the caller should simply train in this process (one process
    wanted, or already a torchrun child)."""
    if under_torchrun() or processes_wanted(cfg) == 1:
        return None
    if cfg.trainer.nnodes > 1:
        from polyrl.distributed.ray_cluster import launch_on_ray

        return launch_on_ray(cfg, argv, module=module)
    return subprocess.call(torchrun_command(processes_wanted(cfg), ["-m", module, *argv]))


def main(argv: list[str]) -> int:
    """`python -m polyrl.distributed.launch KEY=VALUE ...`: `polyrl train`, as many processes as the config asks."""
    from polyrl.cli import main as cli_main
    from polyrl.config import build_config
    from polyrl.errors import UserError
    from polyrl.trainer.config import PPOConfig

    try:
        code = maybe_launch(build_config(PPOConfig(), argv), argv)
    except UserError:
        code = None  # let `polyrl train` print the one-sentence error
    return cli_main(["train", *argv]) if code is None else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
