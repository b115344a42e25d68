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


def save_tiny(out: str | Path, cls_name: str, seed: int, **config_kw):
    """A random tiny Llama of class `cls_name` (transformers) with the char tokenizer, saved to `out`."""
    import transformers

    from polyrl.models.tiny import build_char_tokenizer, tiny_config

    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok), hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate=64,
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
    model, tok = save_tiny(out, "LlamaForCausalLM", seed=seed, tie=True)
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
