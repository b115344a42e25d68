"""FlowGRPO math: SDE step log-probs, the KL closed form, step selection, advantages and the clipped loss."""

import math

import pytest
import torch

from polyrl.errors import ConfigError
from polyrl.algorithms import flow_grpo
from polyrl.rollout import sde_sampler
from polyrl.algorithms import sde as sde_lib


@pytest.mark.parametrize("sde_type", ["sde", "dance_sde"])
def test_step_log_prob_matches_gaussian_density(sde_type):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 8, 4, generator=g), torch.randn(3, 8, 4, generator=g)
    sigma, sigma_next, a = 0.7, 0.55, 0.8
    out = sde_lib.step(sde_type, x, v, sigma, sigma_next, noise_level=a, sigma_max=0.9, generator=g)
    delta = sigma - sigma_next
    if sde_type == "sde":
        s = a * math.sqrt(sigma / (1 - sigma))
        mean = x - delta * (v + s**2 / (2 * sigma) * (x + (1 - sigma) * v))
        std = s * math.sqrt(delta)
    else:
        x0 = x - sigma * v
        mean = x - delta * v - (a**2 * delta / (2 * sigma**2)) * (x - (1 - sigma) * x0)
        std = a * math.sqrt(delta)
    direct = torch.distributions.Normal(mean.double(), std).log_prob(out.x_next.double()).mean(dim=(1, 2))
    torch.testing.assert_close(out.log_prob_B.double(), direct, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.mean, mean, rtol=1e-5, atol=1e-6)
    # recomputing the log-prob of the stored sample gives the same number
    again = sde_lib.step(sde_type, x, v, sigma, sigma_next, noise_level=a, sigma_max=0.9, x_next=out.x_next)
    assert torch.equal(again.log_prob_B, out.log_prob_B)


def test_sde_at_sigma_one_uses_sigma_max_and_cps_surrogate():
    x, v = torch.randn(2, 4), torch.randn(2, 4)
    out = sde_lib.step("sde", x, v, 1.0, 0.9, noise_level=0.7, sigma_max=0.9)
    assert torch.isfinite(out.log_prob_B).all() and abs(float(out.std) - 0.7 * math.sqrt(1 / 0.1) * math.sqrt(0.1)) < 1e-5
    cps = sde_lib.step("cps", x, v, 0.5, 0.4, noise_level=0.8, sigma_max=0.9)
    assert abs(float(cps.std) - 0.4 * math.sin(0.4 * math.pi)) < 1e-6
    torch.testing.assert_close(cps.log_prob_B, -((cps.x_next - cps.mean) ** 2).mean(-1))


def test_ode_step_is_euler():
    x, v = torch.randn(2, 4), torch.randn(2, 4)
    out = sde_lib.step("sde", x, v, 0.6, 0.4, noise_level=0.0, sigma_max=0.9)
    torch.testing.assert_close(out.x_next, x - 0.2 * v)


def test_kl_closed_form_matches_monte_carlo():
    g = torch.Generator().manual_seed(1)
    x, v, v_ref = torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g), torch.randn(1, 64, generator=g)
    kw = dict(noise_level=1.0, sigma_max=0.9)
    pol = sde_lib.step("sde", x, v, 0.6, 0.5, **kw)
    ref = sde_lib.step("sde", x, v_ref, 0.6, 0.5, **kw)
    closed = sde_lib.kl_to_ref("mean", mean=pol.mean, ref_mean=ref.mean, std=pol.std, v=v, ref_v=v_ref)
    # E_{x ~ pi}[log pi(x) - log ref(x)], per element, from 20k samples
    samples = pol.mean + pol.std * torch.randn(20000, 64, generator=g)
    lp = torch.distributions.Normal(pol.mean, pol.std).log_prob(samples)
    lr = torch.distributions.Normal(ref.mean, ref.std).log_prob(samples)
    mc = (lp - lr).mean()
    assert abs(float(closed) - float(mc)) < 0.05 * float(closed) + 1e-3
    # the velocity form agrees up to the analytic factor (delta/2)(s(1-sigma)/(2 sigma) + 1/s)^2 * 2
    s = math.sqrt(0.6 / 0.4)
    factor = (0.1 / 2) * (s * 0.4 / 1.2 + 1 / s) ** 2
    vel = sde_lib.kl_to_ref("velocity", mean=pol.mean, ref_mean=ref.mean, std=pol.std, v=v, ref_v=v_ref)
    torch.testing.assert_close(closed, factor * vel, rtol=1e-4, atol=1e-6)


def test_sde_window_and_timestep_fraction():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        steps = sde_lib.sde_steps(10, sde_window_size=2, sde_window_range=(0, 5), timestep_fraction=1.0, generator=g)
        assert len(steps) == 2 and steps[0] >= 0 and steps[-1] < 5 and steps[1] == steps[0] + 1
    assert sde_lib.sde_steps(10, sde_window_size=None, sde_window_range=None, timestep_fraction=0.99) == list(range(9))
    with pytest.raises(ConfigError, match="sde_window_size"):
        sde_lib.sde_steps(4, sde_window_size=5, sde_window_range=(0, 5), timestep_fraction=1.0)


