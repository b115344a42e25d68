"""Collective bandwidth between this host's GPUs, as FSDP2 uses them: all-gather and reduce-scatter of `--gb` GB
(nccl-tests' bus bandwidth convention: bytes x (n-1)/n / time). Run under torchrun, one process per GPU:

    torchrun --standalone --nproc_per_node=4 benchmarks/probes/nccl_bw.py
"""

import argparse
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0, help="size of the gathered / reduced buffer in GB")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    numel = int(args.gb * 1e9 / 2) // n * n
    full = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    shard = torch.empty(numel // n, dtype=torch.bfloat16, device="cuda")
    out = {}
    for name, fn in (("all_gather", lambda: dist.all_gather_into_tensor(full, shard)),
                     ("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard, full))):  # fmt: skip
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            fn()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.iters
        out[name] = numel * 2 * (n - 1) / n / dt / 1e9
    if rank == 0:
        print(f"{n} GPUs ({torch.cuda.get_device_name()}), {args.gb} GB bf16: "
              + ", ".join(f"{k} {v:.0f} GB/s bus bandwidth" for k, v in out.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
