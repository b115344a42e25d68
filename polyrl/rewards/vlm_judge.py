"""A VLM judge for image rewards (FlowGRPO): a local image-text-to-text model (Qwen2-VL and its kin) looks at each
image with the judge's prompt and answers; the judge file's parser turns the answer into the score, as for the text
judge (rewards/judge.py), behind the same keys (`reward.reward_model.judge.{path,template,parser,default_score}`).

The template's placeholders: {question} is the image's prompt, {response} is where the image goes (the image is the
policy's response), {reference} is the prompt's metadata `ground_truth` (empty when absent). The message is rendered
with the model's chat template as one user turn of text, image, text.

Engine: HF `generate`, `rollout.max_num_seqs` images per call, up to `rollout.response_length` new tokens, greedy
unless `rollout.do_sample`. polyrl's native engine decodes text-only models (it has no vision tower), so the text
judge's engine cannot serve here. The inputs are built from the directory's image processor and tokenizer, not its
`AutoProcessor`: each image-pad token is expanded to the image's merged patch count (grid t*h*w / merge_size^2), which
is all Qwen2-VL's processor adds, and the processor class cannot be built where torchvision is missing.

Placement: built where the image reward runs (the trainer, an async reward worker, or the reward pool's Ray actor:
rewards/async_scorer.py), loading the model on its first call, so a trainer whose scoring happens in a worker never
loads it. Colocated on a GPU with `rollout.free_cache_engine`, the weights wait in pinned host memory between calls.
An answer the parser cannot read scores `judge.default_score` and is counted (`reward/judge_parse_failures` where the
judge runs in the trainer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyrl.errors import ConfigError
from polyrl.rewards.config import JudgeConfig, RewardModelRolloutConfig
from polyrl.rewards.judge import Verdicts, fill, load_judge_file

IMAGE = "\x00image\x00"  # where the image goes while the template is filled (no template holds it)


@dataclass
class VLMJudgeSpec:
    """What builds a `VLMJudge` (picklable: it travels to reward workers)."""

    path: str
    key: str  # the model directory's config key, for errors
    judge: JudgeConfig
    rollout: RewardModelRolloutConfig


def user_turn(template: str, question: str, reference: str) -> list[dict]:
    """The chat content of the judge's message: text, the image, text."""
    before, _, after = fill(template, question, IMAGE, reference).partition(IMAGE)
    parts = [{"type": "text", "text": before}, {"type": "image"}, {"type": "text", "text": after}]
    return [p for p in parts if p.get("text", True)]


def to_pil(images: torch.Tensor) -> list:
    from PIL import Image

    from polyrl.rewards.image_rewards import to_uint8

    return [Image.fromarray(a) for a in to_uint8(images)]