def test_ratio_is_one_on_first_on_policy_micro_batch():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(9, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))

    def velocity(x, sigma_B):
        return net(torch.cat([x, sigma_B[:, None]], dim=-1))

    sigmas = sde_sampler.timestep_grid(6, shift=3.0)
    traj = sde_sampler.sample(velocity, torch.randn(4, 8), sigmas, sde_type="sde", noise_level=0.7, train_steps=[1, 2])
    assert traj.latents_KB.shape == (2, 4, 8) and traj.log_probs_KB.shape == (2, 4)
    adv_B = torch.tensor([1.0, -1.0, 0.5, -0.5])
    for k, i in enumerate(traj.step_indices):
        x = traj.latents_KB[k]
        v = velocity(x, sigmas[i].expand(4))
        out = sde_lib.step("sde", x, v, sigmas[i], sigmas[i + 1], noise_level=0.7, sigma_max=float(sigmas[1]),
                           x_next=traj.next_latents_KB[k])  # fmt: skip
        assert torch.equal(out.log_prob_B, traj.log_probs_KB[k])
        loss, m = flow_grpo.clipped_loss(out.log_prob_B, traj.log_probs_KB[k], adv_B, clip_ratio=1e-4, num_terms=8)
        assert float(m["actor/ratio_mean"]) == 4.0 and float(m["actor/pg_clipfrac_higher"]) == 0
        loss.backward()
    assert net[0].weight.grad.abs().sum() > 0


def test_clipped_loss_clips_outside_the_tiny_range():
    old = torch.zeros(4)
    new = torch.tensor([1e-3, -1e-3, 1e-6, -1e-6], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    loss, m = flow_grpo.clipped_loss(new, old, adv, clip_ratio=1e-4, num_terms=4)
    loss.backward()
    # sample 0: positive adv above 1+eps -> clipped, no gradient; sample 1: negative adv below 1-eps -> clipped
    assert new.grad[0] == 0 and new.grad[1] == 0 and new.grad[2] != 0
    assert float(m["actor/pg_clipfrac_higher"]) == 1 and float(m["actor/pg_clipfrac_lower"]) == 1
    kl = torch.ones(4)
    loss_kl, m_kl = flow_grpo.clipped_loss(new, old, adv, clip_ratio=1e-4, num_terms=4, kl_B=kl, kl_coef=0.5)
    torch.testing.assert_close(loss_kl - loss, torch.tensor(0.5))


def test_advantages_per_group_global_std_and_clip():
    scores = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 10.0])
    index = [0, 0, 0, 1, 1, 1]
    per_group = flow_grpo.flow_grpo_advantages(scores, index, global_std=False)
    torch.testing.assert_close(per_group[:3], torch.tensor([-1.0, 0.0, 1.0]) / (1 + flow_grpo.ADV_EPS))
    assert torch.equal(per_group[3:], torch.zeros(3))
    glob = flow_grpo.flow_grpo_advantages(scores, index, global_std=True)
    torch.testing.assert_close(glob[:3], torch.tensor([-1.0, 0.0, 1.0]) / (scores.std() + flow_grpo.ADV_EPS))
    dr = flow_grpo.flow_grpo_advantages(scores, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(dr[:3], torch.tensor([-1.0, 0.0, 1.0]))
    clipped = flow_grpo.flow_grpo_advantages(torch.tensor([0.0, 0.0, 0.0, 1.0]), [0] * 4, global_std=False, adv_clip_max=1.2)
    assert float(clipped.max()) == pytest.approx(1.2) and float(clipped.min()) < 0
    assert flow_grpo.zero_std_ratio(scores, index) == 0.5


def test_trainer_checkpoint_resume_matches_uninterrupted_run(tmp_path):
    """2 steps straight == 1 step, save, fresh trainer resumes, 1 more step (weights bit-equal)."""
    from polyrl.trainer.flow_config import FlowConfig
    from polyrl.models.diffusion.pipeline import FlowPolicy, LatentShape
    from polyrl.trainer.flow_grpo import FlowGRPOTrainer

    def make(run_dir, steps):
        torch.manual_seed(0)
        net = torch.nn.Linear(5, 4)

        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = net

            def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, **_):
                t = timestep[:, None, None].expand(*hidden_states.shape[:2], 1)
                return (self.net(torch.cat([hidden_states, t], -1)) + encoder_hidden_states.mean(1, keepdim=True),)

        policy = FlowPolicy(Tiny(), encode_fn=lambda ps: [(torch.full((2, 4), float(len(p))), torch.ones(2)) for p in ps],
                            decode_fn=lambda z: z, sigmas_fn=lambda n: sde_sampler.timestep_grid(n, 3.0),
                            latent=LatentShape(2, 2, 4))  # fmt: skip
        cfg = FlowConfig()
        cfg.data.train_batch_size, cfg.actor_rollout_ref.actor.ppo_mini_batch_size = 2, 1
        cfg.actor_rollout_ref.rollout.n, cfg.actor_rollout_ref.rollout.pipeline.num_inference_steps = 3, 4
        cfg.actor_rollout_ref.rollout.algo.sde_window_range = [0, 3]
        cfg.actor_rollout_ref.actor.optim.lr = 1e-2
        t = cfg.trainer
        t.total_training_steps, t.save_freq, t.test_freq, t.progress_bar = steps, 1, 0, False
        t.run_dir, t.default_local_dir = str(run_dir), str(run_dir / "checkpoints")
        reward = lambda im, p, m: im.mean(dim=(1, 2))  # noqa: E731
        prompts = [("a", {}), ("bb", {}), ("ccc", {})]
        return FlowGRPOTrainer(cfg, policy, reward, prompts, prompts), net

    straight, net_a = make(tmp_path / "a", 2)
    straight.fit()
    first, _ = make(tmp_path / "b", 1)
    first.fit()
    resumed, net_b = make(tmp_path / "b", 2)
    resumed.fit()
    assert resumed.global_step == 2 and (tmp_path / "b" / "checkpoints" / "global_step_2").is_dir()
    assert torch.equal(net_a.weight, net_b.weight)
