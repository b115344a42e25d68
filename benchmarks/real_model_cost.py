"""What a GRPO step costs on a real-sized model: seconds per step (gen / update / whole step) at a new user's shape.

    PYTHONPATH=. python benchmarks/real_model_cost.py --model /path/to/SmolLM2-135M-Instruct     # a real HF model dir
    PYTHONPATH=. python benchmarks/real_model_cost.py --build-smollm2-shape /tmp/smollm2_shape    # no weights needed

The shape is issue 25's: 16 prompts x n=8 samples, responses up to 48 tokens, the arithmetic prompt "What is a + b?
Answer with only the number." in the model's own chat template, reward = the last number in the answer equals a+b,
`polyrl train`'s defaults otherwise (fp32 master weights, bf16 autocast on a GPU, no gradient checkpointing).
`--build-smollm2-shape` saves a random Llama with SmolLM2-135M's dimensions (30 layers, hidden 576, 9 heads / 3 KV
heads, intermediate 1536, vocab 49,152, tied embeddings) in bf16 beside a character tokenizer: the same FLOPs and
bytes per token as the real model. A random model rarely samples EOS, so its responses run to the 48-token limit: an
upper bound on a real model's step, whose answers are often shorter.
The first step is a warm-up (allocations, kernel choice) and is reported apart; the summary is the mean of the rest.
On a shared CPU the wall time depends on the other load: the script also prints the process's CPU seconds per step
(all threads; about wall x cores on an idle machine) and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "What is {a} + {b}? Answer with only the number."
REWARD_SRC = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?\\d+", solution_str)
    return 1.0 if numbers and numbers[-1] == str(ground_truth) else 0.0
'''
SMOLLM2_135M = dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
                    rope_theta=100000.0, rms_norm_eps=1e-5)


def build_smollm2_shape(out: Path, seed: int = 0) -> Path:
    """A random SmolLM2-135M-shaped Llama in bf16 safetensors with a character tokenizer (ChatML template)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from polyrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = LlamaConfig(**SMOLLM2_135M, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write_task(work: Path, num_rows: int, seed: int = 0) -> None:
    from polyrl.data.dataset import write_parquet

    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        rows.append({"data_source": "arithmetic", "prompt": [{"role": "user", "content": PROMPT.format(a=a, b=b)}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"index": i}})
    write_parquet(rows, work / "train.parquet")
    (work / "reward.py").write_text(REWARD_SRC)


def overrides(work: Path, model: Path, a) -> list[str]:
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={work / 'train.parquet'}",
        f"data.train_batch_size={a.prompts}",
        "data.max_prompt_length=128",
        f"data.max_response_length={a.response_length}",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=2e-5",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={a.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={a.micro}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        f"actor_rollout_ref.rollout.name={a.rollout}",
        f"actor_rollout_ref.rollout.n={a.n}",
        f"custom_reward_function.path={work / 'reward.py'}",
        "trainer.logger=[file]",
        f"trainer.run_dir={work / 'run'}",
        f"trainer.default_local_dir={work / 'ckpt'}",
        f"trainer.total_training_steps={a.steps}",
        "trainer.val_before_train=False",
        "trainer.resume_mode=disable",
        f"trainer.device={a.device}",
        "trainer.progress_bar=False",
        *a.extra,
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a local HF model directory (config, weights, tokenizer with a chat template)")
    src.add_argument("--build-smollm2-shape", metavar="DIR", help="build a random SmolLM2-135M-shaped model here")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--response-length", type=int, default=48)
    ap.add_argument("--micro", type=int, default=8,
                    help="ppo_micro_batch_size_per_gpu (sequences); 32 peaks above 12 GB of host memory on CPU")
    ap.add_argument("--steps", type=int, default=2, help="steps to time; the first is the warm-up")
    ap.add_argument("--rollout", default="native", choices=["native", "hf"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--work", default="/tmp/real_model_cost")
    ap.add_argument("--extra", nargs="*", default=[], help="more `polyrl train` overrides")
    ap.add_argument("--rows-out", default=None, help="append the row to this JSON-lines file (history: benchmarks/history.jsonl)")
    a = ap.parse_args(argv)

    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.ppo import PPOTrainer

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    for old in ("run", "ckpt"):  # this script's own earlier outputs: each invocation is a fresh run
        shutil.rmtree(work / old, ignore_errors=True)
    model = Path(a.model) if a.model else build_smollm2_shape(Path(a.build_smollm2_shape))
    write_task(work, a.prompts * a.steps)
    t0 = time.perf_counter()
    trainer = PPOTrainer(build_config(PPOConfig(), overrides(work, model, a)))
    setup_s = time.perf_counter() - t0
    num_params = sum(p.numel() for p in trainer.model.parameters())
    steps = []
    for i in range(a.steps):
        cpu0 = time.process_time()
        m = trainer.step()
        row = {k: m[k] for k in ("timing_s/step", "timing_s/gen", "timing_s/update_actor", "perf/throughput",
                                 "response_length/mean", "critic/score/mean") if k in m}
        row["cpu_s"] = time.process_time() - cpu0  # all threads' CPU time: wall x cores on an idle machine
        steps.append(row)
        row["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # host memory so far (KiB)
        print(f"step {i + 1}: " + " ".join(f"{k}={v:.4g}" for k, v in row.items()), flush=True)
    timed = steps[1:] or steps  # the warm-up step stands alone when only one was run

    def mean(key):
        return sum(s[key] for s in timed) / len(timed)

    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"CPU ({torch.get_num_threads()} threads)"
    summary = {"device": device, "model": str(model), "params": num_params, "setup_s": setup_s,
               "warmup_step_s": steps[0]["timing_s/step"], "step_s": mean("timing_s/step"),
               "gen_s": mean("timing_s/gen"),
               "update_actor_s": mean("timing_s/update_actor"), "tokens_per_s": mean("perf/throughput"),
               "cpu_s_per_step": mean("cpu_s"), "threads": torch.get_num_threads(),
               "load_avg_1min": os.getloadavg()[0],
               "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,  # Linux: KiB
               "response_length_mean": mean("response_length/mean"), "shape": f"{a.prompts}x{a.n}x{a.response_length}",
               "rollout": a.rollout, "extra": a.extra}
    summary["update_share"] = summary["update_actor_s"] / summary["step_s"]
    print(json.dumps(summary, indent=1))
    print(f"{device}: {num_params / 1e6:.0f}M params, {a.prompts} prompts x {a.n} x <= {a.response_length} tokens: "
          f"{summary['step_s']:.1f} s/step (gen {summary['gen_s']:.1f} s, update {summary['update_actor_s']:.1f} s = "
          f"{summary['update_share']:.0%}), warm-up step {summary['warmup_step_s']:.1f} s, setup {setup_s:.1f} s, "
          f"mean response {summary['response_length_mean']:.1f} tokens; {summary['cpu_s_per_step']:.0f} CPU-s/step, "
          f"load average {summary['load_avg_1min']:.1f}, peak host memory {summary['peak_rss_gb']:.1f} GB", flush=True)
    if a.rows_out:
        from _record import append_row

        shape = (f"GRPO step, {model.name} ({num_params / 1e6:.0f}M), {a.prompts}x{a.n}, resp <= {a.response_length} "
                 f"(mean {summary['response_length_mean']:.0f}), rollout={a.rollout}, polyrl train defaults; gen "
                 f"{summary['gen_s']:.1f}s, update {summary['update_actor_s']:.1f}s"
                 + (f"; {' '.join(a.extra)}" if a.extra else ""))
        append_row(device, "real_model_cost s/step", shape, f"{summary['step_s']:.1f} s", path=a.rows_out)
    return summary


if __name__ == "__main__":
    main()
