"""Does the asynchronous reward pay? FlowGRPO steps with the reward scored in the trainer vs in a worker process
(`reward.async_reward`), which scores each rollout chunk while the next one is generated (issue 6).

Two kinds of reward cost, because the answer depends on whether scoring competes with generation:
- `remote`: 30 ms of waiting per image (a reward model on its own GPU, or a scoring service): frees the cores;
- `ocr`: rapidocr (the OCR reward's engine) reading a rendered 96x384 text image per sample: CPU work on the same
  cores the generation uses.
The policy is a small random Qwen-Image transformer (4 blocks, 128 wide, 256 image tokens); 16 images per step in
chunks of 4, 10 sampling steps, SDE window 2. Runs on the CPU (it is the case this machine can measure); on a GPU the
generation leaves the cores free and the `remote` column is the relevant one.

    PYTHONPATH=. python benchmarks/flow_async_reward.py [--record]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

REWARDS = {
    "remote": '''
import time
def score(images, prompts, metadata):
    time.sleep(0.03 * len(images))  # a reward model elsewhere: the caller waits, its cores are free
    return images.mean(dim=(1, 2, 3)).tolist()
''',
    "ocr": '''
import numpy as np
from PIL import Image, ImageDraw
from polyrl.rewards.image_rewards import OCRReward, ground_truth_of, ocr_score
_engine = None
def score(images, prompts, metadata):
    global _engine
    _engine = _engine or OCRReward()
    out = []
    for img, p, m in zip(images, prompts, metadata):
        text = ground_truth_of(p, m)
        canvas = Image.new("RGB", (384, 96), "white")
        ImageDraw.Draw(canvas).text((10, 30), text, fill="black", font_size=40)
        out.append(ocr_score(_engine.read(np.asarray(canvas)), text) + 0.1 * float(img.mean()))  # groups differ
    return out
''',
}


def run(kind: str, async_reward: bool, steps: int, workdir: Path) -> dict:
    from diffusers import QwenImageTransformer2DModel

    from polyrl.rewards import image_rewards
    from polyrl.rewards.async_scorer import build_scorer
    from polyrl.trainer.flow_config import FlowConfig
    from polyrl.models.diffusion.pipeline import FlowPolicy, LatentShape
    from polyrl.trainer.flow_grpo import FlowGRPOTrainer

    path = workdir / f"{kind}_reward.py"
    path.write_text(REWARDS[kind])
    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(num_layers=4, attention_head_dim=32, num_attention_heads=4,
                                              joint_attention_dim=32, axes_dims_rope=(8, 12, 12))  # fmt: skip
    table: dict[str, tuple] = {}

    def encode(prompts):
        g = torch.Generator().manual_seed(1)
        for p in prompts:
            table.setdefault(p, (torch.randn(12, 32, generator=g), torch.ones(12, dtype=torch.long)))
        return [table[p] for p in prompts]

    cfg = FlowConfig()
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    ro.n, ro.pipeline.num_inference_steps = 8, 10
    ro.algo.noise_level, ro.algo.sde_window_size, ro.algo.sde_window_range = 1.2, 2, [0, 5]
    cfg.data.train_batch_size, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = 2, 2, 4
    cfg.trainer.progress_bar = False
    cfg.reward.async_reward = async_reward
    policy = FlowPolicy(transformer, encode_fn=encode, decode_fn=lambda z: z.float().view(len(z), 1, 16, -1).sigmoid(),
                        sigmas_fn=lambda n: torch.linspace(1, 0, n + 1), latent=LatentShape(16, 16, 64))  # fmt: skip
    policy.add_lora(8, 16, ["to_q", "to_k", "to_v"])
    reward_args = ({}, str(path), "score")
    scorer = build_scorer(cfg.reward, image_rewards.build_reward, reward_args)
    words = ["hello", "polyrl", "flow", "grpo", "image", "reward", "async", "digit"]
    prompts = [(f'a sign that reads "{w}"', {}) for w in words]
    trainer = FlowGRPOTrainer(cfg, policy, image_rewards.build_reward(*reward_args), prompts, prompts[:2],
                              async_scorer=scorer)  # fmt: skip
    try:
        trainer.step()  # warm-up: the worker has started and built its reward fn
        rows = [trainer.step() for _ in range(steps)]
    finally:
        if scorer is not None:
            scorer.close()
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    return {"step": mean("timing_s/step"), "gen": mean("timing_s/gen"), "reward": mean("timing_s/reward"),
            "update": mean("timing_s/update_actor")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    device = "CPU (%d threads)" % torch.get_num_threads()
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for kind in ("remote", "ocr"):
            for is_async in (False, True):
                results[(kind, is_async)] = r = run(kind, is_async, args.steps, Path(d))
                print(json.dumps({"kind": kind, "async_reward": is_async, **{k: round(v, 3) for k, v in r.items()}}),
                      flush=True)
    for kind in ("remote", "ocr"):
        sync, asy = results[(kind, False)], results[(kind, True)]
        gain = sync["step"] / asy["step"]
        print(f"{kind}: step {sync['step']:.2f} s in the trainer -> {asy['step']:.2f} s async ({gain:.2f}x)")
        if args.record:
            from _record import append_row

            append_row(device, "flow async reward: step time sync -> async",
                       f"FlowGRPO, tiny random Qwen-Image (4 blocks, 256 tokens), 16 img/step in chunks of 4, 10 steps;"
                       f" reward '{kind}' ({'30 ms wait per image' if kind == 'remote' else 'rapidocr per image'});"
                       f" gen {sync['gen']:.2f}/{asy['gen']:.2f} s, reward wait {sync['reward']:.2f}/"
                       f"{asy['reward']:.2f} s", f"{sync['step']:.2f} s -> {asy['step']:.2f} s",
                       ratio_peer=f"{gain:.2f}x faster" if gain >= 1 else f"{1 / gain:.2f}x slower")  # fmt: skip


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
