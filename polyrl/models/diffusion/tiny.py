"""The quickstart's world: rendered digits, a tiny diffusers flow transformer, a prompt encoder and a reward classifier.

Everything is built locally in seconds and cached (no download, no scikit-learn):
- data: digits 0-9 rendered with Pillow's bundled font at random size, offset, rotation and stroke, 16x16 greyscale
  in [-1, 1]; "the digit 7" prompts them. Pixel space is the latent space (no VAE): 1 channel, packed 2x2 into 64
  tokens of 4 channels, exactly how Qwen-Image packs its VAE latents.
- model: a real `diffusers.QwenImageTransformer2DModel` (2 layers, 4 heads x 16), so the quickstart runs the same
  adapter code as the 20B model. Text conditioning comes from `CharPromptEncoder`, a frozen random character
  embedding (Qwen-Image's RoPE over text tokens supplies the positions).
- reward: `DigitClassifier`, a small CNN trained on the same renderer; the reward is its probability of the digit
  the prompt asked for, so it is "OCR-like" and in [0, 1].
- pretraining is deliberately short, leaving the reward far from saturated so RL has headroom.
"""

from __future__ import annotations

import math
import string
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

IMAGE_SIZE = 16
PATCH = 2
GRID = IMAGE_SIZE // PATCH  # 8x8 tokens
TEXT_DIM = 32


def prompt_for(digit: int) -> str:
    return f"the digit {digit}"


# --------------------------------------------------------------------------- data


def render_digits(num_per_class: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Randomly styled rendered digits: images [N, 1, 16, 16] in [-1, 1] and labels [N]."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    fonts = {size: ImageFont.load_default(size=size) for size in range(11, 17)}
    images, labels = [], []
    for digit in range(10):
        for _ in range(num_per_class):
            big = Image.new("L", (IMAGE_SIZE * 2, IMAGE_SIZE * 2), 0)  # draw large, rotate, crop: no clipped strokes
            draw = ImageDraw.Draw(big)
            cx, cy = IMAGE_SIZE + rng.uniform(-1.5, 1.5), IMAGE_SIZE + rng.uniform(-1.5, 1.5)
            draw.text((cx, cy), str(digit), fill=255, font=fonts[int(rng.integers(11, 17))], anchor="mm",
                      stroke_width=int(rng.integers(0, 2)), stroke_fill=255)  # fmt: skip
            big = big.rotate(rng.uniform(-12, 12), resample=Image.BILINEAR)
            q = IMAGE_SIZE // 2
            images.append(np.asarray(big.crop((q, q, q + IMAGE_SIZE, q + IMAGE_SIZE)), dtype=np.float32))
            labels.append(digit)
    x = torch.from_numpy(np.stack(images))[:, None] / 127.5 - 1.0
    return x, torch.tensor(labels)


def pack(images_BCHW: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C] tokens, Qwen-Image's 2x2 latent packing."""
    b, c, h, w = images_BCHW.shape
    x = images_BCHW.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack(tokens_BLC: torch.Tensor, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE) -> torch.Tensor:
    b, _, cp = tokens_BLC.shape
    c = cp // (PATCH * PATCH)
    x = tokens_BLC.view(b, height // PATCH, width // PATCH, c, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, height, width)


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """Model space [-1, 1] -> [0, 1] (the reward functions' image range)."""
    return ((images.float() + 1) / 2).clamp(0, 1)


# --------------------------------------------------------------------------- text and model


class CharPromptEncoder:
    """Frozen random character embeddings: prompt -> ([T, 32] embeddings, [T] mask). Deterministic in `seed`."""

    def __init__(self, seed: int = 0, dim: int = TEXT_DIM):
        self.vocab = {ch: i for i, ch in enumerate(string.printable)}
        self.table = torch.randn(len(self.vocab), dim, generator=torch.Generator().manual_seed(seed))

    def __call__(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [self.vocab.get(ch, 0) for ch in prompt] or [0]
        return self.table[ids].clone(), torch.ones(len(ids), dtype=torch.long)


def build_transformer(seed: int = 0):
    """The tiny `QwenImageTransformer2DModel` (about 60k parameters)."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(
        patch_size=PATCH, in_channels=4, out_channels=1, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=TEXT_DIM, axes_dims_rope=(4, 6, 6),
    )  # fmt: skip


class DigitClassifier(nn.Module):
    """A small CNN over 16x16 images in [0, 1]; its softmax is the quickstart's reward."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x01: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x01 * 2 - 1)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def train_classifier(images: torch.Tensor, labels: torch.Tensor, steps: int = 300, seed: int = 0) -> DigitClassifier:
    """Fit the reward classifier; light pixel noise makes it robust to the generator's imperfect samples."""
    torch.manual_seed(seed)
    clf = DigitClassifier()
    opt = torch.optim.Adam(clf.parameters(), lr=3e-3)
    x01 = to_unit(images)
    for _ in range(steps):
        idx = torch.randint(0, len(x01), (128,))
        xb = (x01[idx] + 0.15 * torch.randn_like(x01[idx])).clamp(0, 1)
        loss = F.cross_entropy(clf(xb), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return clf.eval()


def pretrain(transformer, encoder: CharPromptEncoder, images: torch.Tensor, labels: torch.Tensor, *, steps: int,
             batch_size: int = 64, lr: float = 2e-3, seed: int = 0, progress=None) -> list[float]:  # fmt: skip
    """Rectified-flow pretraining: x_s = (1 - s) x0 + s eps, regress v = eps - x0 (s logit-normal, as SD3)."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.stack([encoder(prompt_for(d))[0] for d in range(10)])  # [10, T, D]; all prompts have equal length
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 50) * 0.5 * (1 + math.cos(math.pi * i / steps)))
    transformer.train()
    losses = []
    for i in range(steps):
        idx = torch.randint(0, len(images), (batch_size,), generator=g)
        x0 = pack(images[idx])
        eps = torch.randn(x0.shape, generator=g)
        s = torch.sigmoid(torch.randn(batch_size, generator=g))
        xs = (1 - s[:, None, None]) * x0 + s[:, None, None] * eps
        text = embeds[labels[idx]]
        v = transformer(hidden_states=xs, encoder_hidden_states=text,
                        encoder_hidden_states_mask=torch.ones(text.shape[:2]), timestep=s,
                        img_shapes=[[(1, GRID, GRID)]] * batch_size, return_dict=False)[0]  # fmt: skip
        loss = F.mse_loss(v, eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss))
        if progress is not None:
            progress(i)
    transformer.eval()
    return losses


def cache_dir() -> Path:
    import os

    root = os.environ.get("POLYRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "polyrl")
    return Path(root) / "flow_quickstart"
