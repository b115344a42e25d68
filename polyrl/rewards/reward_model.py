"""Discriminative reward model: a local `*ForSequenceClassification` directory that scores a (prompt, response) chat
on its last token.

Inputs, as verl's reward loop builds them: the policy's response is decoded to text, appended to the raw chat prompt
as the assistant turn, and the whole chat is re-rendered with the reward model's *own* chat template
(`add_generation_prompt=False`), so a reward model trained on another template scores text in the form it knows. The
score is the last label's logit at the last token (verl reads vLLM's `classify` output `probs[-1]` without an
activation: the same number).

Batching: sequences are sorted by length and cut into forwards of at most `max_tokens` padded tokens (and
`max_rows` rows), right-padded. Only the decoder runs on every position; the head reads one hidden state per row, at
its last real token, so padding never reaches a score and no `[tokens, labels]` logits are formed.

Placement: colocated, the weights sleep in pinned host memory between calls (`utils/offload.FrozenOffload`) and come
to the GPU for the forwards only. With several processes each rank scores its own rows and the model is FSDP2-sharded
like the reference policy (`parallelize_frozen`); every rank then runs the largest forward count of any rank (empty
ones as one-token padding passes) so that the per-block all-gathers pair up.
"""

from __future__ import annotations

import torch

from polyrl.errors import ConfigError


def check_classifier_dir(path: str | None, key: str, trust_remote_code: bool = False):
    """The HF config of a sequence-classifier directory; one sentence for a missing directory or another kind."""
    from transformers import AutoConfig

    from polyrl.models.loader import _check_dir

    p = _check_dir(path, key)
    config = AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(f"Reward model '{path}' ({key}) is {', '.join(archs) or 'a model without architectures'}, "
                          "not a *ForSequenceClassification model with a score head; point it at such a directory, "
                          "or set reward_model.judge.path to use a causal LM as a generative judge.")
    return config


def padded_forwards(lengths: list[int], max_tokens: int | None, max_rows: int) -> list[list[int]]:
    """Row indices of each forward: longest first, each forward's rows x its longest row <= `max_tokens` (a row
    longer than the budget goes alone) and at most `max_rows` rows; `max_tokens=None` cuts by rows only."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        g = groups[-1] if groups else None
        # sorted longest first: the group's first row is its longest, so its padded cost is rows x that length
        if g is not None and len(g) < max_rows and (max_tokens is None or (len(g) + 1) * lengths[g[0]] <= max_tokens):
            g.append(i)
        else:
            groups.append([i])
    return groups


class DiscriminativeRM:
    """Scores chats with a sequence-classification model; see the module docstring."""

    def __init__(self, model, tokenizer, *, device: torch.device, max_tokens: int | None, max_rows: int,
                 max_length: int | None = None, sleep: bool = True, dist=None, fsdp_config=None):
        """Around a loaded `*ForSequenceClassification` `model` (see `load`) and its `tokenizer`."""
        self.model, self.tokenizer = model.eval().requires_grad_(False), tokenizer
        self.body, self.head = model.base_model, model.score
        self.device, self.max_tokens, self.max_rows, self.max_length = device, max_tokens, max_rows, max_length
        self.dist = dist if dist is not None and dist.is_distributed else None
        self.offload = None
        if self.dist is not None:  # sharded like the reference policy; each rank keeps 1/N of the blocks
            from polyrl.distributed.parallelize import parallelize_frozen

            parallelize_frozen(model, dist.mesh, fsdp_config, device)
        elif sleep and device.type == "cuda":
            from polyrl.utils.offload import FrozenOffload

            self.offload = FrozenOffload(model)  # weights in pinned host memory until `score` runs
        else:
            model.to(device)

    @classmethod
    def load(cls, path: str, *, key: str, dtype: torch.dtype, trust_remote_code: bool = False,
             **kw) -> "DiscriminativeRM":
        """From a local directory (`key` names its config key in errors); `kw` as the constructor's."""
        from transformers import AutoModelForSequenceClassification

        from polyrl.models.loader import load_tokenizer

        config = check_classifier_dir(path, key, trust_remote_code)
        tokenizer = load_tokenizer(path, key=key, trust_remote_code=trust_remote_code)
        if not tokenizer.chat_template:
            raise ConfigError(f"Reward model '{path}' ({key}) has no chat template to render the prompt and response "
                              "with; add one (chat_template in its tokenizer_config.json).")
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True)
        if not isinstance(getattr(model, "score", None), torch.nn.Module):
            raise ConfigError(f"Reward model '{path}' ({key}) has no `score` head read at the last token (a decoder "
                              f"such as Llama or Qwen2 with a classification head); {type(model).__name__} is not one.")
        missing = [k for k in info["missing_keys"] if k.startswith("score.")]
        if missing:
            raise ConfigError(f"Reward model '{path}' ({key}) has no trained classification head (its weights lack "
                              f"{', '.join(missing)}); save the reward model itself, not its base causal LM.")
        return cls(model, tokenizer, **kw)

    def render(self, chat: list[dict], response: str) -> list[int]:
        text = self.tokenizer.apply_chat_template(list(chat) + [{"role": "assistant", "content": response}],
                                                  tokenize=False, add_generation_prompt=False)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes any BOS itself
        return ids[-self.max_length:] if self.max_length else ids  # keep the end: the score is read there

    def score(self, chats: list[list[dict]], responses: list[str]) -> list[float]:
        """One score per (chat prompt, response text)."""
        return self.score_ids([self.render(c, r) for c, r in zip(chats, responses)])

    @torch.no_grad()
    def score_ids(self, seqs: list[list[int]]) -> list[float]:
        """One score per token sequence in the reward model's vocabulary (already rendered)."""
        groups = padded_forwards([len(s) for s in seqs], self.max_tokens, self.max_rows)
        if self.dist is not None:  # FSDP2's all-gathers pair up only if every rank runs as many forwards
            most = int(self.dist.all_reduce(torch.tensor(len(groups), device=self.device), op="max"))
            groups += [[] for _ in range(most - len(groups))]
        out = torch.empty(len(seqs), dtype=torch.float32)
        if self.offload is not None:
            self.offload.load(self.device)
        try:
            for rows in groups:
                batch = [seqs[i] for i in rows] or [[0]]  # an empty group is a padding pass
                values = self._forward(batch)
                if rows:
                    out[rows] = values.cpu()
        finally:
            if self.offload is not None:
                self.offload.release()
        return out.tolist()

    def _forward(self, seqs: list[list[int]]) -> torch.Tensor:
        T = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), T, dtype=torch.long)
        mask = torch.zeros(len(seqs), T, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        h_BTD = self.body(input_ids=ids, attention_mask=mask).last_hidden_state
        last_B = mask.sum(1) - 1
        h_BD = h_BTD[torch.arange(len(seqs), device=self.device), last_B]
        return self.head(h_BD)[:, -1].float()
