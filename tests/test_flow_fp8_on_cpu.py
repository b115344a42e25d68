"""FP8 sampling for the DiT (CPU emulation) and the LLM's rollout correction applied to FlowGRPO's per-step log-probs."""

import tempfile

import pytest
import torch
from torch import nn

from polyrl.algorithms import rollout_correction
from polyrl.errors import ConfigError
from polyrl.models.diffusion import tiny
from polyrl.rollout import fp8_dit
from polyrl.rollout.native.attention import quantize_fp8_rows
from polyrl.trainer import flow_grpo as flow_trainer
from polyrl.trainer import flow_quickstart
from polyrl.trainer.flow_config import FlowConfig


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj_in = nn.Linear(32, 32)
        self.transformer_blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 32))])

    def forward(self, x):
        return self.transformer_blocks[0](self.proj_in(x))


def test_fp8_sampling_emulates_e4m3_gemms_in_the_blocks_only():
    model = _Blocks()
    names = set(model.state_dict())
    x = torch.randn(5, 7, 32)
    exact = model(x)
    fp8 = fp8_dit.FP8Sampling(model)
    assert fp8.linears == [model.transformer_blocks[0][0], model.transformer_blocks[0][2]]  # proj_in stays
    assert set(model.state_dict()) == names  # the e4m3 copies live outside the module
    torch.testing.assert_close(model(x), exact, rtol=0, atol=0)  # outside the context: the plain GEMM
    with fp8.sampling():
        got = model(x)
    # by hand: per-token activation and per-row weight scales through float8_e4m3fn, fp32 products
    lin0, lin2 = fp8.linears

    def qdq(t):
        q, s = quantize_fp8_rows(t)
        return q.float() * s[..., None]

    h = model.proj_in(x)
    h = torch.nn.functional.gelu(qdq(h) @ qdq(lin0.weight).t() + lin0.bias)
    want = qdq(h) @ qdq(lin2.weight).t() + lin2.bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    err = float((got - exact).detach().norm() / exact.detach().norm())
    assert 1e-4 < err < 0.1, err  # e4m3 keeps 3 mantissa bits: a few percent, never exact


def test_trained_weights_are_requantised_before_sampling_and_a_frozen_base_is_not():
    model = _Blocks()
    fp8 = fp8_dit.FP8Sampling(model)
    x = torch.randn(3, 32)
    assert fp8.stale  # full fine-tuning: every weight trains
    with fp8.sampling():
        before = model(x)
    with torch.no_grad():
        model.transformer_blocks[0][0].weight.mul_(2.0)
    fp8.release()  # what the trainer does after each rollout: the copies are dropped, then made again
    assert model.transformer_blocks[0][0].fp8_weight is None
    with fp8.sampling():
        assert not torch.allclose(model(x), before)
    model.requires_grad_(False)
    assert not fp8.stale
    fp8.release()  # a frozen base keeps its copy
    assert model.transformer_blocks[0][0].fp8_weight is not None


def test_lora_runs_in_the_model_dtype_over_the_fp8_base():
    cfg = FlowConfig()
    cfg.actor_rollout_ref.model.lora_rank = 4
    policy = flow_quickstart.make_policy(cfg, tiny.build_transformer(seed=0), tiny.CharPromptEncoder(seed=0))
    fp8 = fp8_dit.FP8Sampling(policy.transformer)
    names = {id(m): n for n, m in policy.transformer.named_modules()}
    quantised = [names[id(m)] for m in fp8.linears]
    assert any(n.endswith("to_q.base_layer") for n in quantised)
    assert not any("lora_" in n for n in quantised)
    assert not fp8.stale  # the base is frozen: one e4m3 copy for the whole run


