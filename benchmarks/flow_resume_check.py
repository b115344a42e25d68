"""Issue 24's resume check, driven by `benchmarks/flow_grpo.py --save-check DIR` then `--resume-check DIR` (a new job
on the same GPUs): the first run saves a checkpoint after its timed steps, fingerprints the saved state and runs the
next step uninterrupted; the second resumes the checkpoint, checks the loaded fingerprint against the saved one and
runs the same step. The verdict compares the two. Both compared steps run deterministic kernels
(`deterministic_kernels`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


CHECK_KEYS = ("critic/rewards/mean", "critic/advantages/max", "actor/pg_loss", "actor/grad_norm", "actor/ratio_mean",
              "actor/pg_clipfrac", "actor/num_trained_samples")


@torch.no_grad()
def fingerprint(trainer) -> dict[str, list[float]]:
    """Collective. Sum and sum of squares (fp64, over all ranks) of the trainable weights and of each AdamW state
    tensor: equal fingerprints mean the same state, up to a coincidence that no checkpoint bug would produce."""
    sums: dict[str, torch.Tensor] = {}
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    for p in params:
        tensors = {"weights": p, **{k: v for k, v in trainer.optimizer.state.get(p, {}).items() if v.ndim > 0}}
        for key, t in tensors.items():
            local = (t.to_local() if hasattr(t, "to_local") else t).double()
            acc = sums.setdefault(key, torch.zeros(2, dtype=torch.float64, device=local.device))
            acc += torch.stack([local.sum(), local.square().sum()])
    out = {}
    for key, acc in sorted(sums.items()):
        if trainer.dist.is_distributed:
            torch.distributed.all_reduce(acc)
        out[key] = acc.tolist()
    # the scalars the update also reads: AdamW's step counts (its bias correction) and each group's learning rate
    out["adam_steps"] = sorted({float(v["step"]) for v in trainer.optimizer.state.values() if "step" in v})
    out["lr"] = [float(g["lr"]) for g in trainer.optimizer.param_groups]
    return out


def deterministic_kernels() -> None:
    """For the compared step only (the timed steps keep the fast kernels): GPU kernels whose results repeat bit for
    bit. The default attention backward (flash, memory-efficient or cuDNN) adds with atomics, so two runs of one step
    from one state differ in the last bits, and AdamW's normalised first step and a 1e-5 clip range turn those into
    ~1% differences: the 2026-11-26 4-GPU resume loaded the state bitwise and reproduced the rollout bitwise, yet its
    update differed by 0.6% in grad norm. The math attention is deterministic (matmuls); cuBLAS needs
    CUBLAS_WORKSPACE_CONFIG set before it starts (flow_full_session.sh sets it for both jobs)."""
    if not torch.cuda.is_available():
        return  # CPU kernels already repeat (tests/test_flow_full_resume_on_cpu.py)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


def save_check(trainer, folder: str, dist) -> None:
    """After the timed steps: save (timed), fingerprint the saved state, run the next step uninterrupted and write
    what it measured to folder/uninterrupted.json for `resume_check`."""
    saved = fingerprint(trainer)
    t0 = time.perf_counter()
    path = trainer.save_checkpoint()
    save_s = time.perf_counter() - t0
    if dist.is_rank0:
        print(f"saved {path} in {save_s:.1f}s", flush=True)
    deterministic_kernels()
    row = trainer.step()
    record = {"step": trainer.global_step, "saved": saved, "after": fingerprint(trainer), "save_s": save_s,
              "checkpoint": str(path), "metrics": {k: row.get(k) for k in CHECK_KEYS}}  # fmt: skip
    if dist.is_rank0:
        Path(folder, "uninterrupted.json").write_text(json.dumps(record, indent=1))
        print(f"step {trainer.global_step} uninterrupted: {record['metrics']}", flush=True)


def resume_check(trainer, folder: str, dist) -> None:
    """The trainer resumed `save_check`'s checkpoint in its constructor: check the loaded state against the saved
    fingerprint, run the same step, compare with the uninterrupted run and print a verdict (rank 0)."""
    want = json.loads(Path(folder, "uninterrupted.json").read_text())
    loaded = fingerprint(trainer)
    deterministic_kernels()
    row = trainer.step()
    got = {"step": trainer.global_step, "loaded": loaded, "after": fingerprint(trainer),
           "metrics": {k: row.get(k) for k in CHECK_KEYS}}  # fmt: skip
    dist.finish()
    if not dist.is_rank0:
        return
    rel = lambda a, b: abs(a - b) / max(abs(a), abs(b), 1e-30)  # noqa: E731
    verdict = {
        "same_step": got["step"] == want["step"],
        "state_loaded_bitwise": loaded == want["saved"],  # fp64 sums of the very same bits
        "metrics_max_rel_diff": max((rel(got["metrics"][k], want["metrics"][k]) for k in CHECK_KEYS
                                     if got["metrics"][k] is not None), default=0.0),  # fmt: skip
        "after_step_max_rel_diff": max(rel(a, b) for k in want["after"] for a, b in zip(got["after"][k], want["after"][k])),
        "rewards_equal": got["metrics"]["critic/rewards/mean"] == want["metrics"]["critic/rewards/mean"],
    }
    Path(folder, "resumed.json").write_text(json.dumps({**got, "verdict": verdict}, indent=1))
    print("resume check:", json.dumps(verdict), flush=True)
