"""A tiny random-weight QwenImagePipeline (built here, saved, reloaded from its directory) through FlowGRPO steps."""

import os
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from polyrl.trainer.flow_config import FlowConfig  # noqa: E402
from polyrl.models.diffusion.pipeline import cfg_combine, load_pipeline_policy  # noqa: E402
from polyrl.trainer.flow_grpo import FlowGRPOTrainer  # noqa: E402


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)  # fmt: skip
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from polyrl.models.tiny import build_char_tokenizer

    torch.manual_seed(0)
    tok = build_char_tokenizer()
    text = dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})  # fmt: skip
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16)
    te = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                                             vocab_size=len(tok), hidden_size=16))  # fmt: skip
    tr = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                                     num_attention_heads=3, joint_attention_dim=16, axes_dims_rope=(8, 4, 4))  # fmt: skip
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)  # fmt: skip
    sch = FlowMatchEulerDiscreteScheduler(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
                                          shift=1.0, shift_terminal=0.02, time_shift_type="exponential",
                                          use_dynamic_shifting=True)  # fmt: skip
    out = tmp_path_factory.mktemp("qwen_image_tiny")
    QwenImagePipeline(scheduler=sch, vae=vae, text_encoder=te, tokenizer=tok, transformer=tr).save_pretrained(out)
    return str(out)


def brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))


def _config(cfg_scale: float, lora: bool, kl: bool) -> FlowConfig:
    cfg = FlowConfig()
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    ro.n, ro.pipeline.height, ro.pipeline.width = 2, 32, 32
    ro.pipeline.num_inference_steps, ro.pipeline.true_cfg_scale, ro.pipeline.max_sequence_length = 3, cfg_scale, 32
    ro.algo.noise_level, ro.algo.sde_window_size, ro.algo.sde_window_range = 1.2, 1, [0, 2]
    ro.val_kwargs.num_inference_steps = 4
    cfg.data.train_batch_size, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = 2, 2, 2
    actor.optim.lr, actor.diffusion_loss.clip_ratio = 1e-3, 1e-2
    actor.use_kl_loss, actor.kl_loss_coef = kl, 0.1
    cfg.actor_rollout_ref.model.lora_rank = 4 if lora else 0
    cfg.trainer.total_training_steps, cfg.trainer.test_freq, cfg.trainer.progress_bar = 1, 1, False
    run = tempfile.mkdtemp(prefix="polyrl-test-flow-")  # its own run folder and checkpoints: nothing to resume
    cfg.trainer.run_dir, cfg.trainer.default_local_dir = run, f"{run}/checkpoints"
    return cfg


@pytest.mark.parametrize("cfg_scale,lora,kl", [(4.0, True, True), (1.0, False, True)])
def test_two_flow_grpo_steps_on_a_tiny_qwen_image_pipeline(pipe_dir, cfg_scale, lora, kl):
    torch.manual_seed(0)
    cfg = _config(cfg_scale, lora, kl)
    p = cfg.actor_rollout_ref.rollout.pipeline
    policy = load_pipeline_policy(pipe_dir, height=p.height, width=p.width, true_cfg_scale=p.true_cfg_scale,
                                  max_sequence_length=p.max_sequence_length)  # fmt: skip
    m = cfg.actor_rollout_ref.model
    if lora:
        policy.add_lora(m.lora_rank, m.lora_alpha, m.target_modules, m.lora_init)
        assert all("lora" in n for n, q in policy.transformer.named_parameters() if q.requires_grad)
    before = {n: q.detach().clone() for n, q in policy.transformer.named_parameters()}
    prompts = [('a sign that reads "hi"', {}), ('a card that reads "ok"', {})]
    trainer = FlowGRPOTrainer(cfg, policy, brightness, prompts, prompts[:1])
    history = trainer.fit()
    assert len(history["train"]) == 1 and len(history["val"]) == 2
    metrics = trainer.step()
    for key in ("actor/pg_loss", "actor/ratio_mean", "actor/grad_norm", "critic/rewards/mean", "perf/throughput",
                "timing_s/gen", "timing_s/reward", "timing_s/update_actor", "timing_s/step"):  # fmt: skip
        assert key in metrics and metrics[key] == metrics[key], key
    if kl:
        assert "actor/kl_loss" in metrics and metrics["actor/kl_loss"] >= 0
    # one optimizer step per batch: every micro-batch and trained step is on-policy, the ratio is exactly 1
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == 0.0
    changed = {n for n, q in policy.transformer.named_parameters() if not torch.equal(q, before[n])}
    assert changed, "no weight moved"
    if lora:
        assert all("lora" in n for n in changed)
    # prompt embeddings are cached: the text encoder ran once per distinct prompt (+ the negative prompt with CFG)
    assert len(policy._cache) == 2 + (cfg_scale > 1)


