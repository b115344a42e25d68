"""Does LoRA GRPO of Llama-3.1-70B fit on 4 GPUs (issue 48), and of Qwen3-30B-A3B on one GPU (issue 47)?

PLANNER PREDICTIONS, NOT MEASUREMENTS. Nothing here runs on a GPU: the script builds each model's real config on the
meta device (no weights), wraps it in LoRA as the trainer does (`models/loader.apply_lora`, rank 64, `all-linear`,
and peft's expert targets on an MoE; bf16 frozen base, `actor_rollout_ref.model.dtype=bfloat16`), reads its
`ModelShape` and runs polyrl's own memory planner (`polyrl/learner/memory.py`) on fake device-memory numbers, making
the calls `plan_memory` makes:
- several GPUs: the policy is in host memory at plan time (ppo.py), so a GPU's free memory is its total less the
  CUDA context (`CONTEXT`); auto TP is `choose_tp_size` with `room` = free - headroom - `trainer_state_bytes`, and a
  TP engine's weights are `engine_weight_bytes(shape, N, fp8=...)` (memory._tensor_parallel);
- one GPU: the loaded policy (bf16 base + fp32 adapters) is on the GPU and TP is 1: `choose` counts a bf16 replica
  of every weight, or with `rollout.quantization=fp8` `engine_weight_bytes(shape, 1, fp8=True)` (before 2026-11-28
  `plan_memory` counted a bf16 replica there too).
Then `choose` gives the engine share, the KV rows that fit, the update's token budget and checkpointing, or refuses
with one sentence (ConfigError) where the engine cannot fit beside the trainer.

What the planner cannot represent (said, not invented): an FP8 frozen *training* base does not exist in polyrl (the
trainer's weights are float32, bfloat16 or float16: `model.dtype`); FP8 exists only in the rollout engine's weights
(`rollout.quantization=fp8`) and KV cache. The LoRA state is what the planner counts: 3 x the trained weights' own
bytes (peft's fp32 adapters: a gradient and two AdamW moments, 12 bytes each; `ModelShape.state_bytes`). Before
2026-11-28 the planner took the first parameter's dtype (the bf16 embedding) and counted half of that.

Run: `python benchmarks/plan_fit.py` (CPU, ~15 s: two meta builds). Device totals: what torch reports for an H100
80GB (79.2 GiB) and an H200 (139.8 GiB, as tests/test_moe_full_finetune_plan_on_cpu.py).
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass

import torch

from polyrl.errors import ConfigError
from polyrl.rollout.config import RolloutConfig
from polyrl.rollout.native.engine import shared_weight_bytes
from polyrl.learner.memory import (GiB, HEADROOM, ModelShape, choose, choose_tp_size, copies_bytes,
                                   engine_weight_bytes, trainer_state_bytes, update_bytes_per_token)

GPUS = {"H100": int(79.2 * GiB), "H200": int(139.8 * GiB)}
CONTEXT = 1 * GiB  # CUDA context and allocator, not free to the planner
PEAK_FLOPS = 989e12  # dense bf16, H100 and H200 (learner/flops.py)
LORA_RANK = 64
MAX_PROMPT, MAX_RESPONSE = 512, 3584  # NeMo RL's max sequence 4,096
ROWS_PER_RANK = 64  # rollout rows each rank generates per call
ENGINE_RESERVE = 2 * GiB  # choose()'s prefill reserve beside the KV cache


def llama_3_1_70b():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
                       rope_theta=500000.0, tie_word_embeddings=False)


def qwen3_30b_a3b():
    from transformers import Qwen3MoeConfig

    # benchmarks/moe_step.py's qwen3_30b_a3b
    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                          rope_theta=1e6, tie_word_embeddings=False, initializer_range=0.02)


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MODELS = {"Llama-3.1-70B": llama_3_1_70b, "Qwen3-30B-A3B": qwen3_30b_a3b}


@functools.lru_cache(maxsize=None)
def lora_policy(name: str, experts: bool = True):
    """(ModelShape, loaded bytes, bytes per trained parameter, config) of the LoRA policy the trainer builds, on the
    meta device. `experts=False`: LoRA on attention only (`model.target_modules=[q_proj,k_proj,v_proj,o_proj]`,
    `model.target_parameters=[]`); with `all-linear`, `target_parameters=[]` still adapts the experts (peft 0.21,
    transformers 5.24, checked on this meta build)."""
    from transformers import AutoModelForCausalLM

    from polyrl.models.loader import apply_lora

    config = MODELS[name]()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model = apply_lora(model, rank=LORA_RANK, alpha=2 * LORA_RANK,
                           target_modules="all-linear" if experts else list(ATTENTION),
                           target_parameters=None if experts else [])
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    adapter_bytes = next(p for p in model.parameters() if p.requires_grad).element_size()  # peft: fp32 adapters
    # the frozen bf16 weights a native engine on the trainer's GPU uses in place (NativeEngine.from_hf(share=))
    shared = shared_weight_bytes(RolloutConfig(), model, torch.device("meta"))
    return ModelShape.of(model), loaded, adapter_bytes, config, shared


@dataclass(frozen=True)
class Case:
    model: str
    gpu: str
    world: int
    fp8: bool  # rollout.quantization=fp8 (engine weights only)
    experts: bool = True  # LoRA on the MoE's expert tensors too (the default); False: attention only
    offload: bool = False  # actor.fsdp_config.offload_policy=True: FSDP2 keeps the base shard and LoRA state on the host
    shared: bool = True  # one GPU, bf16 engine: the engine uses the frozen base in place (since 2026-12-06)

    @property
    def label(self) -> str:
        what = "FP8 rollout weights" if self.fp8 else "bf16 rollout weights"
        lora = "" if self.experts else " attention only"
        if self.offload:
            what += ", offload_policy=True"
        if self.world == 1 and not self.fp8:
            what += ", frozen base shared with the engine" if self.shared else ", engine copy (before 2026-12-06)"
        return f"{self.model} LoRA r{LORA_RANK}{lora}, {self.world} x {self.gpu}, {what}"


CASES = (
    Case("Llama-3.1-70B", "H100", 4, fp8=False),
    Case("Llama-3.1-70B", "H100", 4, fp8=True),
    Case("Llama-3.1-70B", "H100", 4, fp8=False, offload=True),
    Case("Llama-3.1-70B", "H200", 4, fp8=False),
    Case("Llama-3.1-70B", "H200", 4, fp8=True),
    Case("Qwen3-30B-A3B", "H200", 1, fp8=False),
    Case("Qwen3-30B-A3B", "H100", 1, fp8=False),
    Case("Qwen3-30B-A3B", "H100", 1, fp8=True),
    Case("Qwen3-30B-A3B", "H200", 1, fp8=False, experts=False, shared=False),
    Case("Qwen3-30B-A3B", "H200", 1, fp8=False, experts=False),
    Case("Qwen3-30B-A3B", "H200", 1, fp8=True, experts=False),
    Case("Qwen3-30B-A3B", "H100", 1, fp8=True, experts=False),
    Case("Qwen3-30B-A3B", "H100", 1, fp8=False, experts=False),
)


def _cfg(fp8: bool, offload: bool = False):
    from polyrl.trainer.config import PPOConfig

    cfg = PPOConfig()
    m = cfg.actor_rollout_ref.model
    m.lora_rank, m.lora_alpha, m.dtype = LORA_RANK, 2 * LORA_RANK, "bfloat16"
    cfg.actor_rollout_ref.rollout.quantization = "fp8" if fp8 else None
    cfg.actor_rollout_ref.actor.fsdp_config.offload_policy = offload
    cfg.data.max_prompt_length, cfg.data.max_response_length = MAX_PROMPT, MAX_RESPONSE
    return cfg


def plan(case: Case) -> dict:
    """The planner's decisions for `case` and the byte account behind them (bytes; see the module docstring)."""
    shape, loaded, adapter_bytes, config, shared = lora_policy(case.model, case.experts)
    cfg, total, world = _cfg(case.fp8, case.offload), GPUS[case.gpu], case.world
    seq = MAX_PROMPT + MAX_RESPONSE
    free = total - CONTEXT - (loaded if world == 1 else 0)  # one GPU: the policy is loaded there at plan time
    out = dict(case=case.label, model=case.model, gpu=case.gpu, world=world, total=total, fp8=case.fp8,
               num_params=shape.num_params, num_trainable=shape.num_trainable)
    tp, tp_reason, engine_bytes = 1, "one GPU: TP 1 (auto TP runs with several processes only)", None
    if world > 1:
        room = int(free - HEADROOM * total - trainer_state_bytes(cfg, shape, world))
        c = choose_tp_size(shape, num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                           gpus_per_node=world, room=room, rows_per_rank=ROWS_PER_RANK, max_seq_len=seq,
                           fp8=case.fp8, tied=False)
        tp, tp_reason = c.value, c.reason
        if tp > 1:
            engine_bytes = engine_weight_bytes(shape, tp, fp8=case.fp8, tied=False)
    elif case.fp8:  # one GPU, TP 1: a whole replica in FP8 (plan_memory passes its bytes since 2026-11-28)
        engine_bytes = engine_weight_bytes(shape, 1, fp8=True, tied=False)
    elif case.shared and shared:  # one GPU, bf16: the frozen weights are the trainer's (plan_memory, 2026-12-06)
        engine_bytes = shape.num_params * 2 - shared
    engine = shape.num_params * 2 if engine_bytes is None else engine_bytes
    trainer_weights = loaded if world == 1 else copies_bytes(cfg, shape, world)
    on_gpu = not case.offload  # offloaded: FSDP2 keeps the state in host memory (plan_memory: trains=False)
    lora_state = shape.state_bytes // world * on_gpu  # as choose() counts it: fp32 adapters, grad + 2 AdamW moments
    assert adapter_bytes == 4 and shape.state_bytes == shape.num_trainable * 3 * adapter_bytes, "peft's fp32 adapters"
    head = 2048 * shape.vocab * 8
    out.update(tp=tp, tp_reason=tp_reason, trainer_weights=trainer_weights, lora_state=lora_state, engine_weights=engine,
               head=head, headroom=int(HEADROOM * total),
               usable=total - CONTEXT - int(HEADROOM * total))
    try:
        ch = choose(shape, device=torch.device("cuda"), free=free, total=total, max_seq_len=seq,
                    num_rollout_rows=ROWS_PER_RANK, engine_on_device=True, extra_static=copies_bytes(cfg, shape, world),
                    world_size=world, compile_layers=None, checkpointing=None, update_tokens=None,
                    peak_flops=PEAK_FLOPS, trains=on_gpu, engine_bytes=engine_bytes, tp_size=tp, engine_auto=True)
    except ConfigError as e:
        out.update(verdict="refused", refusal=str(e))
        return out
    util, tokens = ch["engine"].value, ch["update_tokens"].value
    ckpt, compiled = ch["checkpointing"].value, ch["compile"].value
    kv = max(0, int(util * total) - engine - ENGINE_RESERVE)
    acts = int(tokens * update_bytes_per_token(shape, checkpointing=ckpt, compiled=compiled))
    fit_rows = int(ch["seats"].reason.split(", ")[1].split()[0])
    keeps_cache = not ch["free_cache"].value
    trainer = trainer_weights + lora_state
    rollout_peak = trainer + engine + ENGINE_RESERVE + kv
    update_peak = trainer + engine + head + acts + (kv if keeps_cache else 0)
    floor_raised = "raised to one whole sequence (may not fit)" in ch["update_tokens"].reason
    usable = out["usable"]
    fits = not floor_raised and update_peak <= usable and rollout_peak <= usable
    out.update(verdict="fits" if fits else "does not fit", engine_util=util, kv=kv, kv_rows_fit=fit_rows,
               seats=ch["seats"].value, update_tokens=tokens, checkpointing=ckpt, compile=compiled, activations=acts,
               keeps_cache=keeps_cache, rollout_peak=rollout_peak, update_peak=update_peak,
               floor_raised=floor_raised, reasons={k: c.reason for k, c in ch.items()})
    return out


