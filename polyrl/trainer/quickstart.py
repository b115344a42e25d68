"""`polyrl quickstart`: the embedded default that shows a model learning, on a laptop CPU, with no downloads.

1. Build (and cache) a tiny Llama-style model with a character tokenizer.
2. Warm it up with polyrl's SFT trainer on the synthetic `reverse` task ("rev abc=" -> "cba") from *noisy*
   demonstrations: 40% are correct, 60% show a plausible wrong behaviour (copying the letters). The SFT model knows
   both behaviours; greedy decoding mostly picks the wrong one. This is the situation RL with a verifiable reward is
   for: the reward, not the demonstrations, says which behaviour is right. (Stopping a clean SFT run early does not
   work as a demo on this task: accuracy jumps from ~0% to ~80% within a few dozen SFT steps.)
3. Run GRPO through the same `PPOTrainer` that `polyrl train` uses, on the same config keys, and print greedy held-out
   accuracy before and after.

Everything lands in the run directory: data parquet, config.yaml, metrics.jsonl, checkpoints, the HF export and the
HTML report.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from polyrl.data.dataset import write_parquet
from polyrl.data.synthetic import make_rows
from polyrl.utils.console import progress_bar


@dataclass
class QuickstartSettings:
    task: str = "reverse"
    # fraction of SFT demonstrations that are correct; the rest show a plausible wrong behaviour (see DISTRACTORS)
    sft_correct_fraction: float = 0.4
    num_train: int = 2000
    num_val: int = 200
    # model: llama, or qwen3_moe (a tiny Qwen3-MoE: `num_experts` experts, `top_k` of them per token)
    arch: str = "llama"
    num_experts: int = 8
    top_k: int = 2
    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    # SFT warm-up: few enough steps to leave headroom for RL
    sft_steps: int = 300
    sft_batch: int = 64
    sft_lr: float = 3e-3
    # GRPO
    grpo_steps: int = 40
    prompts_per_step: int = 32
    n: int = 8
    lr: float = 1e-3
    temperature: float = 1.0
    seed: int = 1
    device: str = "cpu"


FAST = dict(grpo_steps=20)
# `--scale gpu`: the same task and recipe with a 4x wider, 2x deeper model, bigger batches and more steps
GPU_SCALE = dict(hidden_size=256, layers=4, heads=8, kv_heads=4, intermediate=512, num_train=4000, sft_batch=128,
                 prompts_per_step=64, n=16, grpo_steps=60, lr=5e-4, device="cuda")

# `--arch qwen3_moe`: the same task and recipe on a tiny Qwen3-MoE (the MLP's budget split over 8 experts of half
# width, 2 active), rollouts on the native engine's MoE layers with routing replay (R3: the engine's routes replayed
# in the trainer's forward)
MOE_ARCHS = ("qwen3_moe",)
MOE_SPEC = lambda s: dict(num_experts=s.num_experts, num_experts_per_tok=s.top_k)  # noqa: E731
MOE_OVERRIDES = ["actor_rollout_ref.actor.router_replay.mode=R3",
                 "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"]

# A plausible wrong answer per task, for the SFT demonstrations that are deliberately wrong.
DISTRACTORS = {
    "reverse": lambda prompt, answer: answer[::-1],  # copy the letters instead of reversing them
    "addition": lambda prompt, answer: str(sum(int(x) % 10 for x in prompt.rstrip("=").split("+"))
                                           % 10 + 10 * sum(int(x) // 10 for x in prompt.rstrip("=").split("+"))),
    "count": lambda prompt, answer: str(int(answer) + 1),
}  # the test's shorter version of the same path


def cache_root() -> Path:
    return Path(os.environ.get("POLYRL_CACHE", Path.home() / ".cache" / "polyrl"))


def _key(d: dict) -> str:
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def build_base_model(s: QuickstartSettings) -> Path:
    from polyrl.models.tiny import build_tiny_model

    spec = dict(hidden_size=s.hidden_size, layers=s.layers, heads=s.heads, kv_heads=s.kv_heads,
                intermediate=s.intermediate, seed=s.seed, max_position_embeddings=128)
    if s.arch != "llama":  # (the dense default's cache key stays what it was)
        spec.update(arch=s.arch, **MOE_SPEC(s) if s.arch in MOE_ARCHS else {})
    out = cache_root() / "models" / f"tiny-{_key(spec)}"
    if not (out / "config.json").is_file():
        tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
        build_tiny_model(tmp, **spec)
        tmp.replace(out) if not out.exists() else None
    return out


def warm_up_with_sft(base: Path, train_rows: list[dict], s: QuickstartSettings, progress=None) -> Path:
    """SFT the base model on the task's answers; cached by (base, data, settings)."""
    from polyrl.data.sft import SFTSample, assistant_spans, encode_with_mask
    from polyrl.models.loader import load_causal_lm, load_tokenizer
    from polyrl.trainer.sft import save_hf_atomic, train_sft

    spec = dict(base=base.name, task=s.task, n=len(train_rows), steps=s.sft_steps, batch=s.sft_batch, lr=s.sft_lr,
                seed=s.seed, correct=s.sft_correct_fraction, device=s.device)
    out = cache_root() / "models" / f"sft-{_key(spec)}"
    if (out / "config.json").is_file():
        if progress is not None:
            progress.update(s.sft_steps)
        return out
    tok = load_tokenizer(str(base))
    samples: list[SFTSample] = []
    rng = random.Random(s.seed)
    for r in train_rows:
        answer = r["reward_model"]["ground_truth"]
        if rng.random() >= s.sft_correct_fraction:
            answer = DISTRACTORS[s.task](r["prompt"][0]["content"], answer)
        messages = r["prompt"] + [{"role": "assistant", "content": answer}]
        text, spans = assistant_spans(tok, messages, "quickstart")
        samples.append(encode_with_mask(tok, text, spans))
    model = load_causal_lm(str(base)).to(s.device)
    torch.manual_seed(s.seed)
    train_sft(model, samples, pad_id=tok.pad_token_id, batch_size=s.sft_batch, micro_batch_size=s.sft_batch,
              lr=s.sft_lr, steps=s.sft_steps, device=torch.device(s.device), warmup_steps=s.sft_steps // 10,
              scheduler="cosine", seed=s.seed, progress=progress)
    return save_hf_atomic(model, tok, out)


