"""Tiny random SD3 and FLUX pipelines (built here, saved, reloaded from their directories) behind FlowPolicy.

Each family is checked three ways: one velocity against the transformer called the way its diffusers pipeline calls
it, a whole ODE sample through our sampler against `pipe(...)`'s output latents for the same noise and steps, and two
FlowGRPO steps with LoRA through the trainer.
"""

import json
import os

import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from polyrl.errors import ConfigError  # noqa: E402
from polyrl.rollout import sde_sampler  # noqa: E402
from polyrl.models.diffusion.adapters import LatentShape, pack_2x2, unpack_2x2  # noqa: E402
from polyrl.models.diffusion.adapters.flux import image_ids  # noqa: E402
from polyrl.trainer.flow_config import FlowConfig  # noqa: E402
from polyrl.models.diffusion.pipeline import load_pipeline_policy  # noqa: E402
from polyrl.trainer.flow_grpo import FlowGRPOTrainer  # noqa: E402

SIZE, MAX_SEQ, GUIDANCE = 32, 24, 2.5  # 32 px -> 16x16 latents (VAE factor 2) -> 8x8 tokens of 2x2 patches
PROMPTS = ['a sign that reads "hi"', 'a card that reads "ok"']


def _tokenizer(max_len: int):
    from polyrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer(chat_template=None)
    tok.model_max_length = max_len  # the pipelines pad CLIP prompts to this
    return tok


def _clip(tok, with_projection: bool):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=tok.model_max_length, projection_dim=16,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=0)  # fmt: skip
    return (CLIPTextModelWithProjection if with_projection else CLIPTextModel)(cfg)


def _t5(tok):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=len(tok), d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))  # fmt: skip


def _vae(shift_factor: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=(8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         scaling_factor=1.5, shift_factor=shift_factor, use_quant_conv=False,
                         use_post_quant_conv=False)  # fmt: skip


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(0)
    t1, t2, t3 = _tokenizer(32), _tokenizer(32), _tokenizer(MAX_SEQ)
    tr = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                               attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                               caption_projection_dim=16, pooled_projection_dim=32, pos_embed_max_size=16)  # fmt: skip
    out = tmp_path_factory.mktemp("sd3_tiny")
    StableDiffusion3Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_vae(0.06), transformer=tr,
                             text_encoder=_clip(t1, True), tokenizer=t1, text_encoder_2=_clip(t2, True),
                             tokenizer_2=t2, text_encoder_3=_t5(t3), tokenizer_3=t3).save_pretrained(out)  # fmt: skip
    return str(out)


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    t1, t2 = _tokenizer(32), _tokenizer(MAX_SEQ)
    # guidance_embeds=True: a FLUX.1-dev-like (guidance-distilled) transformer
    tr = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
                                guidance_embeds=True, axes_dims_rope=(4, 4, 8))  # fmt: skip
    sch = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    out = tmp_path_factory.mktemp("flux_tiny")
    FluxPipeline(scheduler=sch, vae=_vae(0.1), text_encoder=_clip(t1, False), tokenizer=t1, text_encoder_2=_t5(t2),
                 tokenizer_2=t2, transformer=tr).save_pretrained(out)  # fmt: skip
    return str(out)


def _load(path, cfg_scale, guidance=GUIDANCE):
    return load_pipeline_policy(path, height=SIZE, width=SIZE, true_cfg_scale=cfg_scale, negative_prompt="",
                                max_sequence_length=MAX_SEQ, guidance_scale=guidance)  # fmt: skip


def _ode(policy, noise, num_steps):
    traj = sde_sampler.sample(lambda x, s: policy.velocity(x, s, PROMPTS), noise, policy.sigmas(num_steps),
                          sde_type="sde", noise_level=0.0, train_steps=[])  # fmt: skip
    return traj.final_B


# --------------------------------------------------------------------------- layout helpers


def test_packing_and_image_ids_match_flux_pipeline():
    from diffusers import FluxPipeline

    z = torch.randn(2, 3, 6, 8)
    latent = LatentShape(3, 4, 12)
    packed = pack_2x2(z)
    assert torch.equal(packed, FluxPipeline._pack_latents(z, 2, 3, 6, 8))
    assert torch.equal(unpack_2x2(packed, latent), z)
    assert torch.equal(image_ids(latent), FluxPipeline._prepare_latent_image_ids(1, 3, 4, "cpu", torch.float32))


