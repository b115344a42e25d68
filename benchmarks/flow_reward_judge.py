"""A VLM-judge-sized reward for the FlowGRPO benchmark: the cost of VeRL-Omni's GenRM-OCR, the OCR score as the value.

VeRL-Omni scores OCR with a vision-language model (Qwen3-VL-8B served by vLLM) that reads each image and writes its
text. This stand-in does that work with random weights: Qwen2.5-VL-7B's shape (the 32-block vision tower on the
image at 504^2, 324 merged image tokens, then the 7B language model over image + prompt tokens and 16 greedy
decode tokens, transformers' `generate`). Random weights read nothing, so the returned score is rapidocr's
(`polyrl.rewards.image_rewards`) on the same images: the judge is there for its GPU time, not its answer.

Built inside the async reward worker (a spawned process) on the GPU named by `--judge-gpu`, or in the trainer
process for the sync comparison (docs/engineering/NOTES_flow.md).
"""

from __future__ import annotations

import torch

SIDE, PATCH, MERGE, PROMPT_TOKENS, NEW_TOKENS = 504, 14, 2, 64, 16


def _model(device: str, tiny: bool):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if tiny:
        text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]})  # fmt: skip
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, fullatt_block_indexes=[0])
    else:  # Qwen2.5-VL-7B
        text = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=128000,
                    rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})  # fmt: skip
        vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                      fullatt_block_indexes=[7, 15, 23, 31])  # fmt: skip
    vision.update(patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, window_size=112,
                  out_hidden_size=text["hidden_size"])  # fmt: skip
    text["vocab_size"] = 152064
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, vocab_size=152064, hidden_size=text["hidden_size"])
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    torch.set_default_dtype(prev)
    model.generation_config.pad_token_id = 0
    return model, cfg, dtype


class JudgeReward:
    """fn(images, prompts, metadata) -> OCR scores, after a VLM-judge-sized forward + decode on `device`."""

    def __init__(self, device: str, tiny: bool = False):
        from polyrl.rewards.image_rewards import OCRReward

        self.device = device
        self.model, self.cfg, self.dtype = _model(device, tiny)
        self.ocr = OCRReward()

    def inputs(self, images_BCHW: torch.Tensor) -> dict:
        """Qwen2.5-VL's input layout for B images at SIDE^2: flattened 2x14x14 patches, the grid, and ids with the
        vision-start token, one image token per merged patch, then random prompt ids."""
        B = images_BCHW.shape[0]
        grid = SIDE // PATCH
        x = torch.nn.functional.interpolate(images_BCHW.float(), size=(SIDE, SIDE), mode="bilinear")
        x = x.unfold(2, PATCH, PATCH).unfold(3, PATCH, PATCH)  # B, C, g, g, P, P
        x = x.permute(0, 2, 3, 1, 4, 5).reshape(B * grid * grid, 3, 1, PATCH, PATCH).expand(-1, -1, 2, -1, -1)
        pixel_values = x.reshape(B * grid * grid, -1).to(self.device, self.dtype)
        num_image = grid * grid // MERGE**2
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(1000, 100000, (B, PROMPT_TOKENS), generator=g)
        ids = torch.cat([torch.full((B, 1), self.cfg.vision_start_token_id),
                         torch.full((B, num_image), self.cfg.image_token_id),
                         torch.full((B, 1), self.cfg.vision_end_token_id), prompt], dim=1)  # fmt: skip
        return {"input_ids": ids.to(self.device), "attention_mask": torch.ones_like(ids).to(self.device),
                "pixel_values": pixel_values,
                "image_grid_thw": torch.tensor([[1, grid, grid]] * B, device=self.device)}  # fmt: skip

    @torch.no_grad()
    def __call__(self, images, prompts, metadata):
        out = self.model.generate(**self.inputs(images), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False)  # fmt: skip
        assert out.shape[1] >= NEW_TOKENS
        return self.ocr(images, prompts, metadata)


def judge_reward(device: str, tiny: bool = False) -> JudgeReward:
    """Picklable factory for the async reward worker."""
    return JudgeReward(device, tiny)
