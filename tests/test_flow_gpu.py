"""FlowGRPO pieces that only a GPU exercises: compiled transformer blocks (inductor, bf16) against eager."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _policy(head_dim: int, heads: int, text_dim: int, rope: tuple[int, int, int], targets: list[str]):
    """A 2-block random Qwen-Image transformer (bf16, CUDA) with LoRA r8 as a CFG FlowPolicy over random embeddings."""
    from diffusers import QwenImageTransformer2DModel

    from polyrl.models.diffusion.pipeline import FlowPolicy, LatentShape

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = QwenImageTransformer2DModel(num_layers=2, attention_head_dim=head_dim, num_attention_heads=heads,
                                            joint_attention_dim=text_dim, axes_dims_rope=rope).to(torch.bfloat16)
    table = {p: (torch.randn(12, text_dim) * 0.5, torch.ones(12, dtype=torch.long)) for p in ["a", "b", " "]}
    policy = FlowPolicy(model, encode_fn=lambda ps: [table[p] for p in ps], decode_fn=lambda z: z,
                        sigmas_fn=lambda n: torch.linspace(1, 0, n + 1), latent=LatentShape(8, 8, 64),
                        true_cfg_scale=4.0, device="cuda")  # fmt: skip
    policy.add_lora(8, 16, targets)
    return policy


def test_compiled_blocks_match_eager_with_and_without_grad():
    policy = _policy(64, 4, 64, (16, 24, 24), ["to_q", "to_k", "to_v"])
    x = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16)
    sigma = torch.full((4,), 0.7, device="cuda")
    prompts = ["a", "b", "a", "b"]
    with torch.no_grad():
        ref = policy.velocity(x, sigma, prompts)
    ref_grad = policy.velocity(x.requires_grad_(), sigma, prompts)
    ref_grad.square().mean().backward()
    g_ref = [p.grad.clone() for p in policy.trainable_parameters()]
    for p in policy.trainable_parameters():
        p.grad = None
    policy.compile_blocks()
    with torch.no_grad():
        for _ in range(2):  # the second call reuses the static graph
            out = policy.velocity(x, sigma, prompts)
    out_grad = policy.velocity(x, sigma, prompts)
    out_grad.square().mean().backward()
    g_out = [p.grad for p in policy.trainable_parameters()]
    scale = ref.abs().mean()
    assert (out - ref).abs().mean() < 2e-2 * scale  # bf16: fused kernels round differently, nothing more
    assert (out_grad.detach() - ref_grad.detach()).abs().mean() < 2e-2 * scale
    for a, b in zip(g_out, g_ref):
        assert (a - b).norm() <= 5e-2 * b.norm() + 1e-8


def test_compiled_fp8_sampling_with_merged_lora_matches_eager():
    """FP8 on the ODE steps as the trainer runs it: LoRA merged into the e4m3 copies, blocks compiled (the input
    quantised by inductor-fused tensor ops, `_scaled_mm`), against the eager FP8 path (the Triton quantiser) and
    within e4m3's error of bf16; released copies come back the same."""
    from polyrl.rollout.fp8_dit import FP8Sampling

    # 1024-wide linears: gemm_pays() puts them on the FP8 path
    policy = _policy(128, 8, 1024, (16, 56, 56), ["to_q", "to_k", "to_v", "img_mlp.net.0.proj"])
    model = policy.transformer
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
            if "lora_" in name:
                p.data = p.data.to(torch.bfloat16)
    fp8 = FP8Sampling(model, merge_lora=True)
    assert fp8.merged > 0
    x = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16)
    sigma, prompts = torch.full((4,), 0.7, device="cuda"), ["a", "b", "a", "b"]
    with torch.no_grad():
        bf16 = policy.velocity(x, sigma, prompts)
        with fp8.sampling():
            eager = policy.velocity(x, sigma, prompts)
        policy.compile_blocks()
        with fp8.sampling():
            for _ in range(2):
                compiled = policy.velocity(x, sigma, prompts)
        fp8.release()
        with fp8.sampling():
            again = policy.velocity(x, sigma, prompts)
    scale = bf16.abs().mean()
    assert (eager - bf16).abs().mean() > 1e-4 * scale  # e4m3 GEMMs ran
    assert (eager - bf16).abs().mean() < 0.1 * scale
    assert (compiled - eager).abs().mean() < 2e-2 * scale  # same quantisation, other kernels
    torch.testing.assert_close(again, compiled)
