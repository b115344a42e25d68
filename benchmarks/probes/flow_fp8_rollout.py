"""FP8 sampling for the DiT, the rollout stage alone: speedup over bf16 and the per-step log-prob mismatch (issue 23).

Samples the same batch twice through `polyrl.rollout.sde_sampler` (10 steps, SDE window 2 of [0, 5), CFG 4, LoRA r64,
Qwen-Image 20.4B with random bf16 weights at 512^2 on a GPU; a small random Qwen-Image transformer with --tiny), once
with bf16 GEMMs and once inside `FP8Sampling.sampling()`, and times each. Then the trained policy (bf16) recomputes
the log-prob of every FP8-sampled window step, and the LLM's `compute_rollout_correction` gives the mismatch
(`rollout_corr/kl` = E[log pi_fp8 - log pi_bf16] per step, k3, chi^2; log-probs are FlowGRPO's per-element means).

`--lora-modes` compares the two ways LoRA can meet FP8 weights (fp8_dit's docstring): adapters in bf16 over the FP8
base (what the trainer does) and adapters merged into the base then re-quantised, which must be redone after every
optimizer step; it prints each mode's sampling time, mismatch and the re-quantisation time per optimizer step
(`--lora-scale` sets the adapter's size: the merged mode's error grows with it).

    python benchmarks/probes/flow_fp8_rollout.py                        # GPU: rollout-stage speedup + mismatch KL
    python benchmarks/probes/flow_fp8_rollout.py --tiny --lora-modes    # CPU (emulated FP8): the LoRA choice
    python benchmarks/probes/flow_fp8_rollout.py --compile --profile     # GPU: compiled blocks as the trainer runs them,
                                                                 # and each precision's top kernels
    python benchmarks/probes/flow_fp8_rollout.py --compile --compiled-quantisers inductor,triton --trained-steps-bf16
        # GPU: the activation quantiser fused by inductor vs the Triton launch; and FP8 on the ODE steps only

`--compile` compiles the blocks as the trainer does (`FlowPolicy.compile_blocks`, after FP8Sampling); `--profile`
prints the kernels of one timed batch per precision. On an H200 (2026-11-26, compiled, 16 images) bf16 took 10.55 s,
every step FP8 8.54 s, FP8 on the ODE steps with merged LoRA 8.15 s (the 24.0 s of a 2026-11-24 trainer run came
from its text-encoder offload, not from FP8: docs/engineering/NOTES_flow.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _record

from polyrl.algorithms import sde as sde_lib
from polyrl.algorithms.rollout_correction import RolloutCorrectionConfig, compute_rollout_correction
from polyrl.models.diffusion.pipeline import FlowPolicy, LatentShape
from polyrl.rollout import fp8_dit, sde_sampler
from polyrl.rollout.native import fp8_linear
from polyrl.trainer.flow_config import FlowModelConfig

NOISE_LEVEL, WINDOW = 1.2, [3, 4]  # a=1.2; a window of 2 inside [0, 5): the noisiest useful steps


def build(tiny: bool, device: str, dtype: torch.dtype, lora_rank: int, lora_scale: float = 0.5):
    from diffusers import QwenImageTransformer2DModel

    kw = {} if not tiny else dict(num_layers=2, attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
                                  axes_dims_rope=(8, 12, 12))  # fmt: skip
    size, text_len = (512, 48) if not tiny else (128, 16)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        tr = QwenImageTransformer2DModel(**kw)
    torch.set_default_dtype(prev)
    grid, dim = size // 16, tr.config.joint_attention_dim
    g = torch.Generator().manual_seed(1)
    table = {}

    def encode(prompts):
        for p in prompts:
            table.setdefault(p, torch.randn(text_len, dim, generator=g))
        return [(table[p], torch.ones(text_len, dtype=torch.long)) for p in prompts]

    def sigmas(n):
        t = torch.linspace(1, 0, n + 1)
        return 3 * t / (1 + 2 * t)

    policy = FlowPolicy(tr, encode_fn=encode, decode_fn=lambda z: z, sigmas_fn=sigmas,
                        latent=LatentShape(grid, grid, tr.config.in_channels), true_cfg_scale=4.0, device=device)
    policy.add_lora(lora_rank, 2 * lora_rank, FlowModelConfig().target_modules)
    with torch.no_grad():  # a trained-looking adapter: B is zero at init, which would hide the LoRA path
        for name, p in tr.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * lora_scale / lora_rank**0.5)
            if "lora_" in name:
                p.data = p.data.to(dtype)
    return policy


def sample(policy, batch: int, fp8: fp8_dit.FP8Sampling | None, steps: int = 10, trained_steps: bool = True):
    """(trajectory, seconds) of one batch; the noise depends only on the sample index. `trained_steps=False`: the
    window's steps leave FP8 (the trainer's default)."""
    prompts = [f"prompt {i % 4}" for i in range(batch)]
    gens = sde_sampler.sample_generators(0, 0, list(range(batch)))
    noise = torch.cat([policy.noise(1, g) for g in gens])
    sigmas = policy.sigmas(steps)
    policy.cache_prompts(prompts)
    sync = torch.cuda.synchronize if noise.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad(), fp8_dit.rollout_precision(fp8):
        traj = sde_sampler.sample(lambda x, s: policy.velocity(x, s, prompts), noise, sigmas, sde_type="sde",
                                  noise_level=NOISE_LEVEL, train_steps=WINDOW, generators=gens,
                                  step_precision=fp8_dit.step_precision(fp8, trained_steps))  # fmt: skip
    sync()
    return traj, prompts, time.perf_counter() - t0


@torch.no_grad()
def mismatch(policy, traj, prompts, steps: int = 10) -> dict[str, float]:
    """The shared rollout-correction metrics between the sampler's log-probs and the plain policy's."""
    sigmas = policy.sigmas(steps)
    old = torch.empty_like(traj.log_probs_KB)
    for k, i in enumerate(traj.step_indices):
        x = traj.latents_KB[k]
        v = policy.velocity(x, sigmas[i].expand(x.shape[0]).to(x.device), prompts)
        old[k] = sde_lib.step("sde", x, v, sigmas[i], sigmas[i + 1], noise_level=NOISE_LEVEL, sigma_max=float(sigmas[1]),
                              x_next=traj.next_latents_KB[k]).log_prob_B.to(old)  # fmt: skip
    _, _, m = compute_rollout_correction(old.t(), traj.log_probs_KB.t(), torch.ones_like(old.t()),
                                         RolloutCorrectionConfig(rollout_is="token"))  # fmt: skip
    keys = ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/chi2_token", "rollout_corr/rollout_is_max")
    return {k: m[k] for k in keys} | {"abs_log_ratio_max": float((old - traj.log_probs_KB).abs().max())}


def merged_copy(policy) -> FlowPolicy:
    """The policy with its LoRA adapters merged into the base weights (peft's merge)."""
    merged = copy.copy(policy)
    merged.transformer = copy.deepcopy(policy.transformer)
    for mod in merged.transformer.modules():
        if hasattr(mod, "lora_A") and hasattr(mod, "merge"):
            mod.merge()
    return merged


def top_kernels(fn, label: str, on_gpu: bool, rows: int = 15) -> None:
    """One call of `fn` under torch.profiler: its most expensive kernels (device time), printed."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=acts) as prof:
        fn()
    key = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    print(f"== {label}: top {rows} by {key}\n{prof.key_averages().table(sort_by=key, row_limit=rows)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small transformer on CPU (FP8 emulated)")
    ap.add_argument("--batch", type=int, default=16, help="images per sampling chunk (x2 with CFG)")
    ap.add_argument("--repeats", type=int, default=3, help="timed batches per precision (after one warm-up each)")
    ap.add_argument("--lora-modes", action="store_true", help="also: LoRA merged into the base and re-quantised")
    ap.add_argument("--compile", action="store_true", help="compile the blocks as the trainer does")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one batch per precision")
    ap.add_argument("--rows-out", help="append the row to this JSON-lines file (a run on another machine)")
    ap.add_argument("--compiled-quantisers", default=fp8_linear.COMPILED_QUANTISER,
                    help="with --compile, how blocks quantise a GEMM's input, comma-separated to compare: inductor "
                         "(tensor ops fused by inductor), triton (the hand-written launch)")
    ap.add_argument("--trained-steps-bf16", action="store_true",
                    help="also time FP8 on the ODE steps only, LoRA merged into their e4m3 copies (the trained steps "
                         "in bf16: the trainer's default; timed last, it re-patches the model)")
    ap.add_argument("--lora-scale", type=float, default=0.5,
                    help="std x sqrt(rank) of the random LoRA B (A is peft's gaussian init): the adapter's size")
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    policy = build(args.tiny, device, dtype, lora_rank=64 if not args.tiny else 8, lora_scale=args.lora_scale)
    fp8 = fp8_dit.FP8Sampling(policy.transformer)
    if args.compile:
        policy.compile_blocks()
    times = {}
    quantisers = args.compiled_quantisers.split(",") if args.compile else [fp8_linear.COMPILED_QUANTISER]
    runs_of = [("bf16" if on_gpu else "fp32", None, True, quantisers[0])]
    for q in quantisers:
        suffix = f"_{q}" if len(quantisers) > 1 else ""
        runs_of.append((f"fp8{suffix}", fp8, True, q))
        if args.trained_steps_bf16 and q == quantisers[0]:
            runs_of.append((f"fp8_ode_steps{suffix}", fp8, False, q))
    for name, ctx, trained_steps, quantiser in runs_of:
        fp8_linear.COMPILED_QUANTISER = quantiser
        if not trained_steps and not ctx.merged:  # the trainer's ODE-steps mode: adapters merged into the copies
            ctx = fp8_dit.FP8Sampling(policy.transformer, merge_lora=True)
        sample(policy, args.batch, ctx, trained_steps=trained_steps)  # warm-up (and compile)
        runs = [sample(policy, args.batch, ctx, trained_steps=trained_steps) for _ in range(args.repeats)]
        times[name] = sum(r[2] for r in runs) / len(runs)
        if name.startswith("fp8") and trained_steps:
            traj, prompts = runs[-1][0], runs[-1][1]
        if args.profile:
            top_kernels(lambda: sample(policy, args.batch, ctx, trained_steps=trained_steps), name, on_gpu)
    base = times["bf16" if on_gpu else "fp32"]
    result = {"device": torch.cuda.get_device_name() if on_gpu else "cpu (FP8 emulated: no speedup expected)",
              "compiled": args.compile, "quantised_linears": len(fp8.linears), "batch": args.batch,
              "sampling_s": times, "speedup": {k: base / t for k, t in times.items()},
              "lora_on_top": mismatch(policy, traj, prompts)}  # fmt: skip
    if args.lora_modes:
        merged = merged_copy(policy)
        t0 = time.perf_counter()
        fp8_merged = fp8_dit.FP8Sampling(merged.transformer)  # what every optimizer step would redo
        requant_s = time.perf_counter() - t0
        sample(merged, args.batch, fp8_merged)  # warm-up
        runs = [sample(merged, args.batch, fp8_merged) for _ in range(args.repeats)]
        result["sampling_s"]["fp8_lora_merged"] = sum(r[2] for r in runs) / len(runs)
        result["lora_merged_requantised"] = mismatch(policy, runs[-1][0], runs[-1][1])
        result["requantise_s_per_optimizer_step"] = requant_s
    print(json.dumps(result, indent=1))
    if on_gpu:
        from _record import append_row

        mm = result["lora_on_top"]
        append_row(result["device"], "flow_fp8_rollout.py (the FP8 rollout stage alone, issue 23)",
                   f"Qwen-Image DiT 20.4B bf16 random, LoRA r64, 512^2, 10 steps, window {WINDOW}, CFG 4, "
                   f"{args.batch} images per call, {'compiled' if args.compile else 'eager'}, {args.repeats} timed "
                   f"calls each; sampling s: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items())
                   + f"; every-step FP8 vs bf16 recompute: KL {mm['rollout_corr/kl']:.1e}, max |log-ratio| "
                   f"{mm['abs_log_ratio_max']:.1e}",
                   f"best FP8 {max(v for k, v in result['speedup'].items() if k.startswith('fp8')):.2f}x bf16", path=args.rows_out)  # fmt: skip


if __name__ == "__main__":
    main()
