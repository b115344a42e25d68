"""FlowGRPO step throughput on the Qwen-Image transformer at its real size (issue 6's headline number).

Setup: diffusers' default `QwenImageTransformer2DModel()` (60 blocks, 20.4B params) with random bf16 weights, 512^2
(1,024 image tokens of 64 channels), 10 sampling steps, SDE window 2 in [0, 5), true CFG 4.0 (both branches
trained), LoRA r64 alpha 128 on verl-omni's target modules, group 16, gradient checkpointing. The text encoder is
replaced by cached random prompt embeddings (T=128, dim 3584: what the cache holds after the first step anyway) and
the VAE by a latent-space reward, both reported in the output row; the trainer code is the real one.

Prints images/GPU/s and the timing_s/* breakdown next to VeRL-Omni's 0.305 img/GPU/s (4xH800, LoRA, CFG 4) and the
compute limit. FLOPs: Qwen-Image is a dual-stream MMDiT, so a token passes through its own stream's weights only
(6.8B for image tokens, 6.8B for text tokens; the 6.8B of `*_mod` modulation weights run once per sample, not per
token): one forward of one sample = 2 (6.82B x 1024 + 6.81B x 128) + 4 L T^2 D = ~16.7 TFLOP. Per image, useful work
is 10 x 2 rollout forwards + 2 x 2 trained steps x (fwd + input-grad bwd; LoRA needs no weight grads of the base) =
28 forwards = ~468 TFLOP (the issue's convention, with recompute and full weight grads, says ~600), i.e. ~1.7 img/s
at 790 TFLOP/s dense bf16. (Rows recorded before 2026-11-21 11:00 used 2 x 20.4B x tokens per forward, 2.8x too
many FLOPs, so their "limit" column, 0.46, was wrong; the measured img/s were right.)

    python benchmarks/flow_grpo.py                  # GPU, real size
    python benchmarks/flow_grpo.py --tiny --steps 2 # CPU smoke test of the same code path
    torchrun --standalone --nproc_per_node=4 benchmarks/flow_grpo.py   # data parallel: FSDP2, same work per GPU

Under torchrun every rank builds the same random transformer on its GPU, the trainer shards it with FSDP2 per block,
and `--prompts` stays per GPU (the global batch is `--prompts` x processes), so img/GPU/s compares directly with the
1-GPU row. With FSDP2 the LoRA adapters compute in bf16 like the base (fp32 in one process); see polyrl.distributed.dit_fsdp.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from polyrl.trainer.flow_config import FlowConfig
from polyrl.models.diffusion.pipeline import FlowPolicy, LatentShape
from polyrl.trainer.flow_grpo import FlowGRPOTrainer

PEER_IMG_PER_GPU_S = 0.305  # VeRL-Omni run_qwen_image_ocr_lora.sh, 4xH800
PEAK_TFLOPS = 790.0


def stream_params(transformer) -> tuple[int, int, int]:
    """(image-stream, text-stream, per-sample) parameter counts of a dual-stream DiT, by parameter name."""
    img = txt = per_sample = 0
    text_keys = ("txt_", ".add_q_proj", ".add_k_proj", ".add_v_proj", "to_add_out", "norm_added")
    for name, p in transformer.named_parameters():
        if "lora_" in name:
            continue
        if "_mod" in name or "time_text_embed" in name:
            per_sample += p.numel()
        elif any(k in name for k in text_keys):
            txt += p.numel()
        else:
            img += p.numel()
    return img, txt, per_sample


def forward_tflop(transformer, img_tokens: int, txt_tokens: int) -> float:
    """One sample's forward in TFLOP: 2 x params each token passes through + joint attention 4 L T^2 D."""
    img, txt, per_sample = stream_params(transformer)
    c = transformer.config
    T = img_tokens + txt_tokens
    dense = 2 * (img * img_tokens + txt * txt_tokens + per_sample)
    return (dense + 4 * c.num_layers * T**2 * c.num_attention_heads * c.attention_head_dim) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small model on CPU: checks the code path only")
    ap.add_argument("--steps", type=int, default=3, help="timed RL steps (after one warm-up step)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step per GPU (x group 16 images)")
    ap.add_argument("--micro", type=int, default=8, help="images per forward/backward")
    ap.add_argument("--no-cfg", action="store_true", help="true_cfg_scale 1 (the non-CFG variant)")
    ap.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    ap.add_argument("--keep-gathered", action="store_true",
                    help="FSDP2 reshard_after_forward=False: gather each block once per rollout, not per step")
    ap.add_argument("--tf32", action="store_true", help="TF32 tensor cores for fp32 matmuls (the fp32 LoRA path)")
    ap.add_argument("--compile", action="store_true",
                    help="actor.use_torch_compile: torch.compile each block (update and rollout passes)")
    ap.add_argument("--no-ckpt", action="store_true", help="no gradient checkpointing")
    ap.add_argument("--auto-memory", action="store_true",
                    help="gradient checkpointing on auto (off until an OOM turns it on; micro-batches halve after)")
    ap.add_argument("--rollout-micro", type=int, help="images per sampling forward (default: --micro)")
    ap.add_argument("--record", action="store_true", help="append a row to BENCHMARKS.md")
    ap.add_argument("--rows-out", help="with --record: append the row to this file instead (runs on another machine)")
    ap.add_argument("--note", default="", help="with --record: words added to the row's config column")
    args = ap.parse_args()

    from diffusers import QwenImageTransformer2DModel

    from polyrl.distributed import DistEnv

    dist = DistEnv.setup("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    device = dist.device if dist.is_distributed else ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    on_gpu = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    size, text_dim, text_len = (512, 3584, 128) if not args.tiny else (64, 32, 16)
    kw = {} if not args.tiny else dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                       axes_dims_rope=(8, 4, 4))  # fmt: skip
    t0 = time.perf_counter()
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build directly in bf16 on the GPU: fp32 would need 82 GB
    with torch.device(device):
        transformer = QwenImageTransformer2DModel(**kw)
    torch.set_default_dtype(prev)
    num_params = sum(p.numel() for p in transformer.parameters())
    build_s = time.perf_counter() - t0
    grid = size // 16  # VAE /8, packing /2

    g = torch.Generator().manual_seed(0)
    table = {}

    def encode(prompts):  # stands in for the Qwen2.5-VL encoder; the trainer caches it per prompt anyway
        for p in prompts:
            table.setdefault(p, torch.randn(text_len, text_dim, generator=g) * 0.02)
        return [(table[p], torch.ones(text_len, dtype=torch.long)) for p in prompts]

    def sigmas(n):
        t = torch.linspace(1, 0, n + 1)
        return 3 * t / (1 + 2 * t)

    cfg = FlowConfig()
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    ro.n, ro.pipeline.num_inference_steps = 16, 10
    ro.pipeline.true_cfg_scale = 1.0 if args.no_cfg else 4.0
    ro.algo.noise_level, ro.algo.sde_window_size, ro.algo.sde_window_range = 1.2, 2, [0, 5]
    cfg.data.train_batch_size = args.prompts * dist.world_size
    # two optimizer steps per batch, as the recipe (with several processes: a multiple of the process count)
    actor.ppo_mini_batch_size = max(1, args.prompts // 2) * dist.world_size
    actor.ppo_micro_batch_size_per_gpu = args.micro
    ro.log_prob_micro_batch_size_per_gpu = args.rollout_micro
    actor.optim.lr = 3e-4 if not args.full else 3e-5
    actor.diffusion_loss.clip_ratio = 1e-5
    actor.fsdp_config.reshard_after_forward = not args.keep_gathered
    cfg.trainer.progress_bar = False
    policy = FlowPolicy(transformer, encode_fn=encode, decode_fn=lambda z: z.float(), sigmas_fn=sigmas,
                        latent=LatentShape(grid, grid, transformer.config.in_channels),
                        true_cfg_scale=ro.pipeline.true_cfg_scale, device=device)  # fmt: skip
    if not args.full:
        policy.add_lora(64, 128, cfg.actor_rollout_ref.model.target_modules)
        for p in policy.trainable_parameters():  # LoRA weights in fp32 (the base stays bf16)
            p.data = p.data.float()
    if args.auto_memory:
        cfg.actor_rollout_ref.model.enable_gradient_checkpointing = None  # the trainer decides (trainer/oom.py)
    else:
        cfg.actor_rollout_ref.model.enable_gradient_checkpointing = not args.no_ckpt
        if not args.no_ckpt:
            transformer.enable_gradient_checkpointing()
    actor.use_torch_compile = args.compile
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True

    def latent_reward(latents, prompts, metadata):  # stands in for VAE + OCR; depends on the sample, so groups vary
        return -latents.float().flatten(1).abs().mean(1).cpu()

    prompts = [(f"prompt {i}", {}) for i in range(64)]
    trainer = FlowGRPOTrainer(cfg, policy, latent_reward, prompts, prompts[:2], dist=dist)
    trainer.step()  # warm-up (allocator, kernels)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    rows = [trainer.step() for _ in range(args.steps)]
    keys = sorted({k for r in rows for k in r if k.startswith("timing_s/")})
    timing = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    images = args.prompts * ro.n  # per GPU
    img_s = images / timing["timing_s/step"]  # the slowest rank's step time (merged metrics)
    cfg_mult = 1 if args.no_cfg else 2
    fwd = forward_tflop(transformer, grid * grid, text_len)
    trained = 3 if args.full else 2  # forward + input-grad backward (+ weight-grad backward when full FT)
    tflop_per_image = fwd * cfg_mult * (ro.pipeline.num_inference_steps + ro.algo.sde_window_size * trained)
    limit = PEAK_TFLOPS / tflop_per_image
    result = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "processes": dist.world_size,
        "params_B": num_params / 1e9, "build_s": build_s, "images_per_step": images,
        "img_per_gpu_s": img_s, "peer_img_per_gpu_s": PEER_IMG_PER_GPU_S, "limit_img_per_gpu_s": limit,
        "tflop_per_image": tflop_per_image, "achieved_tflops": img_s * tflop_per_image, **timing,
        "max_memory_gb": rows[-1].get("perf/max_memory_allocated_gb", 0.0),
        "ratio_mean": rows[-1].get("actor/ratio_mean"), "pg_clipfrac": rows[-1].get("actor/pg_clipfrac"),
        "grad_norm": rows[-1].get("actor/grad_norm"),
        "oom_retries": trainer.oom.num_retries, "grad_ckpt": cfg.actor_rollout_ref.model.enable_gradient_checkpointing,
        "micro": actor.ppo_micro_batch_size_per_gpu, "rollout_micro": ro.log_prob_micro_batch_size_per_gpu,
    }  # fmt: skip
    dist.close()
    if not dist.is_rank0:
        return
    print(json.dumps(result, indent=1))
    if args.record and not args.tiny:
        from benchmarks._record import append_row

        procs = f"{dist.world_size} process(es)" + (" (FSDP2, blocks kept gathered)" if args.keep_gathered else
                                                     " (FSDP2)" if dist.is_distributed else "")
        shape = (f"Qwen-Image DiT {num_params / 1e9:.1f}B bf16 random, 512^2, 10 steps, window 2, "
                 f"{'no CFG' if args.no_cfg else 'CFG 4'}, {'full FT' if args.full else 'LoRA r64'}, group 16, {procs}, "
                 f"{images} img/step/GPU, micro {actor.ppo_micro_batch_size_per_gpu}"
                 f"{f' (rollout {ro.log_prob_micro_batch_size_per_gpu})' if ro.log_prob_micro_batch_size_per_gpu else ''}, "
                 f"{'grad ckpt' if cfg.actor_rollout_ref.model.enable_gradient_checkpointing else 'no ckpt'}"
                 f"{f' (auto memory, {trainer.oom.num_retries} OOM retries)' if args.auto_memory else ''}"
                 f"{', compiled blocks (update dynamic, rollout static shapes)' if args.compile else ''}"
                 f"{', TF32 LoRA matmuls' if args.tf32 else ''}; gen {timing['timing_s/gen']:.1f}s, "
                 f"update {timing['timing_s/update_actor']:.1f}s, ratio_mean {result['ratio_mean']:.6f}; "
                 f"random text embeds, latent reward (no VAE/OCR){'; ' + args.note if args.note else ''}")  # fmt: skip
        append_row(result["device"], "flow_grpo img/GPU/s", shape, f"{img_s:.3f}",
                   f"VeRL-Omni 4xH800: {PEER_IMG_PER_GPU_S}", f"{limit:.2f}", f"{img_s / PEER_IMG_PER_GPU_S:.2f}",
                   f"{img_s / limit:.2f}", path=args.rows_out)  # fmt: skip


if __name__ == "__main__":
    main()
