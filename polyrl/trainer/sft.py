"""Supervised fine-tuning: `polyrl sft` on parquet prompt/response pairs or `messages`, and the quickstart's warm-up.

Loss is token-mean cross-entropy over the loss-masked (assistant) tokens of each optimizer batch; micro-batches are
normalised by the batch's token count, so gradient accumulation does not change the update. The result is an HF
model directory (atomic: written to a temporary folder, then renamed).
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from polyrl.config import save_config, to_dict
from polyrl.data.sft import SFTSample, load_sft_dataset
from polyrl.models.config import ModelConfig
from polyrl.models.loader import load_policy, load_tokenizer
from polyrl.learner.actor import make_scheduler
from polyrl.utils.timing import StepTimer


@dataclass
class SFTDataConfig:
    train_files: str | list[str] | None = None
    """Parquet files with prompt/response columns or a messages column."""
    val_files: str | list[str] | None = None
    """Validation parquet files (loss only)."""
    prompt_key: str = "prompt"
    """Prompt column (string or chat list)."""
    response_key: str = "response"
    """Response column."""
    messages_key: str = "messages"
    """Multi-turn column; loss on assistant turns only."""
    max_length: int = 1024
    """Max tokens per sample."""
    truncation: str = "error"
    """error or right."""
    train_batch_size: int = 32
    """Samples per optimizer step."""
    micro_batch_size_per_gpu: int = 32
    """Samples per forward/backward."""


@dataclass
class SFTOptimConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    warmup_steps_ratio: float = 0.0
    """Warmup fraction of total steps."""
    lr_scheduler: str = "cosine"
    """constant or cosine."""
    clip_grad: float = 1.0
    """Gradient-norm clip."""


@dataclass
class SFTTrainerConfig:
    total_epochs: int = 1
    """Passes over the data."""
    total_training_steps: int | None = None
    """Stop after this many steps."""
    project_name: str = "polyrl-sft"
    """Project name."""
    experiment_name: str = "sft"
    """Experiment name."""
    logger: list[str] = field(default_factory=lambda: ["console", "file"])
    """Metric backends."""
    default_local_dir: str | None = None
    """Output folder; the HF model goes to <dir>/huggingface."""
    run_dir: str | None = None
    """Metrics and config folder."""
    seed: int = 1
    """Seed."""
    device: str = "auto"
    """auto, cpu or cuda."""
    progress_bar: bool = True
    """Show a progress bar."""


@dataclass
class SFTConfig:
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """Data."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model to fine-tune (partial_pretrain in verl's SFT trainer)."""
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    """Optimizer."""
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    """Loop."""


def collate(samples: list[SFTSample], pad_id: int, device) -> dict[str, torch.Tensor]:
    L = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), L), dtype=torch.long)
    loss = torch.zeros((len(samples), L), dtype=torch.float)
    for i, s in enumerate(samples):  # right padding: positions are plain aranges
        ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
        attn[i, : len(s.input_ids)] = 1
        loss[i, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float)
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device), "loss_mask": loss.to(device)}