class VLMJudge:
    """`fn(images, prompts, metadata) -> scores` with a VLM judge; see the module docstring."""

    def __init__(self, spec: VLMJudgeSpec, device: torch.device | None = None):
        from polyrl.models.loader import _check_dir

        _check_dir(spec.path, spec.key)
        self.model_config = _vlm_config(spec.path, spec.key)
        self.spec = spec
        template, parser = load_judge_file(spec.judge, spec.key.rsplit(".", 1)[0])
        self.template, self.verdicts = template, Verdicts(parser, spec.judge.default_score)
        self.device = device or _default_device()
        self.model = None  # loaded on the first call (module docstring)
        self.num_parse_failures = 0

    def load(self) -> None:
        from transformers import AutoImageProcessor, AutoModelForImageTextToText

        from polyrl.models.loader import load_tokenizer
        from polyrl.utils.device import to_dtype

        s = self.spec
        self.tokenizer = load_tokenizer(s.path, key=s.key)
        self.image_processor = AutoImageProcessor.from_pretrained(s.path)
        self.image_pad = self.tokenizer.convert_ids_to_tokens(self.model_config.image_token_id)
        key = "reward.reward_model.rollout.dtype"
        dtype = torch.float32 if self.device.type == "cpu" else to_dtype(s.rollout.dtype, key)
        model = AutoModelForImageTextToText.from_pretrained(s.path, dtype=dtype).eval().requires_grad_(False)
        self.offload = None
        if self.device.type == "cuda" and s.rollout.free_cache_engine:
            from polyrl.utils.offload import FrozenOffload

            self.offload = FrozenOffload(model)
        else:
            model.to(self.device)
        self.model = model

    def inputs(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        """The model's inputs for one batch: left-padded prompt ids with each image's pad tokens expanded (and marked
        as image tokens), and the image processor's pixel values and patch grids."""
        if self.model is None:
            self.load()
        pix = self.image_processor(images=to_pil(images), return_tensors="pt")
        merge = getattr(self.image_processor, "merge_size", 1) ** 2
        rows = []
        for grid, prompt, meta in zip(pix["image_grid_thw"], prompts, metadata):
            reference = (meta or {}).get("ground_truth")
            chat = [{"role": "user", "content": user_turn(self.template, prompt, "" if reference is None else
                                                          str(reference))}]
            text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            if text.count(self.image_pad) != 1:
                raise ConfigError(f"The chat template of '{self.spec.path}' ({self.spec.key}) rendered "
                                  f"{text.count(self.image_pad)} image tokens for one image; use the VLM's own "
                                  "template (it writes one image-pad token per image).")
            text = text.replace(self.image_pad, self.image_pad * (int(grid.prod()) // merge))
            rows.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        T = max(map(len, rows))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(rows), T), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, T - len(r):], mask[i, T - len(r):] = torch.tensor(r), 1
        mm_types = (ids == self.model_config.image_token_id).long()  # 1 at image tokens: what M-RoPE reads
        return {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": mm_types,
                "pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"]}

    @torch.no_grad()
    def answers(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> list[str]:
        r = self.spec.rollout
        if self.model is None:
            self.load()
        eos = self.tokenizer.eos_token_id
        sample = {"do_sample": True, "temperature": r.temperature, "top_p": r.top_p,
                  "top_k": r.top_k if r.top_k > 0 else None} if r.do_sample else {"do_sample": False}
        out = []
        if self.offload is not None:
            self.offload.load(self.device)
        try:
            for lo in range(0, len(prompts), r.max_num_seqs):
                hi = lo + r.max_num_seqs
                batch = {k: v.to(self.device) for k, v in self.inputs(images[lo:hi], prompts[lo:hi],
                                                                       metadata[lo:hi]).items()}
                batch["pixel_values"] = batch["pixel_values"].to(self.model.dtype)
                gen = self.model.generate(**batch, max_new_tokens=r.response_length, eos_token_id=eos,
                                          pad_token_id=self.tokenizer.pad_token_id, **sample)
                out += self.tokenizer.batch_decode(gen[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        finally:
            if self.offload is not None:
                self.offload.release()
        return out

    def __call__(self, images, prompts, metadata) -> list[float]:
        scores, failed = self.verdicts.read(self.answers(images, list(prompts), list(metadata)))
        self.num_parse_failures += sum(failed)
        return scores

    def pop_metrics(self) -> dict[str, float]:
        n, self.num_parse_failures = self.num_parse_failures, 0
        return {"reward/judge_parse_failures": float(n)}


def _default_device() -> torch.device:
    """The trainer's GPU in its process; in a reward worker a torchrun rank spawned, that rank's (LOCAL_RANK is
    inherited); in a Ray actor, the one GPU Ray left visible."""
    import os

    if not torch.cuda.is_available():
        return torch.device("cpu")
    if torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def _vlm_config(path: str, key: str):
    """The directory's HF config; one sentence when it is no image-text model with an image token."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "image_token_id", None) is None or getattr(config, "vision_config", None) is None:
        archs = ", ".join(getattr(config, "architectures", None) or []) or config.model_type
        raise ConfigError(f"'{path}' ({key}) is {archs}, not a vision-language model with an image token (such as "
                          "Qwen2-VL); point it at one.")
    return config


def judge_spec(pool) -> VLMJudgeSpec | None:
    """The VLM judge FlowGRPO's `reward.reward_model` block configures, or None; one sentence for a judge without
    its directory or judge file, and for judge keys set while it is off."""
    key = "reward.reward_model"
    if not pool.enable:
        changed = [n for n in ("model_path", "judge", "rollout") if getattr(pool, n) != getattr(type(pool)(), n)]
        if changed:
            raise ConfigError(f"{key}.{changed[0]} is set but {key}.enable=False; set enable=True to score with the "
                              "VLM judge, or remove it.")
        return None
    if not pool.model_path:
        raise ConfigError(f"{key}.enable=True needs {key}.model_path: a local VLM directory (such as Qwen2-VL).")
    if not pool.judge.path:
        raise ConfigError(f"{key}.enable=True scores images with a VLM judge, which needs {key}.judge.path (a file "
                          "with JUDGE_TEMPLATE and parse_score); image classifiers are custom rewards "
                          "(reward.custom_reward_function).")
    return VLMJudgeSpec(pool.model_path, f"{key}.model_path", pool.judge, pool.rollout)
