"""Tiny reward models trained locally in seconds, for the docs' runnable examples and the tests (no downloads).

Both score one property of a response: its digits. A random tiny policy on the character tokenizer writes ~10%
digits, so GRPO against either model has something to learn, and the property itself (not the model's own score)
shows whether it did.
- `train_digit_classifier`: a `LlamaForSequenceClassification` whose score is the response's digit fraction, trained
  on the very chats polyrl's discriminative reward model renders (`DiscriminativeRM.render`).
- `train_digit_judge`: a `LlamaForCausalLM` that answers "1" when the response holds a digit and "0" when not, after
  the judge prompt `JUDGE_FILE` defines; `JUDGE_FILE` is the judge file (template + parser) to pass as
  reward_model.judge.path.
"""

from __future__ import annotations

import random
import string
from pathlib import Path

import torch

JUDGE_TEMPLATE = "Q: {question} A: {response}"
JUDGE_FILE = f'''
JUDGE_TEMPLATE = "{JUDGE_TEMPLATE}"


def parse_score(answer):
    answer = answer.strip()
    return float(answer[0]) if answer[:1] in ("0", "1") else None
'''


def digit_fraction(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(1, len(text))


def random_response(rng: random.Random) -> str:
    """1-6 characters; each response its own digit rate, so every fraction from 0 to 1 is seen."""
    p = rng.random()
    return "".join(rng.choice(string.digits) if rng.random() < p else rng.choice(string.ascii_letters)
                   for _ in range(rng.randint(1, 6)))


def task_chats(n: int, seed: int) -> list[list[dict]]:
    """Chat prompts of the synthetic `reverse` task (the quickstart's)."""
    from polyrl.data.synthetic import make_rows

    return [r["prompt"] for r in make_rows("reverse", n, seed=seed, split="train")]


def save_tiny(out: str | Path, cls_name: str, seed: int, layers: int = 1, **config_kw):
    """A random tiny Llama of class `cls_name` (transformers) with the char tokenizer, saved to `out`."""
    import transformers

    from polyrl.models.tiny import build_char_tokenizer, tiny_config

    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok), hidden_size=32, layers=layers, heads=2, kv_heads=1, intermediate=64,
                      max_position_embeddings=256, **config_kw)
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok.pad_token_id, tok.eos_token_id, None
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model, tok


