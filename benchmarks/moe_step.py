"""Qwen3-30B-A3B GRPO at NeMo RL's shape: the whole step in tokens/s/GPU, each stage beside its limit (issue 47).

    PYTHONPATH=. torchrun --standalone --nproc_per_node=4 benchmarks/moe_step.py                   # 4 GPUs, on-policy
    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 benchmarks/moe_step.py --layers 24       # the 2-GPU cut
    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 benchmarks/moe_step.py --mode offpolicy --layers 24
    PYTHONPATH=. torchrun --standalone --nproc_per_node=4 benchmarks/moe_step.py --mode offpolicy --trainers 2  # 2+2
    PYTHONPATH=. torchrun --standalone --nproc_per_node=4 benchmarks/moe_step.py --prompts 8 --n 16 --mini-prompts 4
    PYTHONPATH=. python benchmarks/moe_step.py --shape tiny --device cpu --prompts 2 --n 2 --mini-prompts 2 --mean-len 24 \\
        --max-len 32 --steps 1 --warmup 0 --rollout hf                                             # CPU smoke test

The model is Qwen3-30B-A3B's real shape (48 layers, hidden 2048, 128 experts of width 768, 8 active,
norm_topk_prob, 32 q / 4 kv heads of 128, vocab 151,936, untied head) with random weights; `--layers N` keeps the
first N layers. NeMo RL's shape (docs/about/performance-summary.md; research/moe.md): 2,048 samples a step (64
prompts x 32), 512 a mini-batch (16 prompts), max sequence 4,096 and generated mean ~3,200: here forced response
lengths with mean `--mean-len` and max `--max-len` (a normal around the mean clipped to [64, max] and rescaled to
the mean, one row at the max: long-tailed toward short rows, as NeMo's reasoning lengths pile up at the cap), so
the random weights never stop early. Everything else is `polyrl train`'s defaults (`--extra` adds keys: R3 replay,
FP8 rollout, ...), colocated data parallel over the processes, or with `--mode offpolicy` the one-step off-policy
pipeline. Rollout `--rollout native` (default; the engine falls back to `hf` with one line where it has no MoE
layers) or `hf`.

Printed per run (means over the timed steps, after `--warmup`):
- tokens/s/GPU over the whole step (every prompt and response token of the batch / step time / GPUs), against NeMo
  RL v0.6's 1,102 on-policy and 1,414 one-step off-policy (32 H100s) and the issue's goals (2,200 / 2,800);
- gen: seconds beside the decode-bytes limit of the drawn lengths (every decode step reads the GPU's bf16 weights
  but the input embedding, of the 128 experts the share its live rows route to: all from ~64 rows, fewer in the
  tail, plus the KV cache of its live rows) at the measured copy bandwidth;
- update_actor (and old_log_prob where it runs) beside the training-FLOPs limit at the active parameters (a token
  passes 8 of 128 experts: 3.04B matmul weights, ~18.3 GFLOP a trained token plus attention; learner/flops.py) at
  989 TFLOP/s a GPU, and the MFU on active parameters.
`--rows-out BENCHMARKS.md` appends one row (benchmarks/_record.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offpolicy_step import ForcedLengths  # noqa: E402

NEMO = {"on": 1102, "off": 1414}  # NeMo RL v0.6, Qwen3-30B-A3B, 32 H100s, tok/s/GPU
GOAL = {"on": 2200, "off": 2800}  # issue 47


def qwen3_30b_a3b(layers: int = 48, **kw):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=layers,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                          rope_theta=1e6, tie_word_embeddings=False, initializer_range=0.02, **kw)


def tiny_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=151936, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                          tie_word_embeddings=False)


class NemoLengths(ForcedLengths):
    """Forced lengths with NeMo RL's mean and max (module docstring); every draw is kept for the decode limit."""

    drawn: list[list[int]] = []

    def lengths(self, num: int) -> list[int]:
        rng = np.random.default_rng(self.seed + self.calls)
        self.calls += 1
        low = min(64, self.max_len)
        x = np.clip(rng.normal(self.mean_len, 0.3 * self.max_len, num), low, self.max_len)
        for _ in range(4):  # clipping moved the mean: rescale toward it and clip again
            x = np.clip(x * self.mean_len / x.mean(), low, self.max_len)
        x = x.astype(int)
        x[int(np.argmax(x))] = self.max_len
        NemoLengths.drawn.append(x.tolist())
        return x.tolist()


