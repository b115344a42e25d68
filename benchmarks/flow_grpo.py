"""FlowGRPO step throughput on Qwen-Image at its real size (issues 6 and 23's headline numbers).

Setup: diffusers' default `QwenImageTransformer2DModel()` (60 blocks, 20.4B params) with random bf16 weights, 512^2
(1,024 image tokens of 64 channels), 10 sampling steps, SDE window 2 in [0, 5), true CFG 4.0 (both branches
trained), LoRA r64 alpha 128 on verl-omni's target modules, group 16, gradient checkpointing.

Same work as VeRL-Omni (the default, issue 23): a whole `QwenImagePipeline` goes through the same code as `polyrl flow
train` (`polyrl.models.diffusion.adapters` encode / decode, the trainer, the `ocr` reward), all inside the timed step:
- text encoder: `Qwen2_5_VLForConditionalGeneration` with Qwen2.5-VL-7B's language model (28 layers, 3584 hidden,
  28/4 heads, FFN 18944, vocab 152064; random bf16 weights) run by diffusers' `encode_prompt`, logits included as
  there. Its vision tower is one small block: text-to-image never calls it. The tokenizer is a stand-in that returns
  random ids, as many as Qwen's would give: the 34 template tokens the pipeline drops, ~4 characters of prompt per
  token, 5 closing template tokens (`RandomIdTokenizer`).
- prompt embeddings are cached only where VeRL-Omni caches them: its vLLM-Omni rollout encodes each request's prompt
  and hands the embeddings to the actor with the sample, so the training passes of that step reuse them and nothing
  survives the step. Here each step's rollout encodes its prompts once (the group's n images share one encoding,
  and the negative prompt " " is encoded once per step: vLLM-Omni encodes per request, n times more text-encoder
  work, ~0.1% of the DiT's), the update reuses them, and the next step encodes again
  (`actor_rollout_ref.model.cache_prompt_embeds=False`, FlowPolicy's cache cleared in `FlowGRPOTrainer.generate`).
- VAE: `AutoencoderKLQwenImage()` (the real config, random bf16 weights) decodes every image to 512^2 pixels.
- reward: rapidocr OCR (`polyrl.rewards.image_rewards`, on the host CPU) against the prompt's quoted text. Random
  weights draw no text, so rewards are ~0 and every group has zero std: `actor.skip_zero_adv=False` keeps every
  sample in the update, so the update does the work of a real batch (VeRL-Omni trains every sample).
`--latent-reward` is the older, lighter run (issue 6's rows): cached random prompt embeddings (T=128) stand in for
the text encoder and a latent-space reward for VAE + OCR.

Prints images/GPU/s and the timing_s/* breakdown next to VeRL-Omni's 0.305 img/GPU/s (4xH800, LoRA, CFG 4) and the
compute limit. FLOPs: Qwen-Image is a dual-stream MMDiT, so a token passes through its own stream's weights only
(6.8B for image tokens, 6.8B for text tokens; the 6.8B of `*_mod` modulation weights run once per sample, not per
token): one forward of one sample = 2 (6.82B x 1024 + 6.81B x 128) + 4 L T^2 D = ~16.7 TFLOP. Per image, useful work
is 10 x 2 rollout forwards + 2 x 2 trained steps x (fwd + input-grad bwd; LoRA needs no weight grads of the base) =
28 forwards = ~468 TFLOP (the issue's convention, with recompute and full weight grads, says ~600), i.e. ~1.7 img/s
at 790 TFLOP/s dense bf16. (Rows recorded before 2026-11-21 11:00 used 2 x 20.4B x tokens per forward, 2.8x too
many FLOPs, so their "limit" column, 0.46, was wrong; the measured img/s were right.)

    python benchmarks/flow_grpo.py                  # GPU, real size, same work as VeRL-Omni
    python benchmarks/flow_grpo.py --tiny --steps 1 # CPU smoke test of the same code path
    python benchmarks/flow_grpo.py --fp8            # FP8 GEMMs on the ODE steps, trained steps bf16 (issue 23)
    python benchmarks/flow_grpo.py --fp8 --fp8-trained-steps   # every step FP8 + old-log-prob recompute + TIS
    torchrun --standalone --nproc_per_node=4 benchmarks/flow_grpo.py   # data parallel: FSDP2, same work per GPU
    torchrun --standalone --nproc_per_node=4 benchmarks/flow_grpo.py --full --no-cfg   # issue 24: full fine-tuning,
        # fp32 weights/grads/AdamW sharded, bf16 compute; --save-check/--resume-check DIR (flow_full_session.sh)

Under torchrun every rank builds the same random transformer on its GPU, the trainer shards it with FSDP2 per block,
and `--prompts` stays per GPU (the global batch is `--prompts` x processes), so img/GPU/s compares directly with the
1-GPU row. With FSDP2 the LoRA adapters compute in bf16 like the base (fp32 in one process); see polyrl.distributed.dit_fsdp.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch

from polyrl.distributed.launch import exit_child
from polyrl.trainer.flow_config import FlowConfig
from polyrl.models.diffusion.pipeline import FlowPolicy, LatentShape
from polyrl.trainer.flow_grpo import FlowGRPOTrainer

from benchmarks._clocks import AllocatorClock, GCClock
from benchmarks.flow_resume_check import resume_check, save_check

PEER_IMG_PER_GPU_S = 0.305  # VeRL-Omni run_qwen_image_ocr_lora.sh, 4xH800
# VeRL-Omni full-model non-CFG on Qwen-Image OCR (seed 000): 4 H200s, fp32 optimizer state, 250 s per step
PEER_FULL = {"name": "VeRL-Omni full FT no-CFG 4xH200", "img_per_gpu_s": 0.510, "step_s": 250.0}
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


TEMPLATE_DROPPED, TEMPLATE_KEPT = 34, 5  # Qwen-Image's prompt template tokens before / after the prompt
WORDS = ["OPEN", "Take With Food", "SALE 50%", "Hello World", "EXIT", "Fresh Bread", "No Parking", "CAFE", "2026",
         "Welcome Home", "STOP", "Happy Birthday", "Library", "Night Market", "Gate 7", "Best Coffee in Town"]
SCENES = ["a wooden sign on a rustic door", "a neon sign glowing above a street corner", "a chalkboard menu outside a "
          "small bakery", "a paper label on a glass jar", "a banner hanging across a busy market street",
          "a vintage poster on a brick wall", "a hand-painted sign in a sunny garden", "a metal plaque by an "
          "office entrance"]  # fmt: skip


def ocr_prompts(num: int) -> list[tuple[str, dict]]:
    """flow_grpo's OCR task shape: a scene with text in double quotes, the quoted text as ground truth."""
    out = []
    for i in range(num):
        text = WORDS[i % len(WORDS)]
        scene = SCENES[(i // len(WORDS) + i) % len(SCENES)]
        out.append((f'{scene}, with the words "{text}" clearly written on it, high detail, soft light', {}))
    return out


class RandomIdTokenizer:
    """Stands in for Qwen2.5's tokenizer in `QwenImagePipeline.encode_prompt`: random ids, a Qwen-like count of them
    (~4 characters per token; the template around the prompt is TEMPLATE_DROPPED + TEMPLATE_KEPT tokens), seeded by
    the text so a prompt always encodes the same."""

    def __init__(self, vocab_size: int, template: str):
        self.vocab_size = vocab_size
        self.template_chars = len(template.format(""))

    def num_tokens(self, text: str) -> int:
        return TEMPLATE_DROPPED + TEMPLATE_KEPT + max(1, (len(text) - self.template_chars + 3) // 4)

    def __call__(self, texts, max_length=None, padding=True, truncation=True, return_tensors="pt", **_):
        from transformers import BatchEncoding

        lengths = [min(self.num_tokens(t), max_length or 10**9) for t in texts]
        ids = torch.zeros(len(texts), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (t, n) in enumerate(zip(texts, lengths)):
            seed = int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "little")
            ids[i, :n] = torch.randint(self.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
            mask[i, :n] = 1
        return BatchEncoding({"input_ids": ids, "attention_mask": mask})


def build_pipeline(transformer, *, tiny: bool, device, dtype):
    """A `QwenImagePipeline` around `transformer`: Qwen2.5-VL-7B-shaped text encoder, the real VAE config and the
    Qwen-Image scheduler config, random weights (tiny shapes with --tiny)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if tiny:
        text = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]})  # fmt: skip
        vae_kw = dict(base_dim=24, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1)
    else:  # Qwen2.5-VL-7B's language model
        text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                    num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1e6,
                    max_position_embeddings=128000, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})  # fmt: skip
        vae_kw = {}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        te = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                                                 vocab_size=text["vocab_size"],
                                                                 hidden_size=text["hidden_size"]))  # fmt: skip
        vae = AutoencoderKLQwenImage(**vae_kw)
    torch.set_default_dtype(prev)
    sch = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
                                          shift=1.0, shift_terminal=0.02, time_shift_type="exponential",
                                          use_dynamic_shifting=True)  # fmt: skip
    pipe = QwenImagePipeline(scheduler=sch, vae=vae.eval(), text_encoder=te.eval(), tokenizer=None,
                             transformer=transformer)  # fmt: skip
    pipe.tokenizer = RandomIdTokenizer(text["vocab_size"], pipe.prompt_template_encode)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def offloaded(encode_fn, text_encoder, device):
    """`encode_fn` with the text encoder in pinned host memory, brought to `device` for the call (one copy per tensor;
    nothing is copied back: its weights are frozen)."""
    from polyrl.utils.offload import FrozenOffload

    off = FrozenOffload(text_encoder)

    def encode(prompts):
        with off.on(device):
            return encode_fn(prompts)

    return encode


def side_tflop(pipe, prompts: list[str], size: int, device) -> tuple[float, float]:
    """(text encoder TFLOP per prompt, VAE decode TFLOP per image), counted by torch's FLOP counter on one call."""
    from torch.utils.flop_counter import FlopCounterMode

    from polyrl.models.diffusion.adapters import FAMILIES

    parts = FAMILIES["QwenImagePipeline"](pipe, height=size, width=size, max_sequence_length=256, guidance_scale=1.0)
    with torch.no_grad():
        with FlopCounterMode(display=False) as te:
            parts.encode_fn(prompts)
        z = torch.randn(1, parts.latent.grid_h * parts.latent.grid_w, parts.latent.channels, device=device)
        with FlopCounterMode(display=False) as vae:
            parts.decode_fn(z.to(pipe.vae.dtype))
    return te.get_total_flops() / len(prompts) / 1e12, vae.get_total_flops() / 1e12


MISMATCH_KEYS = ("rollout_corr/kl", "rollout_corr/k3_kl", "training/rollout_probs_diff_mean",
                 "training/rollout_probs_diff_max", "rollout_corr/rollout_is_mean", "rollout_corr/chi2_token")


def latent_reward_fn():
    """Stands in for VAE + OCR (--latent-reward); depends on the sample, so groups vary. A factory: async workers."""

    def latent_reward(latents, prompts, metadata):
        return -latents.float().flatten(1).abs().mean(1).cpu()

    return latent_reward


def latent_setup(transformer, ro, size: int, text_dim: int, text_len: int, device):
    """Issue 6's lighter run: random prompt embeddings cached for the whole run, identity decode, latent reward."""
    grid = size // 16
    g = torch.Generator().manual_seed(0)
    table = {}

    def encode(prompts):  # stands in for the Qwen2.5-VL encoder, encoded once per prompt for the whole run
        for p in prompts:
            table.setdefault(p, torch.randn(text_len, text_dim, generator=g) * 0.02)
        return [(table[p], torch.ones(text_len, dtype=torch.long)) for p in prompts]

    def sigmas(n):
        t = torch.linspace(1, 0, n + 1)
        return 3 * t / (1 + 2 * t)

    policy = FlowPolicy(transformer, encode_fn=encode, decode_fn=lambda z: z.float(), sigmas_fn=sigmas,
                        latent=LatentShape(grid, grid, transformer.config.in_channels),
                        true_cfg_scale=ro.pipeline.true_cfg_scale, device=device)  # fmt: skip
    prompts = [(f"prompt {i}", {}) for i in range(64)]
    return policy, latent_reward_fn(), prompts, text_len


def work_words(args, result: dict) -> str:
    """What the row's step did, for the benchmark history."""
    if args.latent_reward:
        words = "random text embeds, latent reward (no VAE/OCR)"
    else:
        words = (f"same work: Qwen2.5-VL-7B-shaped text encoder each step (random ids, {result['text_tokens_mean']:.0f} "
                 f"prompt tokens), VAE decode to 512^2, rapidocr OCR"
                 f"{f' + VLM-judge-sized model on {args.judge_gpu}' if args.judge_gpu else ''} "
                 f"{'in a worker process' if args.async_reward else 'in the step'}, all samples trained")  # fmt: skip
        if args.brightness_term:
            words += f" (+ {args.brightness_term} x brightness in the reward: nonzero advantages and gradients)"
    if args.fp8 and not args.fp8_trained_steps:
        words += "; FP8 GEMMs on the 8 ODE steps, the trained steps sample in bf16 (no old-log-prob recompute)"
    elif args.fp8:
        words += (f"; FP8 sampling GEMMs on every step + bf16 old-log-prob recompute (timing_s/old_log_prob "
                  f"{result.get('timing_s/old_log_prob', 0):.1f}s), TIS token 2.0, mismatch KL "
                  f"{result.get('rollout_corr/kl', float('nan')):.2e}")  # fmt: skip
    return words


def reward_gpu_words(args, device: str, img_s: float) -> str:
    """A judge on a GPU of its own (not the actor's): the row's number is per actor GPU; this gives it over all the
    GPUs the step held too, as seed 000 counts its 4 actor + 1 reward GPUs (0.280 img/GPU/s over 5)."""
    if not args.judge_gpu or torch.device(args.judge_gpu) == torch.device(device if device != "cuda" else "cuda:0"):
        return ""
    return f"; over actor + reward GPUs: {img_s / 2:.3f} img/GPU/s (1 actor GPU + 1 reward GPU)"


def one_per_text_bucket(policy, prompts: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """One prompt per padded text length the run can meet. The compiled rollout has one static graph per batch shape
    (per precision with FP8), and the text length is padded to a multiple of 32 (`pad_prompts`): the OCR prompts
    give 32 or 64, and with one prompt a step the default data order first meets 64 at the third timed step, whose
    compile then landed inside the 2026-11-26 rows' timing. Generating one chunk per bucket after the warm-up step
    compiles them all first. The update's compiled blocks meet a new text length the same way (a timed update took
    6.5 s against 4.9 on its first 64-token batch, H200, 2026-11-26), so each bucket also runs one update (zero
    advantages: the warm-up's only change to the weights is AdamW's decay)."""
    seen: dict[int, tuple[str, dict]] = {}
    negative = [policy.negative_prompt] if policy.true_cfg_scale > 1 else []
    policy.cache_prompts([p for p, _ in prompts])  # one text-encoder call (an offloaded encoder moves once)
    for item in prompts:
        width = policy.prompt_batch([item[0], *negative])[0].shape[1]  # [B, T, D] embeds first
        seen.setdefault(width, item)
    return list(seen.values())


def brightness(images, prompts, metadata):
    """Mean pixel value of each image: varies within a group even for random weights (--brightness-term)."""
    return images.float().mean(dim=(1, 2, 3)).cpu()


def ocr_reward(brightness_term: float = 0.0):
    """The OCR reward (+ `brightness_term` x brightness). A factory: the async reward workers build it too."""
    from polyrl.rewards import image_rewards

    weights = {"ocr": 1.0, **({"brightness": brightness_term} if brightness_term else {})}
    return image_rewards.build_reward(weights, extra={"brightness": brightness})


GEN_PARTS = ("encode_prompts", "fp8_quantise", "decode")  # timed inside gen


def encode_profiled(policy, progress) -> None:
    """Wrap the policy's next `cache_prompts` call (a step's prompt encoding) in the torch profiler and print its
    busiest ops by CPU and by CUDA time: where a slow encode goes (a stall of 0.7-1.2 s in some runs' fifth step)."""
    from torch.profiler import ProfilerActivity, profile

    plain = policy.cache_prompts

    def once(prompts):
        policy.cache_prompts = plain
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            plain(prompts)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        progress(f"profiled encode: {time.perf_counter() - t0:.2f} s")
        for key in ("self_cpu_time_total", "self_device_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60), flush=True)

    policy.cache_prompts = once


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
    ap.add_argument("--profile-encode", type=int, default=0, metavar="N",
                    help="torch-profile timed step N's prompt encoding; its top ops by CPU and by CUDA time printed")
    ap.add_argument("--no-ckpt", action="store_true", help="no gradient checkpointing")
    ap.add_argument("--auto-memory", action="store_true",
                    help="gradient checkpointing on auto (off until an OOM turns it on; micro-batches halve after)")
    ap.add_argument("--rollout-micro", type=int, help="images per sampling forward (default: --micro)")
    ap.add_argument("--latent-reward", action="store_true",
                    help="issue 6's lighter run: cached random prompt embeddings, latent reward (no text encoder/VAE/OCR)")
    ap.add_argument("--fp8", action="store_true",
                    help="rollout.quantization=fp8: e4m3 block GEMMs on the ODE steps when sampling")
    ap.add_argument("--fp8-trained-steps", action="store_true",
                    help="with --fp8: the trained steps in FP8 too, old log-probs recomputed, token-level TIS")
    ap.add_argument("--async-reward", action="store_true",
                    help="reward.async_reward: OCR in a worker process while the next rollout chunk is generated")
    ap.add_argument("--offload-text-encoder", action="store_true",
                    help="keep the text encoder in host memory except while it encodes (VeRL-Omni's rollout sleeps, "
                         "weights offloaded, while the actor trains); frees ~14 GiB; the 15 GB come from pinned host memory "
                         "each step (~1 s on an H200), nothing goes back (the FP8 ODE-step mode no longer needs it: its "
                         "copies are released for the update)")
    ap.add_argument("--judge-gpu", help="also run a VLM-judge-sized model (benchmarks/flow_reward_judge.py) on this "
                                        "device for each image: in the async worker with --async-reward, else in the step")
    ap.add_argument("--reward-workers", type=int, default=1,
                    help="reward.num_workers: OCR worker processes with --async-reward (a chunk is split across them)")
    ap.add_argument("--brightness-term", type=float, default=0.0,
                    help="add this weight x mean pixel brightness to the OCR reward: random weights draw no text, so "
                         "OCR alone gives every group zero advantages and zero gradients; this gives real ones")
    ap.add_argument("--save-check", metavar="DIR",
                    help="after the timed steps: save a checkpoint under DIR, run one more step, write DIR/uninterrupted.json")
    ap.add_argument("--resume-check", metavar="DIR",
                    help="resume --save-check's checkpoint (no warm-up), run that step, compare with DIR/uninterrupted.json")
    ap.add_argument("--record", action="store_true", help="append a row to benchmarks/history.jsonl (or --rows-out)")
    ap.add_argument("--rows-out", help="with --record: append the row to this file instead (runs on another machine)")
    ap.add_argument("--note", default="", help="with --record: words added to the row's config column")
    args = ap.parse_args()

    from diffusers import QwenImageTransformer2DModel

    from polyrl.distributed import DistEnv

    dist = DistEnv.setup("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    started = time.perf_counter()

    def progress(what: str) -> None:  # where a long run's minutes go, on screen as they pass (rank 0)
        if dist.is_rank0:
            print(f"[{time.perf_counter() - started:6.0f} s] {what}", flush=True)
    device = dist.device if dist.is_distributed else ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    on_gpu = torch.device(device).type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    size, text_dim, text_len = (512, 3584, 128) if not args.tiny else (64, 32, 16)
    kw = {} if not args.tiny else dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                       axes_dims_rope=(8, 4, 4))  # fmt: skip
    t0 = time.perf_counter()
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    # build directly on the GPU: bf16 for LoRA; fp32 for full fine-tuning (verl's recipe: fp32 weights, gradients and
    # AdamW state, sharded by FSDP2, with bf16 compute through mixed_precision.param_dtype; 82 GB per rank until sharded)
    torch.set_default_dtype(torch.float32 if args.full else dtype)
    with torch.device(device):
        transformer = QwenImageTransformer2DModel(**kw)
    torch.set_default_dtype(prev)
    num_params = sum(p.numel() for p in transformer.parameters())
    build_s = time.perf_counter() - t0
    progress(f"DiT built ({num_params / 1e9:.1f}B parameters)")
    grid = size // 16  # VAE /8, packing /2

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
    if args.full and on_gpu:
        actor.fsdp_config.mixed_precision = {"param_dtype": "bfloat16"}
    # never resume a stale checkpoint by accident: only --resume-check resumes, from its own folder
    cfg.trainer.default_local_dir = args.save_check or args.resume_check
    cfg.trainer.resume_mode = "auto" if args.resume_check else "disable"
    cfg.trainer.progress_bar = False
    ro.pipeline.height = ro.pipeline.width = size
    if args.fp8:
        ro.quantization, ro.fp8_trained_steps = "fp8", args.fp8_trained_steps
        if args.fp8_trained_steps:
            cfg.algorithm.rollout_correction.rollout_is = "token"  # TIS at 2.0, the LLM side's default threshold
    cfg.reward.async_reward, cfg.reward.num_workers = args.async_reward, args.reward_workers
    if args.latent_reward:
        policy, reward_fn, prompts, text_tokens = latent_setup(transformer, ro, size, text_dim, text_len, device)
        cfg.actor_rollout_ref.model.cache_prompt_embeds = True
        te_tflop = vae_tflop = 0.0
    else:
        from polyrl.models.diffusion.adapters import FAMILIES

        pipe = build_pipeline(transformer, tiny=args.tiny, device=device, dtype=dtype)
        prompts = ocr_prompts(64)
        te_tflop, vae_tflop = side_tflop(pipe, [p for p, _ in prompts[:8]], size, device)
        parts = FAMILIES["QwenImagePipeline"](pipe, height=size, width=size, max_sequence_length=256,
                                              guidance_scale=1.0)  # fmt: skip
        encode_fn = parts.encode_fn if not args.offload_text_encoder else offloaded(parts.encode_fn, pipe.text_encoder, device)
        policy = FlowPolicy(transformer, encode_fn=encode_fn, decode_fn=parts.decode_fn, sigmas_fn=parts.sigmas_fn,
                            latent=parts.latent, true_cfg_scale=ro.pipeline.true_cfg_scale, device=device,
                            adapter=parts.adapter)  # fmt: skip
        reward_fn = ocr_reward(args.brightness_term)
        if args.judge_gpu and not args.async_reward:
            from benchmarks.flow_reward_judge import judge_reward

            reward_fn = judge_reward(args.judge_gpu, args.tiny)
        actor.skip_zero_adv = False  # random weights draw no text: train every sample, as a real batch would
        tok = pipe.tokenizer
        text_tokens = sum(tok.num_tokens(pipe.prompt_template_encode.format(p)) - TEMPLATE_DROPPED
                          for p, _ in prompts) / len(prompts)  # fmt: skip
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

    scorer = None
    if args.async_reward:
        from polyrl.rewards.async_scorer import build_scorer

        from benchmarks.flow_reward_judge import judge_reward

        scorer = (build_scorer(cfg.reward, latent_reward_fn) if args.latent_reward else
                  build_scorer(cfg.reward, judge_reward, (args.judge_gpu, args.tiny)) if args.judge_gpu else
                  build_scorer(cfg.reward, ocr_reward, (args.brightness_term,)))  # fmt: skip
    trainer = FlowGRPOTrainer(cfg, policy, reward_fn, prompts, prompts[:2], dist=dist, async_scorer=scorer)
    progress("trainer built")
    if args.resume_check:
        resume_check(trainer, args.resume_check, dist)
        if scorer is not None:
            scorer.close()
        return
    gc_clock, alloc_clock = GCClock(), AllocatorClock()
    trainer.step()  # warm-up (allocator, kernels)
    progress(f"warm-up step done; {gc_clock.pop()}; {alloc_clock.pop()}")
    if args.compile:  # every compiled shape before timing: a rollout and an update per text bucket
        per_chunk = min(args.prompts, max(1, (ro.log_prob_micro_batch_size_per_gpu or args.micro) // ro.n))
        for prompt in one_per_text_bucket(policy, prompts):
            rollout = trainer.generate([prompt] * per_chunk)
            trainer.score(rollout)
            trainer.update_actor(rollout, torch.zeros(len(rollout.prompts)))
        progress(f"every text bucket compiled; {gc_clock.pop()}; {alloc_clock.pop()}")
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    rows = []
    for i in range(args.steps):
        if i + 1 == args.profile_encode:
            encode_profiled(policy, progress)
        rows.append(trainer.step())
        progress(f"timed step {i + 1}: " + ", ".join(f"{k} {rows[-1]['timing_s/' + k]:.2f} s" for k in
                                                    ("gen", *GEN_PARTS, "reward", "update_actor", "step")
                                                    if "timing_s/" + k in rows[-1]) +
                 f"; {gc_clock.pop()}; {alloc_clock.pop()}")
    keys = sorted({k for r in rows for k in r if k.startswith("timing_s/")})
    timing = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    images = args.prompts * ro.n  # per GPU
    img_s = images / timing["timing_s/step"]  # the slowest rank's step time (merged metrics)
    cfg_mult = 1 if args.no_cfg else 2
    full_peer = args.full and args.no_cfg  # the seed's full-model recipe, else its LoRA CFG one
    peer = PEER_FULL["img_per_gpu_s"] if full_peer else PEER_IMG_PER_GPU_S
    peer_words = (f"{PEER_FULL['name']}: {peer} ({PEER_FULL['step_s']:.0f} s/step)" if full_peer else
                  f"VeRL-Omni 4xH800: {peer}")
    fwd = forward_tflop(transformer, grid * grid, round(text_tokens))
    trained = 3 if args.full else 2  # forward + input-grad backward (+ weight-grad backward when full FT)
    dit_tflop = fwd * cfg_mult * (ro.pipeline.num_inference_steps + ro.algo.sde_window_size * trained)
    # text encoder: each step's prompts once plus the negative prompt once (shared by the n images of a prompt)
    te_per_image = te_tflop * (args.prompts + (cfg_mult > 1)) / images
    tflop_per_image = dit_tflop + te_per_image + vae_tflop
    limit = PEAK_TFLOPS / tflop_per_image
    result = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "processes": dist.world_size,
        "params_B": num_params / 1e9, "build_s": build_s, "images_per_step": images,
        "img_per_gpu_s": img_s, "peer_img_per_gpu_s": peer, "limit_img_per_gpu_s": limit,
        "tflop_per_image": tflop_per_image, "dit_tflop_per_image": dit_tflop, "text_encoder_tflop_per_image": te_per_image,
        "vae_tflop_per_image": vae_tflop, "text_tokens_mean": text_tokens, "achieved_tflops": img_s * tflop_per_image,
        "work": "latent reward" if args.latent_reward else "text encoder + DiT + VAE + OCR",
        "fp8": args.fp8, "async_reward": args.async_reward, "judge_gpu": args.judge_gpu, **timing,
        "max_memory_gb": rows[-1].get("perf/max_memory_allocated_gb", 0.0),
        "ratio_mean": rows[-1].get("actor/ratio_mean"), "pg_clipfrac": rows[-1].get("actor/pg_clipfrac"),
        "grad_norm": rows[-1].get("actor/grad_norm"),
        **{k: sum(r[k] for r in rows) / len(rows) for k in MISMATCH_KEYS if k in rows[-1]},
        "steps_s": [{k[9:]: round(r[k], 2) for k in ("timing_s/gen", "timing_s/update_actor", "timing_s/step")}
                    for r in rows],  # each timed step: a compile or retry inside one shows here
        "oom_retries": trainer.oom.num_retries, "grad_ckpt": cfg.actor_rollout_ref.model.enable_gradient_checkpointing,
        "micro": actor.ppo_micro_batch_size_per_gpu, "rollout_micro": ro.log_prob_micro_batch_size_per_gpu,
        "max_memory_gb_per_rank": dist.all_gather_object(round(torch.cuda.max_memory_allocated() / 1e9, 1)
                                                         if on_gpu else 0.0),
        "fsdp": {"reshard_after_forward": actor.fsdp_config.reshard_after_forward,
                 "mixed_precision": actor.fsdp_config.mixed_precision} if dist.is_distributed else None,
    }  # fmt: skip
    if dist.is_rank0:
        print(json.dumps(result, indent=1), flush=True)
    if args.record and not args.tiny and dist.is_rank0:  # before the checkpoint check: the row survives its failure
        from benchmarks._record import append_row

        procs = f"{dist.world_size} process(es)" + (" (FSDP2, blocks kept gathered)" if args.keep_gathered else
                                                     " (FSDP2)" if dist.is_distributed else "")
        if args.full and on_gpu:
            procs += ", fp32 weights + grads + AdamW" + (" sharded" if dist.is_distributed else "") + ", bf16 compute"
        shape = (f"Qwen-Image DiT {num_params / 1e9:.1f}B {'fp32' if args.full else 'bf16'} random, 512^2, 10 steps, window 2, "
                 f"{'no CFG' if args.no_cfg else 'CFG 4'}, {'full FT' if args.full else 'LoRA r64'}, group 16, {procs}, "
                 f"{images} img/step/GPU, micro {actor.ppo_micro_batch_size_per_gpu}"
                 f"{f' (rollout {ro.log_prob_micro_batch_size_per_gpu})' if ro.log_prob_micro_batch_size_per_gpu else ''}, "
                 f"{'grad ckpt' if cfg.actor_rollout_ref.model.enable_gradient_checkpointing else 'no ckpt'}"
                 f"{f' (auto memory, {trainer.oom.num_retries} OOM retries)' if args.auto_memory else ''}"
                 f"{', compiled blocks (update and rollout static shapes)' if args.compile else ''}"
                 f"{', TF32 LoRA matmuls' if args.tf32 else ''}; step {timing['timing_s/step']:.1f}s, "
                 f"peak {max(result['max_memory_gb_per_rank']):.1f} GB/GPU, gen {timing['timing_s/gen']:.1f}s, "
                 f"update {timing['timing_s/update_actor']:.1f}s, reward {timing['timing_s/reward']:.1f}s"
                 f"{''.join(f', {k[9:]} {v:.2f}s' for k, v in timing.items() if k[9:] in GEN_PARTS)}, "
                 f"ratio_mean {result['ratio_mean']:.6f}; {work_words(args, result)}"
                 f"{reward_gpu_words(args, device, img_s)}"
                 f"{'; ' + args.note if args.note else ''}")  # fmt: skip
        gpus = (f"{dist.world_size}x " if dist.is_distributed else "") + result["device"]
        append_row(gpus, "flow_grpo img/GPU/s", shape, f"{img_s:.3f}", peer_words, f"{limit:.2f}", f"{img_s / peer:.2f}",
                   f"{img_s / limit:.2f}", path=args.rows_out)  # fmt: skip
    if args.save_check:
        save_check(trainer, args.save_check, dist)
    if scorer is not None:
        scorer.close()
    dist.finish()


if __name__ == "__main__":
    main()
    exit_child(0)