def test_unsupported_pipeline_class_is_a_config_error(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ConfigError, match=r"StableDiffusionPipeline; supported pipelines are \['FluxPipeline'"):
        load_pipeline_policy(str(tmp_path), height=SIZE, width=SIZE)


# --------------------------------------------------------------------------- SD3


def test_sd3_velocity_is_the_pipelines_cfg_call(sd3_dir):
    policy = _load(sd3_dir, 4.5)
    pipe, latent = policy.pipe, policy.latent
    assert latent == LatentShape(8, 8, 16)
    x = policy.noise(2, torch.Generator().manual_seed(1))
    sigma = policy.sigmas(4)[1]
    ours = policy.velocity(x, sigma.expand(2), PROMPTS)
    with torch.no_grad():  # StableDiffusion3Pipeline.__call__: batch [uncond; cond], timestep = scheduler.timesteps[i]
        pe, npe, pooled, npooled = pipe.encode_prompt(
            prompt=PROMPTS, prompt_2=None, prompt_3=None, negative_prompt="", do_classifier_free_guidance=True,
            max_sequence_length=MAX_SEQ,
        )  # fmt: skip
        t = pipe.scheduler.timesteps[1]
        v = pipe.transformer(hidden_states=torch.cat([unpack_2x2(x, latent)] * 2), timestep=t.expand(4),
                             encoder_hidden_states=torch.cat([npe, pe]),
                             pooled_projections=torch.cat([npooled, pooled]), return_dict=False)[0]  # fmt: skip
    v_uncond, v_cond = v.chunk(2)
    expected = pack_2x2(v_uncond + 4.5 * (v_cond - v_uncond))
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(expected, pack_2x2(v_cond), atol=1e-3)  # guidance changes the answer


def test_sd3_ode_sample_matches_the_pipeline(sd3_dir):
    policy = _load(sd3_dir, 4.5)
    noise = policy.noise(2, torch.Generator().manual_seed(2))
    ours = _ode(policy, noise, 4)
    with torch.no_grad():
        theirs = policy.pipe(prompt=PROMPTS, negative_prompt="", latents=unpack_2x2(noise, policy.latent),
                             num_inference_steps=4, guidance_scale=4.5, height=SIZE, width=SIZE,
                             max_sequence_length=MAX_SEQ, output_type="latent").images  # fmt: skip
    torch.testing.assert_close(ours, pack_2x2(theirs), atol=1e-5, rtol=1e-5)
    assert (ours - noise).abs().mean() > 0.1  # the sample moved away from the noise
    images = policy.decode(ours)
    assert images.shape == (2, 3, SIZE, SIZE) and 0 <= images.min() and images.max() <= 1


# --------------------------------------------------------------------------- FLUX


def test_flux_velocity_is_the_pipelines_call_with_guidance_embedding(flux_dir):
    policy = _load(flux_dir, 1.0)
    pipe = policy.pipe
    x = policy.noise(2, torch.Generator().manual_seed(1))
    sigma = policy.sigmas(4)[1]
    ours = policy.velocity(x, sigma.expand(2), PROMPTS)
    with torch.no_grad():  # FluxPipeline.__call__: timestep = t / 1000, guidance = guidance_scale, 2-D ids
        pe, pooled, text_ids = pipe.encode_prompt(prompt=PROMPTS, prompt_2=None, max_sequence_length=MAX_SEQ)
        img_ids = pipe._prepare_latent_image_ids(2, 8, 8, "cpu", torch.float32)

        def call(guidance):
            return pipe.transformer(hidden_states=x, timestep=pipe.scheduler.timesteps[1].expand(2) / 1000,
                                    guidance=torch.full((2,), guidance), pooled_projections=pooled,
                                    encoder_hidden_states=pe, txt_ids=text_ids, img_ids=img_ids,
                                    return_dict=False)[0]  # fmt: skip

        expected = call(GUIDANCE)
        other_guidance = call(GUIDANCE + 2.0)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(expected, other_guidance, atol=1e-4)  # the guidance value reaches the model


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_flux_ode_sample_matches_the_pipeline(flux_dir, cfg_scale):
    policy = _load(flux_dir, cfg_scale)
    noise = policy.noise(2, torch.Generator().manual_seed(2))
    ours = _ode(policy, noise, 4)
    with torch.no_grad():  # the pipeline takes packed latents as they are
        theirs = policy.pipe(prompt=PROMPTS, negative_prompt="", latents=noise, num_inference_steps=4,
                             guidance_scale=GUIDANCE, true_cfg_scale=cfg_scale, height=SIZE, width=SIZE,
                             max_sequence_length=MAX_SEQ, output_type="latent").images  # fmt: skip
    # true CFG: the pipeline runs two forwards, we batch [cond; uncond] in one: equal up to float reassociation
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert (ours - noise).abs().mean() > 0.1
    images = policy.decode(ours)
    assert images.shape == (2, 3, SIZE, SIZE) and 0 <= images.min() and images.max() <= 1