def test_cfg_combine_keeps_conditional_norm():
    v_c, v_u = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    v = cfg_combine(v_c, v_u, 4.0)
    torch.testing.assert_close(v.norm(dim=-1), v_c.norm(dim=-1))
    guided = v_u + 4.0 * (v_c - v_u)
    torch.testing.assert_close(v / v.norm(dim=-1, keepdim=True), guided / guided.norm(dim=-1, keepdim=True))


def test_rollout_chunk_can_differ_from_the_training_micro_batch(pipe_dir):
    """rollout.log_prob_micro_batch_size_per_gpu sets the sampling chunk; fp32 on CPU the ratio still starts at 1."""
    torch.manual_seed(0)
    cfg = _config(1.0, True, False)
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 1
    cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 4
    p = cfg.actor_rollout_ref.rollout.pipeline
    policy = load_pipeline_policy(pipe_dir, height=p.height, width=p.width, max_sequence_length=p.max_sequence_length)
    policy.add_lora(4, 8, cfg.actor_rollout_ref.model.target_modules)
    batches = []
    policy.transformer.register_forward_pre_hook(
        lambda mod, args, kw: batches.append((torch.is_grad_enabled(), kw["hidden_states"].shape[0])), with_kwargs=True)
    prompts = [('a sign that reads "hi"', {}), ('a card that reads "ok"', {})]
    metrics = FlowGRPOTrainer(cfg, policy, brightness, prompts, prompts[:1]).step()
    assert {b for grad, b in batches if not grad} == {4}  # 2 prompts x n=2 sampled in one chunk
    assert {b for grad, b in batches if grad} == {1}  # trained one image at a time
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_prompts_pad_to_a_multiple_of_32_masked_and_keep_the_velocity(pipe_dir):
    from polyrl.models.diffusion.adapters.qwenimage import pad_prompts

    policy = load_pipeline_policy(pipe_dir, height=32, width=32, max_sequence_length=64)
    e = torch.randn(5, 16)
    one = torch.ones(5, dtype=torch.long)
    padded, mask = pad_prompts([(e, one), (e + 1, one)])
    assert padded.shape == (2, 32, 16) and mask.tolist() == [[1] * 5 + [0] * 27] * 2 and padded[:, 5:].abs().sum() == 0
    _, mask = pad_prompts([(e, one), (e[:3], one[:3])])
    assert mask.tolist() == [[1] * 5 + [0] * 27, [1] * 3 + [0] * 29]
    full, mask = pad_prompts([(torch.randn(32, 16), torch.ones(32, dtype=torch.long))] * 2)
    assert mask is None and full.shape == (2, 32, 16)  # already a whole bucket: nothing padded, unmasked attention
    x, sigma = policy.noise(2, torch.Generator().manual_seed(0)), torch.full((2,), 0.5)
    exact = torch.stack([e, e + 1])
    with torch.no_grad():
        unpadded = policy.adapter.forward(policy.transformer, x, sigma, (exact, None))
        bucketed = policy.adapter.forward(policy.transformer, x, sigma, pad_prompts([(e, one), (e + 1, one)]))
        unmasked_pad = policy.adapter.forward(policy.transformer, x, sigma, (padded, None))
    torch.testing.assert_close(bucketed, unpadded, rtol=1e-5, atol=1e-6)
    assert (unmasked_pad - unpadded).abs().max() > 1e-3  # the mask is what keeps the padding out