def gib(x: int) -> str:
    return f"{x / GiB:.1f}"


def table(results: list[dict]) -> str:
    head = ("| case | TP | engine util | KV rows fit (4k) | update tokens | ckpt | trainer weights | LoRA state "
            "| engine weights | KV | activations | rollout / update peak of usable (GiB) | verdict |")
    rows = [head, "|" + "---|" * 13]
    for r in results:
        common = f"| {r['case']} | {r['tp']} | "
        bytes_ = (f"{gib(r['trainer_weights'])} | {gib(r['lora_state'])} | "
                  f"{gib(r['engine_weights'])} | ")
        if r["verdict"] == "refused":
            rows.append(common + "- | - | - | - | " + bytes_ + "- | - | - | refused |")
        else:
            rows.append(common + f"{r['engine_util']} | {r['kv_rows_fit']} | {r['update_tokens']} | "
                        f"{'on' if r['checkpointing'] else 'off'} | " + bytes_ + f"{gib(r['kv'])} | "
                        f"{gib(r['activations'])} | {gib(r['rollout_peak'])} / {gib(r['update_peak'])} of "
                        f"{gib(r['usable'])} | {r['verdict']} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    results = [plan(c) for c in CASES]
    print("PLANNER PREDICTIONS (polyrl/learner/memory.py on fake memory numbers), NOT MEASUREMENTS. "
          f"max sequence {MAX_PROMPT + MAX_RESPONSE}, {ROWS_PER_RANK} rollout rows per rank, LoRA r{LORA_RANK} "
          f"all-linear on a bf16 base; device totals H100 {gib(GPUS['H100'])} GiB, H200 {gib(GPUS['H200'])} GiB; "
          f"'usable' = total - {gib(CONTEXT)} GiB context - {HEADROOM:.0%} headroom.")
    for name in MODELS:
        shape = lora_policy(name)[0]
        print(f"{name}: {shape.num_params / 1e9:.2f}B parameters with adapters, {shape.num_trainable / 1e9:.3f}B "
              f"trainable, KV {shape.kv_bytes_per_token // 1024} KiB/token")
    for r in results:
        print(f"\n== {r['case']}: {r['verdict'].upper()}")
        print(f"  TP {r['tp']}: {r['tp_reason']}")
        if r["verdict"] == "refused":
            print(f"  refused: {r['refusal']}")
        else:
            for k, why in r["reasons"].items():
                print(f"  {k}: {why}")
    print("\n" + table(results))
    print("\nNot representable: an FP8 frozen training base (polyrl trains float32/bfloat16/float16 weights); FP8 is "
          "the rollout engine's weights only.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