def test_lora_merges_into_the_fp8_copy_when_asked_and_follows_the_adapter():
    """merge_lora (the ODE steps' mode): one e4m3 GEMM of W + scaling B A while sampling, peft's own forward
    otherwise, and a new copy after the adapter trains."""
    cfg = FlowConfig()
    cfg.actor_rollout_ref.model.lora_rank = 4
    policy = flow_quickstart.make_policy(cfg, tiny.build_transformer(seed=0), tiny.CharPromptEncoder(seed=0))
    lora = next(m for m in policy.transformer.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer"))
    with torch.no_grad():
        lora.lora_B["default"].weight.normal_(std=0.5)  # B is zero at init, which would hide the adapter
    x = torch.randn(3, lora.base_layer.in_features)
    exact = lora(x)
    fp8 = fp8_dit.FP8Sampling(policy.transformer, merge_lora=True)
    assert fp8.merged == len([m for m in fp8.linears if m._fp8_lora is not None]) > 0 and fp8.stale
    torch.testing.assert_close(lora(x), exact, rtol=0, atol=0)  # outside sampling: peft's forward, plain base

    def qdq(t):
        q, s = quantize_fp8_rows(t)
        return q.float() * s[..., None]

    a, b, scale = lora.lora_A["default"].weight, lora.lora_B["default"].weight, lora.scaling["default"]
    base = lora.base_layer
    with fp8.sampling():
        got = lora(x)
    want = qdq(x) @ qdq(base.weight + scale * b @ a).t() + base.bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - exact).abs().max() > 0  # the e4m3 GEMM, not peft's
    with torch.no_grad():
        b.mul_(-1.0)
    fp8.release()
    with fp8.sampling():
        flipped = lora(x)
    want = qdq(x) @ qdq(base.weight + scale * b @ a).t() + base.bias
    torch.testing.assert_close(flipped, want, rtol=1e-5, atol=1e-5)  # re-merged after the adapter changed
    lora.enable_adapters(False)
    with fp8.sampling():
        torch.testing.assert_close(lora(x), base(x), rtol=0, atol=0)  # adapters off: the plain base, not the merge


def _trainer(quantization, rollout_is=None, threshold=2.0, kl=False, trained_steps=None, lora_rank=0):
    cfg = FlowConfig()
    cfg.actor_rollout_ref.model.lora_rank = lora_rank
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    ro.n, ro.pipeline.num_inference_steps, ro.quantization = 4, 4, quantization
    ro.fp8_trained_steps = quantization == "fp8" if trained_steps is None else trained_steps
    ro.algo.sde_window_size, ro.algo.sde_window_range = 2, [0, 2]
    cfg.data.train_batch_size, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = 2, 2, 8
    actor.diffusion_loss.clip_ratio, actor.use_kl_loss, actor.kl_loss_coef = 1e-3, kl, 0.01
    cfg.algorithm.rollout_correction.rollout_is = rollout_is
    cfg.algorithm.rollout_correction.rollout_is_threshold = threshold
    cfg.trainer.progress_bar, cfg.trainer.logger = False, []
    run = tempfile.mkdtemp(prefix="polyrl-test-fp8-")  # its own run folder: nothing written into the working tree
    cfg.trainer.run_dir, cfg.trainer.default_local_dir = run, f"{run}/checkpoints"
    torch.manual_seed(0)
    policy = flow_quickstart.make_policy(cfg, tiny.build_transformer(seed=0), tiny.CharPromptEncoder(seed=0))
    prompts = [(tiny.prompt_for(d), {"digit": d}) for d in range(4)]
    reward = lambda images, prompts, metadata: images.float().mean(dim=(1, 2, 3))  # noqa: E731
    return flow_trainer.FlowGRPOTrainer(cfg, policy, reward, prompts, prompts[:2])


