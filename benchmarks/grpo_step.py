"""A whole GRPO step on one GPU: polyrl's PPOTrainer vs TRL's GRPOTrainer (use_vllm=False), same model and data.
(`--shape 7b` is the Qwen2.5-7B shape, for several GPUs.)

    PYTHONPATH=. python benchmarks/grpo_step.py --lengths 256,1024 --rows-out history

Setup (issue 5): Qwen2.5-1.5B shape, random init with std `--init-std` (default 0.01 instead of HF's 0.02, so both
trainers start from stably trainable weights; both load the *same* saved checkpoint), a character tokenizer, 32
prompts x n=8 per step, every prompt exactly 128 tokens after the chat template, responses up to 256 / 1024 tokens
(a random model almost never samples EOS, so responses run to the limit in both frameworks), a cheap rule reward
(digit fraction). polyrl: fp32 master + bf16 autocast, packed varlen update, token-budget micro-batches, gradient
checkpointing, on-policy single pass (no separate old-log-prob pass). TRL: bf16=True, gradient_checkpointing=True,
beta=0, one optimizer step per 256 completions (16 x 16 accumulation). Throughput = (prompt + response tokens) /
step time, verl's `perf/throughput`; the first step of each run is a warm-up and is not reported.

Several GPUs (issue 8, whole-step scaling): `torchrun --standalone --nproc_per_node=N benchmarks/grpo_step.py
--skip-trl ...` runs the same step data-parallel, `--prompts` per GPU (weak scaling: the global batch is N x
--prompts), so perf/throughput (tokens/s/GPU) compares directly with the 1-GPU row. Rank 0 writes the model and data;
TRL is single-process only here. `--shape tiny --device cpu` is a smoke test of the same path (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Where verl's defaults (ours) and TRL's differ, both sides are set here, to the same values: weight decay (verl 0.01,
# TRL 0.0), LR schedule (verl constant, TRL linear decay), warm-up (both 0) and gradient checkpointing (verl off,
# TRL on). The benchmark times steps; these choices only keep the two optimizers doing the same work.
WEIGHT_DECAY = 0.01
LR_SCHEDULE = "constant"
GRADIENT_CHECKPOINTING = True

REWARD_SRC = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))
'''


def digit_fraction(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(1, len(text))


def setup(work: Path, *, init_std: float, num_prompts: int, prompt_tokens: int, seed: int = 0, shape: str = "1.5b",
          device: str = "cuda", layers: int | None = None):
    """Save model (bf16 safetensors), tokenizer, parquet data and reward file under `work`."""
    from transformers import AutoModelForCausalLM

    from polyrl.data.dataset import write_parquet
    from polyrl.models.tiny import build_char_tokenizer
    from train_step import qwen25_1_5b

    tok = build_char_tokenizer()
    tok_dir, model_dir = work / "tokenizer", work / "model"
    tok.save_pretrained(tok_dir)  # separate dir: transformers forces Qwen2Tokenizer onto dirs whose config is qwen2
    cfg = qwen25_1_5b(init_std)
    if shape == "7b":  # multi_gpu.py's Qwen2.5-7B dims (untied head) with the 1.5B's vocab, as the rows were measured;
        from multi_gpu import SHAPES  # several GPUs only: it does not train on one

        cfg = type(cfg)(**{**SHAPES["7b"], "vocab_size": cfg.vocab_size}, max_position_embeddings=32768,
                        rope_theta=1e6, initializer_range=init_std)
    if shape == "r1-1.5b":  # DeepSeek-R1-Distill-Qwen-1.5B (seed 002): the 1.5B dims with an untied LM head
        cfg.tie_word_embeddings = False
    if shape == "qwen3-32b":  # issue 48 (rollout TP): Qwen3-32B's dims, untied head; --layers cuts the 64 layers
        from transformers import Qwen3Config

        cfg = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=5120, intermediate_size=25600,
                          num_hidden_layers=layers or 64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                          max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False,
                          initializer_range=init_std)
    if shape == "tiny":  # CPU smoke runs: same code path, a 2-layer model
        cfg = type(cfg)(vocab_size=cfg.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                        tie_word_embeddings=True, initializer_range=init_std)
    cfg.use_cache = True  # generate() in TRL reads it from the saved config; without it HF decodes with no KV cache
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, None
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(model_dir)
    del model
    overhead = len(tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True,
                                           tokenize=True)["input_ids"])
    import random

    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 "
    rows = []
    for i in range(num_prompts):
        text = "".join(rng.choice(alphabet) for _ in range(prompt_tokens - overhead))
        rows.append({"data_source": "bench", "prompt": [{"role": "user", "content": text}], "ability": "bench",
                     "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"index": i}})
    write_parquet(rows, work / "train.parquet")
    (work / "reward.py").write_text(REWARD_SRC)
    n_tok = len(tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=True)["input_ids"])
    assert n_tok == prompt_tokens, n_tok
    return model_dir, tok_dir, rows


def rollout_name() -> str:
    try:
        import polyrl.rollout.native.engine  # noqa: F401

        return "native"
    except Exception as e:  # noqa: BLE001
        print(f"native rollout unavailable ({e!r}); using hf", flush=True)
        return "hf"


# the hand-set keys of the rows before issue 18 (--extra overrides them); --defaults leaves all of them to auto
HAND_SET = ["actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.use_torch_compile=False", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3"]


def run_polyrl(work, model_dir, tok_dir, *, length, prompts, n, steps, rollout, max_token_len, device="cuda",
               extra=None, defaults=False):
    """One PPOTrainer run. `defaults`: only model, data, batch and length keys (memory.py picks the rest), as a
    new user's `polyrl train` would; else the keys in HAND_SET plus `max_token_len`."""
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.ppo import PPOTrainer

    run = work / f"polyrl_{length}"
    shutil.rmtree(run, ignore_errors=True)  # a fresh run each call (a run directory holds one run)
    overrides = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={work / 'train.parquet'}",
        f"data.train_batch_size={prompts}",
        "data.max_prompt_length=128",
        f"data.max_response_length={length}",
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.tokenizer_path={tok_dir}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        f"actor_rollout_ref.actor.optim.weight_decay={WEIGHT_DECAY}",
        f"actor_rollout_ref.actor.optim.lr_scheduler_type={LR_SCHEDULE}",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.rollout.name={rollout}",
        f"actor_rollout_ref.rollout.n={n}",
        f"custom_reward_function.path={work / 'reward.py'}",
        "trainer.logger=[file]",
        f"trainer.run_dir={run}",
        f"trainer.default_local_dir={run / 'ckpt'}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
        "trainer.resume_mode=disable",
        f"trainer.device={device}",
        "trainer.progress_bar=False",
    ]
    if not defaults:
        overrides += HAND_SET + [f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max_token_len}"]
    trainer = PPOTrainer(build_config(PPOConfig(), overrides + list(extra or [])))
    out = []
    for _ in range(steps):
        out.append(trainer.step())
    trainer.dist.finish()
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run_trl(work, model_dir, tok_dir, rows, *, length, prompts, n, steps):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda()
    ds = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])

    def reward(prompts, completions, **kw):
        return [digit_fraction(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    micro = 16
    args = GRPOConfig(output_dir=str(work / f"trl_{length}"), per_device_train_batch_size=micro,
                      gradient_accumulation_steps=prompts * n // micro, num_generations=n,
                      max_completion_length=length, learning_rate=1e-6, weight_decay=WEIGHT_DECAY,
                      lr_scheduler_type=LR_SCHEDULE, warmup_steps=0, bf16=True,
                      gradient_checkpointing=GRADIENT_CHECKPOINTING,
                      beta=0.0, max_steps=steps, logging_steps=1, report_to="none", save_strategy="no",
                      disable_tqdm=True, use_vllm=False, temperature=1.0, seed=0)

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks, self.logs = [], []

        def on_train_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **k):
            self.logs.append(dict(logs or {}))

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[clock])
    trainer.train()
    times = [b - a for a, b in zip(clock.marks, clock.marks[1:])]
    logs = [lg for lg in clock.logs if "completions/mean_length" in lg]
    del trainer, model
    torch.cuda.empty_cache()
    return times, logs


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256,1024")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", "--samples-per-prompt", dest="n", type=int, default=8)  # torchrun misreads --n
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--init-std", type=float, default=0.01)
    ap.add_argument("--max-token-len", type=int, default=16384)
    ap.add_argument("--defaults", action="store_true",
                    help="only model/data/batch/length keys: token budgets, grad ckpt, compile, engine memory on auto")
    ap.add_argument("--work", default="/tmp/grpo_bench")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--trl-first", action="store_true", help="run TRL before polyrl (checks order effects)")
    ap.add_argument("--rows-out", default=None)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--extra", nargs="*", default=[], help="extra polyrl train overrides (e.g. profiler keys)")
    ap.add_argument("--shape", default="1.5b", choices=["1.5b", "7b", "tiny", "qwen3-32b"])
    ap.add_argument("--layers", type=int, default=None, help="qwen3-32b: keep the first N of its 64 layers")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        args.skip_trl = True  # TRL's GRPOTrainer is compared in one process only
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    if world > 1:
        device = f"{world}x {device}"
    ready = work / f"ready-{os.environ.get('TORCHELASTIC_RUN_ID', 'single')}"
    if rank == 0:  # one writer; the other ranks wait for its files
        model_dir, tok_dir, rows = setup(work, init_std=args.init_std, num_prompts=args.prompts * world * args.steps,
                                         prompt_tokens=128, shape=args.shape, device=args.device,
                                         layers=args.layers)
        ready.write_text("ok")
    else:
        while not ready.exists():
            time.sleep(0.5)
        model_dir, tok_dir, rows = work / "model", work / "tokenizer", None
    args.prompts *= world  # the global batch: --prompts per GPU
    if rank != 0:  # one report: rank 0 prints and records (the step metrics are already merged over ranks)
        sys.stdout = open(os.devnull, "w")
        args.rows_out = args.json_out = None
    rollout = rollout_name() if args.device == "cuda" else "hf"
    report = {"device": device, "rollout": rollout, "init_std": args.init_std}
    for length in [int(x) for x in args.lengths.split(",")]:
        res = report.setdefault(str(length), {})

        def polyrl_part():
            nonlocal rollout
            t0 = time.perf_counter()
            try:
                try:
                    ms = run_polyrl(work, model_dir, tok_dir, length=length, prompts=args.prompts, n=args.n,
                                    steps=args.steps, rollout=rollout, max_token_len=args.max_token_len,
                                    extra=args.extra, device=args.device, defaults=args.defaults)
                except Exception as e:  # noqa: BLE001
                    from polyrl.errors import UserError
                    from polyrl.utils.oom_hook import is_oom

                    if rollout != "native" or is_oom(e) or isinstance(e, UserError):
                        raise  # hf needs more memory than native: an OOM there would only OOM again
                    print(f"[{length}] native rollout failed ({e!r}); retrying with rollout.name=hf", flush=True)
                    torch.cuda.empty_cache()
                    rollout = res["rollout"] = "hf"
                    ms = run_polyrl(work, model_dir, tok_dir, length=length, prompts=args.prompts, n=args.n,
                                    steps=args.steps, rollout=rollout, max_token_len=args.max_token_len,
                                    extra=args.extra, device=args.device, defaults=args.defaults)
                m = ms[-1]
                keep = ("timing_s/", "perf/", "actor/grad_norm", "response_length/mean", "critic/score/mean", "training/")
                res["polyrl"] = {k: v for k, v in m.items() if k.startswith(keep)}
                res["polyrl"]["all_steps_grad_norm"] = [x.get("actor/grad_norm") for x in ms]
                print(f"[{length}] polyrl ({rollout}) step {m['timing_s/step']:.2f}s "
                      f"throughput {m['perf/throughput']:.0f} tok/s; "
                      + " ".join(f"{k[9:]}={v:.2f}" for k, v in m.items() if k.startswith("timing_s/"))
                      + f"; mfu/actor {m.get('perf/mfu/actor', 0):.1%}; grad_norm {m.get('actor/grad_norm')}; "
                      f"resp len {m.get('response_length/mean')}; wall {time.perf_counter() - t0:.0f}s", flush=True)
            except Exception as e:  # noqa: BLE001
                import traceback

                from polyrl.errors import UserError

                if isinstance(e, UserError):  # e.g. out of memory with nothing left to shrink: its one sentence
                    print(f"[{length}] polyrl stopped: {e}", flush=True)
                else:
                    traceback.print_exc()
                res["polyrl_error"] = repr(e)[:500]
                torch.cuda.empty_cache()

        def trl_part():
            t0 = time.perf_counter()
            try:
                times, logs = run_trl(work, model_dir, tok_dir, rows, length=length, prompts=args.prompts, n=args.n,
                                      steps=args.steps)
                lg = logs[-1]
                tokens = args.prompts * args.n * (128 + lg["completions/mean_length"])
                res["trl"] = {"step_s": times[-1], "all_step_s": times, "throughput": tokens / times[-1],
                              "grad_norm": [x.get("grad_norm") for x in logs],
                              "mean_length": lg["completions/mean_length"]}
                print(f"[{length}] TRL step {times[-1]:.2f}s throughput {tokens / times[-1]:.0f} tok/s; steps {times}; "
                      f"grad_norm {res['trl']['grad_norm']}; wall {time.perf_counter() - t0:.0f}s", flush=True)
            except Exception as e:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                res["trl_error"] = repr(e)[:500]
                torch.cuda.empty_cache()

        parts = [trl_part, polyrl_part] if args.trl_first else [polyrl_part, trl_part]
        for part in [polyrl_part] if args.skip_trl else parts:
            part()
        record(args, report, length, device)
    print(json.dumps(report, indent=1, default=str))
    print("\n| response len | polyrl tok/s | TRL tok/s | ratio |\n|---|---|---|---|")
    for length in args.lengths.split(","):
        r = report.get(length, {})
        p, t = r.get("polyrl", {}).get("perf/throughput"), r.get("trl", {}).get("throughput")
        print(f"| {length} | {p or '-'} | {t or '-'} | {f'{p / t:.2f}x' if p and t else '-'} |")