def setup(work: Path, args) -> None:
    """grpo_step.py's tokenizer, prompts and reward; the model directory replaced by the MoE (bf16, random)."""
    from grpo_step import setup as dense_setup

    dense_setup(work, init_std=0.02, num_prompts=args.prompts * (args.steps + 2), prompt_tokens=args.prompt,
                shape="tiny", device="cpu")
    cfg = qwen3_30b_a3b(args.layers) if args.shape == "30b-a3b" else tiny_moe()
    from polyrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id, cfg.use_cache = tok.pad_token_id, tok.eos_token_id, None, True
    write_random_checkpoint(cfg, work / "model", device=args.device,
                            dtype=torch.bfloat16 if args.device == "cuda" else torch.float32)
    if args.device == "cuda":  # rank 0's GPU would keep its generator's blocks cached (the planner's free memory short)
        torch.cuda.empty_cache()


def write_random_checkpoint(cfg, out: Path, *, device: str, dtype: torch.dtype, std: float = 0.02,
                            shard_bytes: int = 4 << 30) -> None:
    """A random checkpoint of `cfg` in HF's on-disk layout (experts one tensor each, as transformers saves and
    loads them), written shard by shard: no model is ever built. (`from_config` + `save_pretrained` of all 48
    layers ran out of memory on an 80 GB GPU: the save splits the fused experts into copies on the GPU.) Weights
    ~ N(0, std), norms 1."""
    import copy

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    one = copy.deepcopy(cfg)
    one.num_hidden_layers = 1
    with torch.device("meta"):
        layer0 = AutoModelForCausalLM.from_config(one).state_dict()
    names: list[tuple[str, tuple[int, ...]]] = []
    for name, t in layer0.items():
        if ".layers.0." not in name:
            names.append((name, tuple(t.shape)))
            continue
        for i in range(cfg.num_hidden_layers):
            n = name.replace(".layers.0.", f".layers.{i}.")
            if n.endswith("experts.gate_up_proj"):  # [E, 2I, H] -> each expert's gate and up [I, H]
                e, two_i, h = t.shape
                names += [(n.replace("gate_up_proj", f"{x}.{p}_proj.weight"), (two_i // 2, h))
                          for x in range(e) for p in ("gate", "up")]
            elif n.endswith("experts.down_proj"):  # [E, H, I] -> each expert's down [H, I]
                names += [(n.replace("down_proj", f"{x}.down_proj.weight"), tuple(t.shape[1:]))
                          for x in range(t.shape[0])]
            else:
                names.append((n, tuple(t.shape)))
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:  # grpo_step's dense model
        old.unlink()
    gen = torch.Generator(device).manual_seed(0)
    shard, size, weight_map, files = {}, 0, {}, 0

    def flush():
        nonlocal shard, size, files
        files += 1
        fname = f"model-{files:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        shard, size = {}, 0

    for name, shape in names:
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype)
        else:
            t = (torch.randn(shape, generator=gen, device=device) * std).to(dtype).cpu()
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    total = sum(math.prod(s) for _, s in names) * torch.finfo(dtype).bits // 8
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    cfg.dtype = dtype
    cfg.save_pretrained(out)


def bandwidth(device: str) -> float:
    if device != "cuda":
        return 0.0
    from rollout import copy_bandwidth

    return copy_bandwidth()


def decode_limit_s(lengths: list[int], *, prompt: int, rows_per_gpu: int, weight_bytes: float, kv_per_token: int,
                   bw: float, expert_bytes: float = 0.0, experts: int = 1, top_k: int = 1) -> float:
    """Seconds one GPU needs at least to decode its share of `lengths` (contiguous rows, as data shards take them):
    every decode step reads the dense weights (`weight_bytes`: all but the routed experts and the input embedding),
    the experts its live rows route to (with n live rows, a share 1 - (1 - top_k/experts)^n of `expert_bytes`, routing
    taken as uniform, as random weights route: all of them from ~64 rows, fewer in the tail where rows have finished)
    and each live row's KV cache; the GPU with the longest work bounds."""
    if bw <= 0:
        return 0.0
    worst = 0.0
    for start in range(0, len(lengths), rows_per_gpu):
        mine = np.sort(np.array(lengths[start:start + rows_per_gpu]))
        steps = int(mine.max())
        # live rows at step t: those longer than t; KV read at step t: sum over live rows of (prompt + t) tokens
        t = np.arange(steps)
        live = len(mine) - np.searchsorted(mine, t, side="right")
        kv_tokens = float(np.sum(live * (prompt + t)))
        touched = float(np.sum(1.0 - (1.0 - top_k / experts) ** live))
        worst = max(worst, (steps * weight_bytes + touched * expert_bytes + kv_tokens * kv_per_token) / bw)
    return worst


def main(argv=None) -> None:
    from offpolicy_step import add_placement_args, run
    from offpolicy_step import overrides as run_keys

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["colocated", "offpolicy"], default="colocated")
    add_placement_args(ap)
    ap.add_argument("--shape", choices=["30b-a3b", "tiny"], default="30b-a3b")
    ap.add_argument("--layers", type=int, default=48, help="keep the first N of Qwen3-30B-A3B's 48 layers")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per step, whole job (NeMo RL: 64)")
    ap.add_argument("--n", "--samples-per-prompt", dest="n", type=int, default=32)
    ap.add_argument("--mini-prompts", type=int, default=16, help="prompts per mini-batch (NeMo RL: 512 samples)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--mean-len", type=int, default=3200)
    ap.add_argument("--max-len", type=int, default=4096 - 256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rollout", choices=["native", "hf"], default="native")
    ap.add_argument("--work", default="/tmp/moe_step")
    ap.add_argument("--rows-out", default=None)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--extra", nargs="*", default=[], help="polyrl train overrides (R3, FP8 rollout, ...)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    from polyrl.config import build_config
    from polyrl.learner.flops import PEAK_BF16_FLOPS, matmul_params, training_flops
    from polyrl.trainer.config import PPOConfig

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    work = Path(args.work) / f"{args.shape}-{args.layers}"
    work.mkdir(parents=True, exist_ok=True)
    ready = work / f"ready-{os.environ.get('TORCHELASTIC_RUN_ID', 'single')}"
    if rank == 0:
        setup(work, args)
        ready.write_text("ok")
    while not ready.exists():
        time.sleep(0.5)
    # offpolicy_step.py's keys (memory on auto), the mini-batch, no checkpoints; the user's keys last
    args.max_age, args.grad_ckpt, args.max_token_len, args.gpu_mem_colocated, args.gpu_mem_rollout = 1, "auto", None, \
        None, None
    extra, args.extra = list(args.extra), []
    keys = run_keys(args, work, work / "model", work / "tokenizer", prompt_len=args.prompt)
    keys += [f"actor_rollout_ref.actor.ppo_mini_batch_size={args.mini_prompts}", "trainer.save_freq=-1"] + extra
    ppo_cfg = build_config(PPOConfig(), keys)
    lora = ppo_cfg.actor_rollout_ref.model.lora_rank > 0
    steps = run(args, ppo_cfg, NemoLengths)
    if steps is None:
        return
    timed = steps[args.warmup:] or steps
    mean = lambda key: float(np.mean([m.get(key, 0.0) for m in timed]))  # noqa: E731
    step_s, tokens = mean("timing_s/step"), mean("perf/total_num_tokens")
    tps_gpu = tokens / step_s / world

    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(work / "model")
    trunk, head = matmul_params(cfg)
    total_params = sum(np.prod(s) for s in _param_shapes(cfg))
    gen_gpus = world - args.trainers if args.mode == "offpolicy" else world
    train_gpus = args.trainers if args.mode == "offpolicy" else world
    bw = bandwidth(args.device)
    fp8_kv = ppo_cfg.actor_rollout_ref.rollout.kv_cache_dtype in ("fp8", "fp8_e4m3")  # e4m3 + an fp32 scale a head
    head_bytes = cfg.head_dim + 4 if fp8_kv else 2 * cfg.head_dim
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_bytes
    draws = NemoLengths.drawn[-len(timed):] if NemoLengths.drawn else []
    rows = args.prompts * args.n
    expert_params = sum(np.prod(s) for s in _param_shapes(cfg, experts_only=True))
    dense_params = total_params - expert_params - cfg.vocab_size * cfg.hidden_size  # the input embedding: a lookup
    gen_limit = float(np.mean([decode_limit_s(d, prompt=args.prompt, rows_per_gpu=max(1, len(d) // gen_gpus),
                                              weight_bytes=2 * dense_params, kv_per_token=kv_per_token, bw=bw,
                                              expert_bytes=2 * expert_params, experts=cfg.num_experts,
                                              top_k=cfg.num_experts_per_tok)
                               for d in draws])) if draws and bw else 0.0
    lens = [[args.prompt + x for x in d] for d in draws] or [[args.prompt + args.mean_len] * rows]
    flops = float(np.mean([training_flops(cfg, s, lm_head_tokens=sum(s) - args.prompt * len(s)) for s in lens]))
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), 0.0)
    update_s, old_s, gen_s = mean("timing_s/update_actor"), mean("timing_s/old_log_prob"), mean("timing_s/gen")
    update_limit = flops / (peak * train_gpus) if peak else 0.0
    old_limit = flops / 3 / (peak * train_gpus) if peak and old_s else 0.0
    mfu = update_limit / update_s if update_s and update_limit else 0.0
    regime = "off" if args.mode == "offpolicy" else "on"
    summary = dict(device=f"{world}x {name}", mode=args.mode, layers=cfg.num_hidden_layers, rows=rows,
                   tokens_per_s_per_gpu=tps_gpu, step_s=step_s, tokens_per_step=tokens,
                   response_length_mean=mean("response_length/mean"), response_length_max=mean("response_length/max"),
                   gen_s=gen_s, gen_limit_s=gen_limit, old_log_prob_s=old_s, old_log_prob_limit_s=old_limit,
                   update_actor_s=update_s, update_limit_s=update_limit, mfu_active=mfu,
                   update_weights_s=mean("timing_s/update_weights"), copy_bandwidth_gb_s=bw / 1e9,
                   peak_memory_gib=max((m.get("perf/max_memory_allocated_gb", 0.0) for m in steps), default=0.0),
                   lora=lora,
                   active_matmul_params=trunk + head, total_params=float(total_params),
                   gflop_per_trained_token=flops / max(1, sum(map(sum, lens)) / len(lens)) / 1e9)
    model = "Qwen3-30B-A3B shape" if args.shape == "30b-a3b" else "tiny MoE"
    print(f"\n{model} ({cfg.num_hidden_layers} layers, {total_params / 1e9:.1f}B params, "
          f"{(trunk + head) / 1e9:.2f}B active), {rows} samples ({args.prompts}x{args.n}), mini-batch "
          f"{args.mini_prompts * args.n}, {args.mode} on {world}x {name}")
    print(f"  step      {step_s:8.1f} s   {tps_gpu:8,.0f} tok/s/GPU   NeMo RL v0.6 {NEMO[regime]:,} "
          f"({tps_gpu / NEMO[regime]:.2f}x), goal {GOAL[regime]:,}")
    print(f"  gen       {gen_s:8.1f} s   limit {gen_limit:7.1f} s (decode bytes at {bw / 1e12:.2f} TB/s: "
          f"{100 * gen_limit / gen_s if gen_s and gen_limit else 0:.0f}% of it)")
    if old_s:
        print(f"  old_lp    {old_s:8.1f} s   limit {old_limit:7.1f} s (forward FLOPs, active params)")
    print(f"  update    {update_s:8.1f} s   limit {update_limit:7.1f} s (training FLOPs on the active params, "
          f"{summary['gflop_per_trained_token']:.1f} GFLOP/token): MFU {100 * mfu:.1f}%"
          + (" (counted as full fine-tuning: LoRA skips the frozen weights' gradients)" if lora else ""))
    print(f"  peak GPU memory allocated {summary['peak_memory_gib']:.1f} GiB (rank 0)")
    print(f"  weights   {summary['update_weights_s']:8.2f} s")
    print("SUMMARY " + json.dumps(summary), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"summary": summary, "steps": steps}, indent=1, default=str))
    if args.rows_out:
        from _record import append_row

        shape = (f"{model} {cfg.num_hidden_layers} layers random init, GRPO {rows} samples "
                 f"({args.prompts}x{args.n}), mini-batch {args.mini_prompts * args.n}, prompt {args.prompt}, forced "
                 f"resp mean {summary['response_length_mean']:,.0f} max {args.max_len}; {args.mode}; "
                 f"{' '.join(extra) or 'defaults'}; rollout {args.rollout}; gen {gen_s:.1f} s (limit {gen_limit:.1f}), "
                 f"old_log_prob {old_s:.1f} s, update {update_s:.1f} s (limit {update_limit:.1f}, MFU active "
                 f"{100 * mfu:.1f}%{', counted as full FT' if lora else ''}), step {step_s:.1f} s, peak "
                 f"{summary['peak_memory_gib']:.1f} GiB allocated; {len(timed)} timed step(s)")
        append_row(summary["device"], f"moe_step.py ({args.mode}) tok/s/GPU (issue 47)", shape, f"{tps_gpu:,.0f}",
                   peer=f"NeMo RL v0.6 32xH100: {NEMO[regime]:,}", limit=f"goal {GOAL[regime]:,}",
                   ratio_peer=f"{tps_gpu / NEMO[regime]:.2f}x", ratio_limit=f"{tps_gpu / GOAL[regime]:.2f} of goal",
                   path=args.rows_out)


def _param_shapes(cfg, experts_only: bool = False):
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        return [p.shape for n, p in AutoModelForCausalLM.from_config(cfg).named_parameters()
                if not experts_only or (".experts." in n and p.dim() == 3)]


if __name__ == "__main__":
    main()
