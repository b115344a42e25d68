"""Run by tests/test_flow_fsdp_gpu.py, once under torchrun (FSDP2) and once as one process: full fine-tuning of the
tiny quickstart DiT with fp32 weights and `fsdp_config.mixed_precision.param_dtype=bf16`. Writes what it saw to
the JSON file named by argv[1] (rank 0)."""

import json
import sys

import torch

from polyrl.distributed import DistEnv
from polyrl.models.diffusion import tiny
from polyrl.trainer import flow_quickstart
from polyrl.trainer.flow_config import FlowConfig
from polyrl.trainer.flow_grpo import FlowGRPOTrainer


def main(out: str) -> None:
    dist = DistEnv.setup("cuda")
    device = dist.device if dist.is_distributed else torch.device("cuda")
    cfg = FlowConfig()
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    ro.n, ro.pipeline.num_inference_steps = 2, 4
    ro.algo.sde_window_size, ro.algo.sde_window_range = 2, [0, 3]
    cfg.data.train_batch_size, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = 4, 2, 2
    actor.optim.lr, actor.diffusion_loss.clip_ratio = 1e-3, 0.5
    actor.fsdp_config.mixed_precision = {"param_dtype": "bf16"}
    cfg.actor_rollout_ref.model.lora_rank = 0
    t = cfg.trainer
    t.total_training_steps, t.test_freq, t.save_freq, t.val_before_train, t.progress_bar = 2, 0, -1, False, False
    t.resume_mode, t.default_local_dir = "disable", f"{out}.ckpt"
    torch.manual_seed(0)
    policy = flow_quickstart.make_policy(cfg, tiny.build_transformer(seed=0), tiny.CharPromptEncoder(seed=0),
                                         device=device)  # fmt: skip
    prompts = [(tiny.prompt_for(d), {"digit": d}) for d in range(4)]
    reward = lambda images, prompts, metadata: images.float().mean(dim=(1, 2, 3))  # noqa: E731
    trainer = FlowGRPOTrainer(cfg, policy, reward, prompts, prompts[:2], dist=dist)
    seen = set()  # dtypes of the weights a block's linears compute with
    for m in policy.transformer.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, args: seen.add((str(mod.weight.dtype), str(args[0].dtype))))
    start = {n: p.detach().float().clone() for n, p in policy.transformer.named_parameters()}
    rows = [trainer.step() for _ in range(2)]
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    state = [v for p in params for v in trainer.optimizer.state[p].values() if v.ndim > 0]
    moved = max(float((p.detach().float() - start[n]).abs().max()) for n, p in policy.transformer.named_parameters())
    report = {
        "processes": dist.world_size,
        "optimizer_param_dtypes": sorted({str(p.dtype) for p in params}),
        "optimizer_state_dtypes": sorted({str(v.dtype) for v in state}),
        "sharded": all(hasattr(p, "device_mesh") for p in params),
        "masters": trainer.master is not None,
        "linear_weight_and_input_dtypes": sorted(seen),
        "rows": [{k: r[k] for k in ("critic/rewards/mean", "actor/pg_loss", "actor/grad_norm")} for r in rows],
        "moved": moved,
    }
    dist.close()
    if dist.is_rank0:
        with open(out, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