def record(args, report, length, device):
    """Append this length's row (and the JSON) as soon as it is measured: a later timeout must not lose it."""
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1, default=str))
    r = report.get(str(length), {})
    p, t = r.get("polyrl", {}).get("perf/throughput"), r.get("trl", {}).get("throughput")
    if args.rows_out and p:
        from _record import append_row

        tim = r["polyrl"]
        model = {"1.5b": "Qwen2.5-1.5B", "7b": "Qwen2.5-7B", "tiny": "tiny 2-layer",
                 "qwen3-32b": f"Qwen3-32B{f' ({args.layers} layers)' if args.layers else ''}"}[args.shape]
        shape = (f"GRPO step, {model} shape (init std {args.init_std}), {args.prompts}x{args.n}, prompt 128, "
                 f"resp <= {length}; rollout={report['rollout']}; gen {tim.get('timing_s/gen', 0):.1f}s, update "
                 f"{tim.get('timing_s/update_actor', 0):.1f}s, step {tim.get('timing_s/step', 0):.1f}s"
                 + ("; defaults (auto memory settings)" if args.defaults else
                    f"; hand-set: grad ckpt, ppo_max_token_len_per_gpu={args.max_token_len}")
                 + (f"; then overridden by {' '.join(args.extra)}" if args.extra else ""))
        append_row(device, "grpo_step perf/throughput tok/s/GPU", shape, f"{p:.0f}",
                   peer=f"TRL 1.16 GRPOTrainer (no vLLM): {t:.0f}" if t else "TRL: not measured",
                   ratio_peer=f"{p / t:.2f}x" if t else "-", path=args.rows_out)

if __name__ == "__main__":
    main()