def padded(rows: list[list[int]], left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(map(len, rows))
    ids, mask = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(T - len(r), T) if left else slice(0, len(r))
        ids[i, span], mask[i, span] = torch.tensor(r), 1
    return ids, mask


def train_digit_classifier(out: str | Path, *, steps: int = 120, seed: int = 0) -> Path:
    """A sequence classifier scoring the digit fraction of the response (module docstring); returns `out`."""
    from polyrl.rewards.reward_model import DiscriminativeRM

    save_tiny(out, "LlamaForSequenceClassification", seed=seed, num_labels=1)
    rm = DiscriminativeRM.load(str(out), key="reward_model.model.path", device=torch.device("cpu"), dtype=torch.float32,
                          max_tokens=None, max_rows=64)
    rng = random.Random(seed)
    chats = task_chats(64, seed=seed + 3)
    resp = [random_response(rng) for _ in range(384)]
    ids, mask = padded([rm.render(rng.choice(chats), r) for r in resp])  # rendered once: jinja is the slow part
    target = torch.tensor([digit_fraction(r) for r in resp])
    last = mask.sum(1) - 1
    opt = torch.optim.Adam(rm.model.parameters(), lr=1e-2)
    rm.model.requires_grad_(True)
    for step in range(steps):
        rows = torch.randint(0, len(resp), (64,), generator=torch.Generator().manual_seed(step))
        h = rm.body(input_ids=ids[rows], attention_mask=mask[rows]).last_hidden_state
        loss = torch.nn.functional.mse_loss(rm.head(h[torch.arange(64), last[rows]])[:, -1], target[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
    rm.model.save_pretrained(out)
    return Path(out)


def train_digit_judge(out: str | Path, *, steps: int = 120, seed: int = 1) -> tuple[Path, Path]:
    """A causal LM judge answering 1/0 for digit/no digit, and its judge file beside it; returns (model, file)."""
    from polyrl.rewards.judge import fill, last_user_turn

    out = Path(out)
    # 2 layers: one layer reached 0.66-0.74 accuracy under transformers 5.25 (the GRPO test above it then rose 0.18,
    # not 0.2); two reach 1.0 on the training rows in the same 120 steps
    model, tok = save_tiny(out, "LlamaForCausalLM", seed=seed, tie=True, layers=2)
    judge_file = out.with_name(out.name + "_judge.py")
    judge_file.write_text(JUDGE_FILE)
    rng = random.Random(seed)
    chats = task_chats(64, seed=seed + 3)
    rows, targets = [], []
    for _ in range(384):
        r = random_response(rng)
        message = fill(JUDGE_TEMPLATE, last_user_turn(rng.choice(chats)), r, "")
        text = tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                       add_generation_prompt=True)
        rows.append(tok(text, add_special_tokens=False)["input_ids"])
        targets.append(tok.convert_tokens_to_ids("1" if any(c.isdigit() for c in r) else "0"))
    ids, mask = padded(rows, left=True)  # left-padded: every row's next-token position is the last column
    target = torch.tensor(targets)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        pick = torch.randint(0, len(rows), (64,), generator=torch.Generator().manual_seed(step))
        logits = model(input_ids=ids[pick], attention_mask=mask[pick]).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, target[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    return out, judge_file


# ------------------------------------------------------------------------------------------------ VLM judge (images)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}"
    "{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BRIGHTNESS_JUDGE_FILE = '''
JUDGE_TEMPLATE = "Is this {question} bright? {response} Say 1 or 0."


def parse_score(answer):
    answer = answer.strip()
    return float(answer[0]) if answer[:1] in ("0", "1") else None
'''


def save_tiny_vlm(out: str | Path, seed: int = 0):
    """A random tiny Qwen2-VL (one text and one vision block, 56x56 pixels = 4 image tokens) with the char tokenizer
    plus the vision tokens and a chat template that places images, and its image processor, saved to `out`."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from polyrl.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer(chat_template=VLM_CHAT_TEMPLATE, extra_special_tokens=VISION_TOKENS)
    start, end, pad = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=512, bos_token_id=None, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, vision_start_token_id=start, vision_end_token_id=end,
                        image_token_id=pad, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56).save_pretrained(out)
    return model, tok


def grey_images(brightness: torch.Tensor, size: int = 32, seed: int = 0) -> torch.Tensor:
    """[B, 3, size, size] images of the given mean brightness, with pixel noise."""
    noise = torch.rand(len(brightness), 3, size, size, generator=torch.Generator().manual_seed(seed)) - 0.5
    return (brightness.view(-1, 1, 1, 1) + 0.2 * noise).clamp(0, 1)


def train_brightness_judge(out: str | Path, *, steps: int = 60, seed: int = 2) -> tuple[Path, Path]:
    """A tiny Qwen2-VL judge answering 1 for bright images (mean > 0.5) and 0 for dark ones after the prompt of
    `BRIGHTNESS_JUDGE_FILE`, trained on the inputs polyrl's VLM judge builds (rewards/vlm_judge.py); returns (model
    directory, judge file)."""
    from polyrl.rewards.config import JudgeConfig, RewardModelRolloutConfig
    from polyrl.rewards.vlm_judge import VLMJudge, VLMJudgeSpec

    out = Path(out)
    save_tiny_vlm(out, seed=seed)
    judge_file = out.parent / f"{out.name}_judge.py"
    judge_file.write_text(BRIGHTNESS_JUDGE_FILE)
    spec = VLMJudgeSpec(str(out), "reward.reward_model.model_path", JudgeConfig(path=str(judge_file)),
                        RewardModelRolloutConfig())
    judge = VLMJudge(spec, device=torch.device("cpu"))
    judge.load()
    model, tok = judge.model, judge.tokenizer
    model.requires_grad_(True).train()
    one, zero = tok.convert_tokens_to_ids(["1", "0"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        b = torch.rand(16, generator=g)
        x = judge.inputs(grey_images(b, seed=step), ["square"] * 16, [{}] * 16)
        logits = model(**x).logits[:, -1]  # the answer's first token, after the generation prompt
        target = torch.where(b > 0.5, one, zero)
        loss = torch.nn.functional.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out)
    return out, judge_file