def test_one_step_runs_text_encoder_dit_vae_and_ocr_each_step_with_fp8_sampling(pipe_dir):
    """Every stage of the real pipeline inside the step: the text encoder encodes each step's prompts (no cache across
    steps, as VeRL-Omni), the DiT samples with emulated FP8 GEMMs, the VAE decodes, rapidocr scores."""
    from polyrl.rewards import image_rewards

    torch.manual_seed(0)
    cfg = _config(4.0, True, False)
    cfg.actor_rollout_ref.rollout.quantization = "fp8"
    cfg.actor_rollout_ref.rollout.fp8_trained_steps = True  # every step in FP8: the gap is measured and corrected
    cfg.algorithm.rollout_correction.rollout_is = "token"
    cfg.actor_rollout_ref.actor.skip_zero_adv = False  # random weights draw no text: OCR scores 0, train them anyway
    p = cfg.actor_rollout_ref.rollout.pipeline
    policy = load_pipeline_policy(pipe_dir, height=p.height, width=p.width, true_cfg_scale=p.true_cfg_scale,
                                  max_sequence_length=p.max_sequence_length)  # fmt: skip
    policy.add_lora(4, 8, cfg.actor_rollout_ref.model.target_modules)
    calls = {"text_encoder": 0, "vae": 0, "ocr": 0}
    policy.pipe.text_encoder.register_forward_hook(lambda *_: calls.__setitem__("text_encoder", calls["text_encoder"] + 1))
    decode = policy.pipe.vae.decode

    def counted_decode(z, **kw):
        calls["vae"] += z.shape[0]
        return decode(z, **kw)

    policy.pipe.vae.decode = counted_decode
    reward = image_rewards.build_reward({"ocr": 1.0})
    ocr = reward.fns["ocr"]
    read = ocr.read
    ocr.read = lambda image: calls.__setitem__("ocr", calls["ocr"] + 1) or read(image)
    prompts = [('a sign that reads "hi"', {}), ('a card that reads "ok"', {})]
    trainer = FlowGRPOTrainer(cfg, policy, reward, prompts, prompts[:1])
    for step in (1, 2):
        before = dict(calls)
        m = trainer.step()
        assert calls["text_encoder"] > before["text_encoder"], f"step {step}: prompts not encoded"
        assert calls["vae"] - before["vae"] == 4 and calls["ocr"] - before["ocr"] == 4  # 2 prompts x n=2
    names = {id(mod): n for n, mod in policy.transformer.named_modules()}
    assert any(names[id(lin)].endswith("attn.to_q.base_layer") for lin in trainer.fp8.linears)
    assert m["training/rollout_probs_diff_max"] > 0 and "rollout_corr/k3_kl" in m  # e4m3 moved the step means
    assert m["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_polyrl_flow_train_runs_fp8_sampling_and_ocr_on_a_local_pipeline(pipe_dir, tmp_path):
    import json

    from polyrl.trainer import flow_cli

    (tmp_path / "train.txt").write_text('a sign that reads "hi"\na card that reads "ok"\n')
    run = tmp_path / "run"
    code = flow_cli.main(["train", f"actor_rollout_ref.model.path={pipe_dir}", f"data.train_files={tmp_path / 'train.txt'}",
                          "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
                          "actor_rollout_ref.rollout.pipeline.height=32", "actor_rollout_ref.rollout.pipeline.width=32",
                          "actor_rollout_ref.rollout.pipeline.num_inference_steps=3",
                          "actor_rollout_ref.rollout.algo.sde_window_range=[0,2]",
                          "actor_rollout_ref.rollout.algo.sde_window_size=1", "actor_rollout_ref.model.lora_rank=4",
                          "actor_rollout_ref.rollout.quantization=fp8", "actor_rollout_ref.rollout.fp8_trained_steps=True",
                          "algorithm.rollout_correction.rollout_is=token",
                          "trainer.total_training_steps=1", "trainer.test_freq=0", "trainer.logger=[file]",
                          "trainer.progress_bar=False", f"trainer.run_dir={run}",
                          f"trainer.default_local_dir={run / 'ckpt'}"])  # fmt: skip
    assert code == 0
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("rollout_corr/kl", "training/rollout_probs_diff_mean", "timing_s/old_log_prob", "timing_s/reward"):
        assert key in row, key


@pytest.mark.parametrize("merge_lora", [False, True])
def test_compiled_fp8_blocks_share_one_graph_per_mode(pipe_dir, monkeypatch, merge_lora):
    """FP8 sampling inside compiled blocks: every block reuses the same graph for each mode (FP8 on, FP8 off), so a
    60-block DiT does not recompile per block and fall back to eager past dynamo's recompile limit (the H200 run of
    2026-11-24 did: `recompile_limit (8)` on the FP8 blocks). Counted with dynamo's eager backend on CPU."""
    import contextlib
    import functools

    import torch._dynamo
    from torch._dynamo.utils import counters

    from polyrl.rollout.fp8_dit import FP8Sampling

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    policy = load_pipeline_policy(pipe_dir, height=32, width=32, max_sequence_length=32)
    policy.add_lora(4, 8, FlowConfig().actor_rollout_ref.model.target_modules)
    fp8 = FP8Sampling(policy.transformer, merge_lora=merge_lora)
    assert (fp8.merged > 0) == merge_lora
    torch._dynamo.reset()
    counters.clear()
    policy.compile_blocks()
    prompts = ['a sign that reads "hi"', 'a card that reads "ok"']
    policy.cache_prompts(prompts)
    x, sigma = policy.noise(2, torch.Generator().manual_seed(0)), torch.full((2,), 0.5)
    with torch.no_grad():
        for fp8_on in (True, True, False, True, False):
            with fp8.sampling() if fp8_on else contextlib.nullcontext():
                policy.velocity(x, sigma, prompts)
    assert len(policy.transformer.transformer_blocks) == 2
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # FP8 on, FP8 off: not one per block
    assert not counters["graph_break"], dict(counters["graph_break"])  # each block one whole graph


def test_compiled_blocks_leave_room_for_every_graph_a_run_needs():
    """Past dynamo's default 8 graphs per code object a block ran eagerly in the recompute of a compiled forward, and
    gradient checkpointing failed (compile_blocks' comment)."""
    from polyrl.models.diffusion import pipeline, tiny
    from polyrl.trainer import flow_quickstart

    policy = flow_quickstart.make_policy(FlowConfig(), tiny.build_transformer(seed=0), tiny.CharPromptEncoder(seed=0))
    policy.compile_blocks()
    assert torch._dynamo.config.recompile_limit >= pipeline.RECOMPILE_LIMIT >= 2 * 2 * 2 * 4


def test_one_frame_convs_decode_the_same_images_as_diffusers():
    """The VAE decoder's causal 3-D convolutions as 2-D ones on an image's single frame (a third of their FLOPs):
    the same pixels as diffusers' decode, and a two-frame latent still takes diffusers' own path."""
    from diffusers import AutoencoderKLQwenImage

    from polyrl.models.diffusion.adapters.qwenimage import one_frame_convs

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                 temperal_downsample=[False, True]).eval()  # fmt: skip
    z1, z2 = torch.randn(3, 4, 1, 8, 8), torch.randn(1, 4, 2, 8, 8)
    with torch.no_grad():
        ref1, ref2 = vae.decode(z1, return_dict=False)[0], vae.decode(z2, return_dict=False)[0]
        assert one_frame_convs(vae) >= 10
        out1, out2 = vae.decode(z1, return_dict=False)[0], vae.decode(z2, return_dict=False)[0]
    assert ref1.abs().mean() > 1e-3  # a non-trivial image
    torch.testing.assert_close(out1, ref1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out2, ref2, rtol=1e-4, atol=1e-5)  # frame 1 reads frame 0's cache: diffusers' path
