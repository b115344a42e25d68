"""The FlowGRPO trainer shares the profiler and the run report with the LLM trainer."""

import json

import torch

from polyrl.rollout import sde_sampler
from polyrl.trainer.flow_config import FlowConfig
from polyrl.models.diffusion.pipeline import FlowPolicy, LatentShape
from polyrl.trainer.flow_grpo import FlowGRPOTrainer
from polyrl.utils.tracking import Tracker


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(5, 4)

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, **_):
        t = timestep[:, None, None].expand(*hidden_states.shape[:2], 1)
        return (self.net(torch.cat([hidden_states, t], -1)) + encoder_hidden_states.mean(1, keepdim=True),)


def _decode(z):  # latents -> [B, 1, 8, 8] images in [0, 1]
    return torch.sigmoid(z.reshape(z.shape[0], -1)[:, :1] + torch.linspace(-2, 2, 64)).reshape(-1, 1, 8, 8)


def test_flow_trainer_profiles_stages_and_logs_sample_grids(tmp_path):
    torch.manual_seed(0)
    policy = FlowPolicy(_Tiny(), encode_fn=lambda ps: [(torch.full((2, 4), float(len(p))), torch.ones(2)) for p in ps],
                        decode_fn=_decode, sigmas_fn=lambda n: sde_sampler.timestep_grid(n, 3.0),
                        latent=LatentShape(2, 2, 4))
    cfg = FlowConfig()
    cfg.data.train_batch_size, cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 2, 1
    cfg.actor_rollout_ref.rollout.n, cfg.actor_rollout_ref.rollout.pipeline.num_inference_steps = 3, 4
    cfg.actor_rollout_ref.rollout.algo.sde_window_range = [0, 3]
    t = cfg.trainer
    t.total_training_steps, t.save_freq, t.test_freq, t.progress_bar = 2, 0, 1, False
    t.run_dir, t.default_local_dir = str(tmp_path / "run"), str(tmp_path / "ck")
    cfg.global_profiler.tool, cfg.global_profiler.steps = "torch", [2]
    cfg.global_profiler.save_path = str(tmp_path / "prof")
    run = tmp_path / "run"
    tracker = Tracker(["file"], str(run), project_name="p", experiment_name="e", config={})
    prompts = [("a", {}), ("bb", {}), ("ccc", {})]
    trainer = FlowGRPOTrainer(cfg, policy, lambda im, p, m: im.mean(dim=(1, 2, 3)), prompts, prompts,
                              tracker=tracker)
    trainer.fit()
    tracker.close()
    traces = list((tmp_path / "prof").glob("step_2*.json"))
    assert len(traces) == 1
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"gen", "reward", "adv", "update_actor"} <= names
    assert sorted(p.name for p in (run / "samples").glob("*.png"))  # validation sample grids for the report
    from polyrl.report import build_report

    html = open(build_report(str(run))).read()
    assert "samples" in html.lower() and "data:image/png;base64" in html