def sft_loss_sum(model, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token NLL over loss-masked targets, and the number of such targets."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = mb["input_ids"][:, 1:]
    mask = mb["loss_mask"][:, 1:]
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return (nll * mask).sum(), mask.sum()


def length_groups(batch: list[SFTSample], micro_batch_size: int, row_cost: int = 256) -> list[list[SFTSample]]:
    """The batch sorted by length and cut into micro-batches where the padding a cut saves is worth another
    forward/backward (`row_cost` padded tokens): the same update as one padded batch, fewer padded tokens. A batch
    that mixes 35- and 107-token samples (the tools quickstart's) runs in half the tokens."""
    rows = sorted(batch, key=lambda s: len(s.input_ids))
    lens = [len(s.input_ids) for s in rows]
    best = [0] + [None] * len(rows)  # best[j]: the cheapest cut of rows[:j]; cost = padded tokens + row_cost a cut
    cut = [0] * (len(rows) + 1)
    for j in range(1, len(rows) + 1):
        for i in range(max(0, j - micro_batch_size), j):
            cost = best[i] + (j - i) * lens[j - 1] + row_cost
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(rows)
    while j:
        groups.append(rows[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def train_sft(model, samples: list[SFTSample], *, pad_id: int, batch_size: int, micro_batch_size: int,
              lr: float, steps: int, device, weight_decay: float = 0.01, betas=(0.9, 0.95), clip_grad: float = 1.0,
              warmup_steps: int = 0, scheduler: str = "cosine", seed: int = 1, log=None, progress=None,
              by_length: bool = False) -> list[float]:
    """Plain SFT loop; returns the per-step losses. `log(metrics, step)` and `progress.update(1)` are optional.
    `by_length`: micro-batches from `length_groups` (the same update up to float rounding; less padding)."""
    rng = random.Random(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    sched = make_scheduler(opt, total_steps=steps, warmup_steps=warmup_steps, kind=scheduler, min_lr_ratio=0.0,
                           num_cycles=0.5)
    timer = StepTimer()
    order: list[int] = []
    losses = []
    model.train()
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            perm = list(range(len(samples)))
            rng.shuffle(perm)
            order += perm
        idx, order = order[:batch_size], order[batch_size:]
        batch = [samples[i] for i in idx]
        with timer.stage("update"):
            opt.zero_grad(set_to_none=True)
            num_tokens = sum(sum(s.loss_mask[1:]) for s in batch) or 1
            total = 0.0
            micro = (length_groups(batch, micro_batch_size) if by_length else
                     [batch[i:i + micro_batch_size] for i in range(0, len(batch), micro_batch_size)])
            for group in micro:
                mb = collate(group, pad_id, device)
                loss_sum, _ = sft_loss_sum(model, mb)
                (loss_sum / num_tokens).backward()
                total += float(loss_sum.detach())
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_grad)
            if torch.isfinite(grad_norm):
                opt.step()
            sched.step()
        losses.append(total / num_tokens)
        if log is not None:
            log({"train/loss": losses[-1], "train/lr": sched.get_last_lr()[0], "train/grad_norm": float(grad_norm),
                 **timer.pop()}, step)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def save_hf_atomic(model, tokenizer, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def run_sft(cfg: SFTConfig) -> Path:
    """`polyrl sft`: load, fine-tune, and write an HF model directory; returns its path."""
    from polyrl.utils.device import pick_device
    from polyrl.utils.tracking import Tracker

    from polyrl.trainer.key_checks import refuse_unread

    refuse_unread(cfg, "sft")
    t = cfg.trainer
    device = pick_device(t.device)
    torch.manual_seed(t.seed)
    t.run_dir = t.run_dir or f"runs/{t.project_name}/{t.experiment_name}"
    t.default_local_dir = t.default_local_dir or f"checkpoints/{t.project_name}/{t.experiment_name}"
    tok = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path,
                         custom_chat_template=cfg.model.custom_chat_template)
    samples = load_sft_dataset(cfg.data.train_files, tok, prompt_key=cfg.data.prompt_key,
                               response_key=cfg.data.response_key, messages_key=cfg.data.messages_key,
                               max_length=cfg.data.max_length, truncation=cfg.data.truncation)
    model = load_policy(cfg.model, device=device, key="model.path")
    steps = t.total_training_steps or max(1, t.total_epochs * len(samples) // cfg.data.train_batch_size)
    Path(t.run_dir).mkdir(parents=True, exist_ok=True)
    save_config(cfg, Path(t.run_dir) / "config.yaml")
    tracker = Tracker(t.logger, t.run_dir, project_name=t.project_name, experiment_name=t.experiment_name,
                      config=to_dict(cfg))
    from polyrl.utils.console import progress_bar

    bar = progress_bar(steps, desc="polyrl sft", enabled=t.progress_bar)  # a terminal only
    try:
        train_sft(model, samples, pad_id=tok.pad_token_id, batch_size=cfg.data.train_batch_size,
                  micro_batch_size=cfg.data.micro_batch_size_per_gpu, lr=cfg.optim.lr,
                  weight_decay=cfg.optim.weight_decay, betas=cfg.optim.betas, clip_grad=cfg.optim.clip_grad,
                  warmup_steps=int(cfg.optim.warmup_steps_ratio * steps), scheduler=cfg.optim.lr_scheduler,
                  steps=steps, device=device, seed=t.seed, log=tracker.log, progress=bar)
    finally:
        if bar is not None:
            bar.close()
        tracker.close()
    from peft import PeftModel

    if isinstance(model, PeftModel):
        model = model.merge_and_unload()
    return save_hf_atomic(model, tok, Path(t.default_local_dir) / "huggingface")