def grpo_overrides(model_dir: Path, data_dir: Path, run_dir: Path, s: QuickstartSettings) -> list[str]:
    """The quickstart's GRPO run as `polyrl train` overrides: the same keys a user would type."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={data_dir / 'train.parquet'}",
        f"data.val_files={data_dir / 'val.parquet'}",
        f"data.train_batch_size={s.prompts_per_step}",
        "data.max_prompt_length=64",
        "data.max_response_length=8",
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.actor.optim.lr={s.lr}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={s.prompts_per_step}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={s.prompts_per_step * s.n}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.rollout.n={s.n}",
        f"actor_rollout_ref.rollout.temperature={s.temperature}",
        "trainer.logger=[file]",
        "trainer.project_name=quickstart",
        f"trainer.experiment_name={run_dir.name}",
        f"trainer.run_dir={run_dir}",
        f"trainer.default_local_dir={run_dir / 'checkpoints'}",
        f"trainer.total_training_steps={s.grpo_steps}",
        "trainer.val_before_train=True",
        "trainer.test_freq=10",
        "trainer.resume_mode=disable",
        f"trainer.seed={s.seed}",
        f"trainer.device={s.device}",
        "trainer.progress_bar=False",
    ]


def run_quickstart(run_dir: str | None = None, *, fast: bool = False, extra_overrides: list[str] | None = None,
                   settings: QuickstartSettings | None = None) -> dict:
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig

    t0 = time.perf_counter()
    s = settings or QuickstartSettings(**(FAST if fast else {}))
    run = Path(run_dir or f"runs/quickstart/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run.mkdir(parents=True, exist_ok=True)
    data_dir = run / "data"
    train_rows = make_rows(s.task, s.num_train, seed=s.seed, split="train")
    val_rows = make_rows(s.task, s.num_val, seed=s.seed, split="val")
    write_parquet(train_rows, data_dir / "train.parquet")
    write_parquet(val_rows, data_dir / "val.parquet")

    bar = progress_bar(s.sft_steps + s.grpo_steps, desc="quickstart: build + SFT warm-up")  # a terminal only
    try:
        base = build_base_model(s)
        sft_dir = warm_up_with_sft(base, train_rows, s, progress=bar)
        if bar is not None:
            bar.set_description("quickstart: GRPO")
        arch_overrides = MOE_OVERRIDES if s.arch in MOE_ARCHS else []
        overrides = grpo_overrides(sft_dir, data_dir, run, s) + arch_overrides + list(extra_overrides or [])
        cfg = build_config(PPOConfig(), overrides)
        before, after, final = train_between_validations(cfg, overrides, run, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    key = next(k for k in before if k.startswith("val-core/") and "/acc/mean@" in k)
    result = {
        "accuracy_before": before[key],
        "accuracy_after": after[key],
        "wall_s": time.perf_counter() - t0,
        "run_dir": str(run),
        "metric": key,
        "hf_model": final + "/huggingface",
    }
    (run / "quickstart.json").write_text(json.dumps(result, indent=1))
    return result


def train_between_validations(cfg, overrides: list[str], run: Path, progress=None) -> tuple[dict, dict, str]:
    """Validate, train, validate: (metrics before, metrics after, the final checkpoint). In this process, or for the
    off-policy pipeline (`hybrid_engine=False`) as a 2-process job of its own."""
    from polyrl.trainer.ppo import PPOTrainer

    if not cfg.actor_rollout_ref.hybrid_engine:
        return _run_as_job(cfg, overrides, run)
    trainer = PPOTrainer(cfg)
    before = trainer.validate()
    trainer.tracker.log(before, step=0)
    trainer.cfg.trainer.val_before_train = False
    after = trainer.fit(progress=progress)
    return before, after, str(getattr(trainer, "final_checkpoint", ""))


def _run_as_job(cfg, overrides: list[str], run: Path) -> tuple[dict, dict, str]:
    """`polyrl train overrides` as the job the config asks for (torchrun); the validation before the first step and
    after the last are read back from its metrics.jsonl."""
    from polyrl.trainer.job import maybe_launch
    from polyrl.errors import UserError

    if maybe_launch(cfg, overrides) != 0:
        raise UserError(f"The quickstart's training job failed; its output is above and its run directory is {run}.")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if any(k.startswith("val-core/") for k in r)]
    latest = (Path(cfg.trainer.default_local_dir) / "latest_checkpointed_iteration.txt").read_text().strip()
    return val[0], val[-1], str(Path(cfg.trainer.default_local_dir) / f"global_step_{latest}")


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="polyrl quickstart", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default=None, help="where to write metrics, checkpoints and the report")
    p.add_argument("--fast", action="store_true", help="fewer GRPO steps (what the test runs)")
    p.add_argument("--scale", choices=["cpu", "gpu"], default="cpu",
                   help="gpu: a bigger model, batches and more steps on CUDA (same task and recipe)")
    p.add_argument("--arch", choices=["llama", *MOE_ARCHS], default="llama",
                   help="qwen3_moe: the same recipe on a tiny Mixture-of-Experts model (8 experts, 2 per token)")
    p.add_argument("--task", choices=["reverse", "tools"], default="reverse",
                   help="tools: learn to call a calculator for 3-digit products (quickstart_tools.py)")
    p.add_argument("--no-tools", action="store_true", help="with --task tools: the control run, multi-turn off")
    p.add_argument("overrides", nargs="*", help="extra polyrl train overrides, e.g. trainer.logger=[console,file]")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from polyrl.errors import UserError

    if args.task == "tools" and (args.scale != "cpu" or args.arch != "llama" or args.fast):
        flag = "--scale gpu" if args.scale != "cpu" else f"--arch {args.arch}" if args.arch != "llama" else "--fast"
        raise UserError(f"polyrl quickstart --task tools has one recipe, the tiny CPU one (about a minute), so "
                        f"{flag} does not apply; drop it.")
    if args.no_tools and args.task != "tools":
        raise UserError("--no-tools is the control of --task tools; add --task tools or drop --no-tools.")
    if args.task == "tools":
        from polyrl.trainer.quickstart_tools import run_tools_quickstart

        r = run_tools_quickstart(args.run_dir, tools=not args.no_tools, extra_overrides=args.overrides)
        print(f"\nheld-out greedy accuracy ({r['metric']}, tools {'on' if r['tools'] else 'off'}): before GRPO "
              f"{100 * r['accuracy_before']:.1f}%  after GRPO {100 * r['accuracy_after']:.1f}% in {r['wall_s']:.0f} s")
        print(f"run directory: {r['run_dir']}  (metrics.jsonl, config.yaml, report.html)")
        return 0
    settings = None
    if args.scale == "gpu":
        if not torch.cuda.is_available():
            raise UserError("polyrl quickstart --scale gpu needs a CUDA GPU and none is visible; drop --scale gpu.")
        settings = QuickstartSettings(**{**GPU_SCALE, **(FAST if args.fast else {}), "arch": args.arch})
    elif args.arch != "llama":
        settings = QuickstartSettings(**{**(FAST if args.fast else {}), "arch": args.arch})
    r = run_quickstart(args.run_dir, fast=args.fast, extra_overrides=args.overrides, settings=settings)
    gain = 100 * (r["accuracy_after"] - r["accuracy_before"])
    print(f"\nheld-out greedy accuracy ({r['metric']}): before GRPO {100 * r['accuracy_before']:.1f}%  "
          f"after GRPO {100 * r['accuracy_after']:.1f}%  ({gain:+.1f} points) in {r['wall_s']:.0f} s")
    print(f"run directory: {r['run_dir']}  (metrics.jsonl, config.yaml, report.html; model: {r['hf_model']})")
    return 0