# --------------------------------------------------------------------------- FlowGRPO through the trainer


def _brightness(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))


def _grpo_config(cfg_scale: float) -> FlowConfig:
    cfg = FlowConfig()
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    ro.n, ro.pipeline.height, ro.pipeline.width = 2, SIZE, SIZE
    ro.pipeline.num_inference_steps, ro.pipeline.true_cfg_scale, ro.pipeline.max_sequence_length = 3, cfg_scale, MAX_SEQ
    ro.pipeline.guidance_scale = GUIDANCE
    ro.algo.noise_level, ro.algo.sde_window_size, ro.algo.sde_window_range = 0.7, 1, [0, 2]
    ro.val_kwargs.num_inference_steps = 3
    cfg.data.train_batch_size, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = 2, 2, 2
    actor.optim.lr, actor.diffusion_loss.clip_ratio = 1e-3, 1e-2
    actor.use_kl_loss, actor.kl_loss_coef = True, 0.1
    cfg.actor_rollout_ref.model.lora_rank = 4
    cfg.trainer.total_training_steps, cfg.trainer.test_freq, cfg.trainer.progress_bar = 1, 1, False
    run = tempfile.mkdtemp(prefix="polyrl-test-flow-")  # its own run folder and checkpoints: nothing to resume
    cfg.trainer.run_dir, cfg.trainer.default_local_dir = run, f"{run}/checkpoints"
    return cfg


@pytest.mark.parametrize("family,cfg_scale", [("sd3", 4.5), ("flux", 1.0)])
def test_two_flow_grpo_lora_steps(sd3_dir, flux_dir, family, cfg_scale):
    torch.manual_seed(0)
    cfg = _grpo_config(cfg_scale)
    p, m = cfg.actor_rollout_ref.rollout.pipeline, cfg.actor_rollout_ref.model
    policy = load_pipeline_policy(
        sd3_dir if family == "sd3" else flux_dir, height=p.height, width=p.width, true_cfg_scale=p.true_cfg_scale,
        negative_prompt=p.negative_prompt, max_sequence_length=p.max_sequence_length, guidance_scale=p.guidance_scale,
    )  # fmt: skip
    policy.add_lora(m.lora_rank, m.lora_alpha, m.target_modules, m.lora_init)
    assert all("lora" in n for n, q in policy.transformer.named_parameters() if q.requires_grad)
    before = {n: q.detach().clone() for n, q in policy.transformer.named_parameters()}
    prompts = [(q, {}) for q in PROMPTS]
    trainer = FlowGRPOTrainer(cfg, policy, _brightness, prompts, prompts[:1])
    history = trainer.fit()
    assert len(history["train"]) == 1 and len(history["val"]) == 2
    metrics = trainer.step()
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/rewards/mean", "timing_s/gen"):
        assert key in metrics and metrics[key] == metrics[key], key
    # one optimizer step per batch: the update replays the rollout's exact computation, so the ratio is 1
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    changed = {n for n, q in policy.transformer.named_parameters() if not torch.equal(q, before[n])}
    assert changed and all("lora" in n for n in changed)
    assert len(policy._cache) == 2 + (cfg_scale > 1)  # text encoders ran once per prompt (+ the negative one)