def test_fp8_rollout_gap_is_measured_and_corrected_by_the_llm_function(monkeypatch):
    calls = []
    shared = rollout_correction.compute_rollout_correction

    def spy(old, roll, mask, cfg):
        calls.append((old.shape, cfg.rollout_is))
        return shared(old, roll, mask, cfg)

    assert flow_trainer.compute_rollout_correction is shared  # the LLM's function itself, not a copy
    monkeypatch.setattr(flow_trainer, "compute_rollout_correction", spy)
    trainer = _trainer("fp8", rollout_is="token", kl=True)
    rollout_logps = []
    sample = trainer._sample
    trainer._sample = lambda *a, **k: rollout_logps.append(trainer.fp8.active) or sample(*a, **k)
    m = trainer.step()
    assert rollout_logps == [True]  # the rollout chunk sampled with FP8 GEMMs
    assert calls == [((8, 2), "token")]  # [samples, trained steps]
    for key in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_is_mean",
                "training/rollout_probs_diff_mean", "timing_s/old_log_prob"):  # fmt: skip
        assert key in m, key
    assert 0 < m["training/rollout_probs_diff_max"] < 0.05  # e4m3 moves the step means a little, never 0
    assert abs(m["rollout_corr/rollout_is_mean"] - 1) < 0.05
    # pi_old is recomputed in the trained precision with the update's batch shapes: on-policy ratios are 1
    assert m["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_default_fp8_sampling_keeps_the_trained_steps_in_the_model_dtype():
    """FP8 on the ODE steps only: the trained steps' rollout log-probs are the trained precision's (a recompute gives
    the same numbers), so the step runs no old-log-prob pass, while the ODE steps' FP8 still moves the images."""
    trainer = _trainer("fp8", trained_steps=False, lora_rank=4)
    assert trainer.fp8.merged > 0  # the adapters ride in the ODE steps' e4m3 copies
    modes = []
    velocity = trainer.policy.velocity
    trainer.policy.velocity = lambda *a, **k: modes.append(trainer.fp8.active) or velocity(*a, **k)
    rollout = trainer.generate(trainer.train_prompts[:2])
    assert rollout.traj.step_indices == [0, 1] and modes == [False, False, True, True]  # FP8 on steps 2, 3 only
    trainer.policy.velocity = velocity
    trainer._correct_rollout(rollout)  # pi_old in the model dtype, the update's batch shapes
    torch.testing.assert_close(rollout.old_log_probs_KB, rollout.traj.log_probs_KB, rtol=0, atol=0)
    plain = _trainer(None, lora_rank=4).generate(trainer.train_prompts[:2])
    assert (plain.traj.final_B - rollout.traj.final_B).abs().max() > 1e-4  # the FP8 ODE steps moved the images
    torch.testing.assert_close(plain.traj.latents_KB[0], rollout.traj.latents_KB[0])  # step 0 starts from the noise
    m = _trainer("fp8", trained_steps=False, lora_rank=4).step()
    assert "timing_s/old_log_prob" not in m and m["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_rollout_correction_still_recomputes_with_bf16_trained_steps():
    """FP8 on the ODE steps only, but rollout correction asked for: pi_old is recomputed and the shared function
    runs; the trained steps sampled in the model dtype, so the gap it measures is nil."""
    m = _trainer("fp8", rollout_is="token", trained_steps=False).step()
    assert "timing_s/old_log_prob" in m and "rollout_corr/kl" in m
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.0, abs=1e-6)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-6)


def test_is_weights_reach_the_flow_grpo_loss():
    """TIS at 0.5 caps every weight (all ~1) at 0.5: the same batch's policy loss halves."""
    plain = _trainer("fp8").step()
    capped = _trainer("fp8", rollout_is="token", threshold=0.5).step()
    assert capped["rollout_corr/rollout_is_mean"] == pytest.approx(0.5)
    assert capped["actor/pg_loss"] == pytest.approx(0.5 * plain["actor/pg_loss"], rel=1e-4)


def test_bad_quantization_and_bypass_mode_are_refused():
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.quantization='int8'"):
        _trainer("int8")
    with pytest.raises(ConfigError, match="n_gpus_per_node"):
        fp8_dit.check_quantization("fp8", world_size=2)
    with pytest.raises(ConfigError, match="fp8_trained_steps=True only applies to FP8 sampling"):
        _trainer(None, trained_steps=True)  # a key that would otherwise be accepted and ignored
    cfg = FlowConfig()
    cfg.algorithm.rollout_correction.bypass_mode = True
    with pytest.raises(ConfigError, match="bypass_mode"):
        flow_trainer.check_correction(cfg)
