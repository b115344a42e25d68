"""Starting the processes: `torchrun` when the user ran it, polyrl relaunching itself when the job asks for more.

`torchrun --nproc_per_node=N -m polyrl.train KEY=VALUE ...` is the plain way. `polyrl train ...
trainer.n_gpus_per_node=N` does the same by re-executing itself under `torch.distributed.run` (standalone rendezvous
on one node); `trainer.nnodes > 1` goes through Ray (`launch_on_ray`), which starts one torchrun agent per node.
Inside a torchrun child nothing is relaunched: `WORLD_SIZE`/`RANK` are already set.

This module knows processes, not configs: a `Job` is the plain numbers a launch needs, and the trainers turn their
config into one (`polyrl.trainer.job`). Nothing here imports a trainer or the CLI.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass

from polyrl.errors import ConfigError


@dataclass(frozen=True)
class Job:
    """The processes a run asks for."""

    nproc_per_node: int
    """Trainer ranks on each node."""
    nnodes: int = 1
    """Nodes; more than one goes through Ray."""
    extra_processes: int = 0
    """Processes beyond the trainer's ranks in the same torchrun job (the off-policy pipeline's rollout pool)."""
    device: str = "auto"
    """`cpu` asks Ray for no GPUs; `cuda` always does; `auto` does when the Ray cluster has GPUs."""
    placement_timeout_s: float = 300.0
    """How long Ray may take to place the nodes before the launch is refused."""

    @property
    def num_processes(self) -> int:
        return self.nproc_per_node * self.nnodes + self.extra_processes


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def exit_child(code: int) -> None:
    """The end of a torchrun child whose work is done (its files written, its process group torn down): the exit
    handlers run (they stop the processes this one started, such as a reward worker, and flush loggers), then the
    process exits without interpreter finalization, where gloo's worker threads can still abort it (SIGABRT,
    "terminate called without an active exception", pytorch/pytorch#179291; seen in CI after complete runs), which
    torchrun then reports as a failed job. Not a torchrun child: an ordinary exit."""
    import atexit

    if not under_torchrun():
        sys.exit(code)
    atexit._run_exitfuncs()  # noqa: SLF001 (what a normal exit runs first; no public spelling)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def gpus_per_node(configured: int) -> int:
    """One node's GPUs: the processes torchrun started on it (`LOCAL_WORLD_SIZE`) when it launched the job, else the
    configured `trainer.n_gpus_per_node` (a raw `torchrun --nproc_per_node=2` run with the default 1 has 2)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or configured


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


def maybe_launch(job: Job, argv: list[str], *, module: str = "polyrl.train") -> int | None:
    """Run `module argv` as `job`, if that is more than this one process.

    Returns the job's exit status, or None when the caller should simply train in this process (one process
    wanted, or already a torchrun child)."""
    if under_torchrun() or job.num_processes == 1:
        return None
    if job.nnodes > 1:
        return launch_on_ray(job, argv, module=module)
    code = subprocess.call(torchrun_command(job.num_processes, ["-m", module, *argv]))
    if code != 0:  # torchrun ended the other ranks (a TP replica or FSDP cannot go on without one): say so last
        print(f"polyrl: error: the {job.num_processes}-process job stopped (exit status {code}) because a process "
              "failed or was killed (torchrun's report above names it); rerun the same command with "
              "trainer.resume_mode=auto to resume from the last checkpoint.", file=sys.stderr)
    return code


# ------------------------------------------------------------------------------------------------ multi-node launch
def _node_address() -> tuple[str, int]:
    """This node's IP and a free TCP port (run on bundle 0's node: the torch rendezvous master)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    import ray

    return ray.util.get_node_ip_address(), port


def _run_agent(cmd: list[str], env: dict[str, str], cwd: str) -> int:
    return subprocess.call(cmd, env={**os.environ, **env}, cwd=cwd)


def launch_on_ray(job: Job, argv: list[str], *, module: str = "polyrl.train", strategy: str = "STRICT_SPREAD",
                  address: str | None = None) -> int:
    """Run `module argv` as `job.nnodes` torchrun agents, one per Ray node; returns the worst exit status.

    One placement-group bundle per node (`STRICT_SPREAD`, each with `job.nproc_per_node` GPUs), one Ray task per
    bundle that runs a torchrun agent for that node (`--nnodes/--node_rank/--master_addr` pointing at bundle 0's
    node). The training processes are ordinary torchrun children, so the whole trainer, FSDP2 and NCCL code is
    identical on one node and on many; Ray only places them. `strategy="SPREAD"` lets the bundles share a node (used
    to test the recipe on one machine)."""
    from polyrl.distributed.ray_cluster import init_ray

    ray = init_ray(address)
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    use_gpu = job.device != "cpu" and (job.device == "cuda" or bool(ray.cluster_resources().get("GPU")))
    bundle = {"CPU": 1, **({"GPU": job.nproc_per_node} if use_gpu else {})}
    pg = placement_group([dict(bundle) for _ in range(job.nnodes)], strategy=strategy)
    if not ray.get(pg.ready(), timeout=job.placement_timeout_s):
        raise ConfigError(f"Ray could not place {job.nnodes} nodes x {bundle} within "
                          f"trainer.ray_wait_register_center_timeout={job.placement_timeout_s}s; start "
                          "`ray start --address=<head>:6379` on every node first.")
    on = [PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
          for i in range(job.nnodes)]
    master_addr, master_port = ray.get(ray.remote(num_cpus=0)(_node_address).options(
        scheduling_strategy=on[0]).remote())
    agent = ray.remote(num_cpus=1, num_gpus=bundle.get("GPU", 0))(_run_agent)
    runs = []
    for node_rank in range(job.nnodes):
        cmd = torchrun_command(job.nproc_per_node, ["-m", module, *argv], nnodes=job.nnodes, node_rank=node_rank,
                               master_addr=master_addr, master_port=master_port)
        # Ray narrows CUDA_VISIBLE_DEVICES to the bundle's GPUs; torchrun then maps local ranks onto them
        # RAY_ADDRESS: the trainer's reward actors join this cluster instead of starting one per rank
        env = {"RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        runs.append(agent.options(scheduling_strategy=on[node_rank]).remote(cmd, env, os.getcwd()))
    codes = ray.get(runs)
    ray.util.remove_placement_group(pg)
    return max(codes, key=abs)


if __name__ == "__main__":
    # `python -m polyrl.distributed.launch KEY=VALUE ...`, the older spelling of `python -m polyrl.train`: hand the
    # process over to the command line (an exec, not an import: this layer does not depend on the CLI)
    os.execv(sys.executable, [sys.executable, "-m", "polyrl.train", *sys.argv[1:]])
