"""The policy training engine: log-probs, the PPO update, and weights for the rollout engine.

It owns the model, optimizer and LR schedule; the loss math comes from `polyrl.algorithms` (pure functions). Loss
normalisers are computed per *mini-batch* and passed down to every micro-batch, so gradient accumulation gives the
same update whatever the micro-batch size (tested: 1x8 == 8x1).
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from polyrl.algorithms import agg_loss, kl_penalty, policy_loss
from polyrl.algorithms.rollout_correction import RolloutCorrectionConfig, rollout_correction_tensors
from polyrl.algorithms.losses import LossKnobs
from polyrl.errors import ConfigError
from polyrl.distributed.grads import clip_grad_norm_
from polyrl.distributed.ulysses import check_heads, gather_predictions, shard_packed
from polyrl.learner.batch import Batch, select, split_rows, trim_columns
from polyrl.learner.dynamic_batch import balanced_micro_batches, shared_prompt_items
from polyrl.learner.flops import peak_flops, training_flops
from polyrl.learner.fused_head import fused_logprobs, fused_logprobs_grad_in_forward
from polyrl.learner.logprobs import chunked_logprobs
from polyrl.models.moe import MoERouting, find_routers, grouped_experts
from polyrl.learner.packing import attention_kwargs, pack, packed_attention, prompt_groups, trunk_work, unpack
from polyrl.utils.device import DTYPES
from polyrl.utils.oom_hook import oom_point



@dataclass
class ForwardSettings:
    """How the policy forward runs (verl: model.use_remove_padding, actor.fsdp_config.dtype, ...)."""

    use_remove_padding: bool = True  # pack rows into one padding-free row with varlen attention (packing.py)
    compute_dtype: str = "bfloat16"  # autocast dtype on CUDA over fp32 master weights; CPU computes in fp32
    logprob_chunk_size: int = 2048  # LM-head rows per chunk (logprobs.py); never materialises [tokens, vocab] fp32
    chunk_checkpointing: bool = True  # recompute each chunk's logits in backward instead of saving them
    fused_head: bool = True  # hand-written LM-head backward, one fused pass per chunk (fused_head.py); False: autograd
    head_grad_in_forward: bool = True  # with fused_head, when the loss gradient per log-prob is known up front (the
    # on-policy single pass of vanilla/gspo/gpg without a KL loss), the head does its backward in the forward: one
    # logits GEMM per chunk instead of two (Actor.update; loss_coefficients)
    activation_offload: bool = False  # keep saved activations in (pinned, on CUDA) CPU memory: torch save_on_cpu
    compile_layers: bool = False  # torch.compile each decoder layer (dynamic shapes); +26% tok/s on H200, see NOTES
    pack_on_cpu: bool = False  # CPU has no varlen kernel (an O(N^2) block mask instead): padded is faster; tests pack
    share_prompts: bool = True  # packed rows with the same prompt carry it once (shared_prefix.py); exact
    sp: Any = None  # Ulysses group (distributed/ulysses.SeqParallel), set by Actor from its DistEnv; None: whole rows
    routing: Any = None  # MoE router hooks (models/moe.MoERouting), set by Actor for an MoE model; None: dense
    replay_routes: bool = False  # MoE: a batch's `routed_experts` replace the router's top-k (router_replay.mode R2/R3);
    # False: they are only compared with the trainer's own routes (actor/router_agreement)

    def __post_init__(self):
        if self.compute_dtype not in DTYPES:
            raise ValueError(f"compute dtype {self.compute_dtype!r} is unknown; set actor.fsdp_config.dtype to "
                             "bfloat16, float16 or float32.")

    @classmethod
    def from_config(cls, model_cfg, actor_cfg) -> "ForwardSettings":
        """From `actor_rollout_ref.model` and `.actor`; chunked, checkpointed log-probs are always on (exact)."""
        return cls(use_remove_padding=model_cfg.use_remove_padding, compute_dtype=actor_cfg.fsdp_config.dtype,
                   activation_offload=model_cfg.enable_activation_offload, share_prompts=model_cfg.use_shared_prompt,
                   compile_layers=actor_cfg.use_torch_compile or actor_cfg.fsdp_config.use_torch_compile,
                   replay_routes=actor_cfg.router_replay.mode != "disabled")


def _packs(fwd: ForwardSettings, device: torch.device) -> bool:
    """Packed forward? Always under Ulysses (it splits the packed row); on CPU only when asked (O(N^2) mask)."""
    return fwd.use_remove_padding and (device.type == "cuda" or fwd.pack_on_cpu or fwd.sp is not None)


def _shares(fwd: ForwardSettings, device: torch.device) -> bool:
    """Shared prompts in packed rows? Not under Ulysses (the shared layout is not split over ranks)."""
    return fwd.share_prompts and fwd.sp is None and _packs(fwd, device)


def _autocast(fwd: ForwardSettings, device: torch.device):
    dtype = DTYPES[fwd.compute_dtype]
    if device.type != "cuda" or dtype == torch.float32:
        return nullcontext()
    return torch.autocast("cuda", dtype=dtype)


def _trunk_and_head(model):
    """The decoder stack and LM head of an HF causal LM (through a peft wrapper if any)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def _head_logprobs(head, hidden_MD, targets_M, temperature, with_entropy, fwd, coefs_M=None):
    if coefs_M is not None:  # (logp, ent, anchor): the head's backward already done (fused_head.py)
        return fused_logprobs_grad_in_forward(hidden_MD, head.weight, targets_M, *coefs_M, bias_V=head.bias,
                                              temperature=temperature, with_entropy=with_entropy,
                                              chunk_size=fwd.logprob_chunk_size)
    if fwd.fused_head:
        return fused_logprobs(hidden_MD, head.weight, targets_M, bias_V=head.bias, temperature=temperature,
                              with_entropy=with_entropy, chunk_size=fwd.logprob_chunk_size)
    return chunked_logprobs(hidden_MD, head.weight, targets_M, bias_V=head.bias, temperature=temperature,
                            with_entropy=with_entropy, chunk_size=fwd.logprob_chunk_size,
                            checkpoint=fwd.chunk_checkpointing)


def logprobs_and_entropy(model, mb: Batch, temperature: float, with_entropy: bool,
                         fwd: ForwardSettings | None = None, grad_coefs=None):
    """Response log-probs (and entropy) [B, T] of one micro-batch; zeros at padding. fp32 results.

    `grad_coefs` = (dL/dlogp, dL/dentropy or None) as [B, T] tensors known before the forward (`loss_coefficients`):
    the LM head then runs its backward during the forward, log-probs and entropy come back without gradient, and a
    third value, a zero scalar, carries the whole loss gradient: call `.backward()` on it.

    Packed (default): one padding-free row through varlen attention. Padded: the `[B, P+T]` rows with their mask.
    Either way logits exist only at response positions, one chunk at a time. Under Ulysses (`fwd.sp`) this rank
    runs its 1/sp of the packed row and the LM head on the predictions it holds; every rank of the SP group returns
    the whole micro-batch's values (gradients flow back only to the rank that computed each one: ulysses.py).
    """
    oom_point()  # test hook: POLYRL_INJECT_OOM can fail this forward (utils/oom_hook.py)
    fwd = fwd or ForwardSettings()
    temperature = 1.0 if temperature in (0.0, 1.0) else temperature
    trunk, head = _trunk_and_head(model)
    shape = tuple(mb["responses"].shape)
    with _autocast(fwd, mb["input_ids"].device):
        if _packs(fwd, mb["input_ids"].device):
            packed = pack(mb, share_prompts=_shares(fwd, mb["input_ids"].device))
            local, bounds = shard_packed(packed, fwd.sp) if fwd.sp is not None else (packed, None)
            if fwd.routing is not None and fwd.routing.planned:
                assert fwd.sp is None or packed.routes is None, "routing replay runs without sequence parallelism"
                fwd.routing.begin(packed.routes)
            with packed_attention(model):
                out = trunk(input_ids=local.input_ids, position_ids=local.position_ids, use_cache=False,
                            **attention_kwargs(local, fwd.sp))
            hidden = out.last_hidden_state[0, local.pred_index]
            if grad_coefs is not None:
                assert fwd.sp is None, "the gradient-in-forward head runs without sequence parallelism"
                coefs = [c[packed.rows, packed.cols] if c is not None else None for c in grad_coefs]
                logp, ent, anchor = _head_logprobs(head, hidden, packed.targets, temperature, with_entropy, fwd,
                                                   coefs)
                return unpack(logp, packed, shape), (unpack(ent, packed, shape) if with_entropy else None), anchor
            logp, ent = _head_logprobs(head, hidden, local.targets, temperature, with_entropy, fwd)
            if fwd.sp is not None:
                # no prediction on this rank: an empty LM-head product keeps it in backward (ulysses.py)
                anchor = torch.nn.functional.linear(hidden, head.weight, head.bias).sum(-1) if not len(hidden) \
                    else None
                logp = gather_predictions(logp, bounds, fwd.sp, anchor)
                ent = gather_predictions(ent, bounds, fwd.sp, anchor) if with_entropy else None
            return unpack(logp, packed, shape), (unpack(ent, packed, shape) if with_entropy else None)
        assert fwd.sp is None, "Ulysses sequence parallelism needs the packed forward (use_remove_padding=True)"
        T = shape[1]
        if fwd.routing is not None and fwd.routing.planned:
            routes = mb.get("routed_experts")
            fwd.routing.begin(None if routes is None else routes.flatten(0, 1), token_mask=mb["attention_mask"])
        out = trunk(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                    position_ids=mb["position_ids"], use_cache=False)
        rows, cols = mb["attention_mask"][:, -T:].bool().nonzero(as_tuple=True)
        hidden = out.last_hidden_state[:, -T - 1:-1][rows, cols]
        coefs = [c[rows, cols] if c is not None else None for c in grad_coefs] if grad_coefs is not None else None
        logp, ent, *anchor = _head_logprobs(head, hidden, mb["responses"][rows, cols], temperature, with_entropy, fwd,
                                            coefs)
        zeros = logp.new_zeros(shape)
        return (zeros.index_put((rows, cols), logp), (zeros.index_put((rows, cols), ent) if with_entropy else None),
                *anchor)


def compile_decoder_layers(model) -> None:
    """`torch.compile` each decoder layer in place (state-dict names unchanged, so weight sync is unaffected).

    Per layer rather than the whole model: identical layers share one compiled graph, and the varlen attention and
    the chunked LM head stay outside it. Dynamic shapes, because every packed micro-batch has a different length.
    """
    trunk, _ = _trunk_and_head(model)
    for layer in trunk.layers:
        layer.compile(dynamic=True)


def micro_batches(batch: Batch, micro_batch_size: int, max_token_len: int | None, dp=None,
                  share_prompts: bool = False) -> list:
    """Row groups of a (mini-)batch: fixed `micro_batch_size` rows, or balanced under a token budget.

    With a token budget and several processes (`dp`), every rank takes the largest micro-batch count of any rank
    (FSDP2's per-forward collectives must pair up); a rank may then get empty groups, run as padding passes.
    With `share_prompts` the rows of one prompt stay together and their prompt is counted once (packing.py)."""
    num_rows = batch["responses"].shape[0]
    if not max_token_len:
        return list(split_rows(num_rows, micro_batch_size))
    am = batch["attention_mask"]
    T = batch["responses"].shape[1]
    prompt_lens, resp_lens = am[:, :-T].sum(1).tolist(), am[:, -T:].sum(1).tolist()
    if share_prompts and num_rows:
        items, costs = shared_prompt_items(prompt_groups(batch).tolist(), prompt_lens, resp_lens, max_token_len)
    else:
        items, costs = [[i] for i in range(num_rows)], [p + r for p, r in zip(prompt_lens, resp_lens)]
    device = batch["responses"].device
    groups = balanced_micro_batches(costs, max_token_len)
    if dp is not None and dp.world_size > 1:
        count = int(dp.all_reduce(torch.tensor(len(groups), device=device), op="max"))
        if count > len(groups):
            groups = balanced_micro_batches(costs, max_token_len, min_groups=count)
    return [torch.tensor(sorted(r for i in g for r in items[i]), device=device, dtype=torch.long) for g in groups]


def _padding_pass(rows: torch.Tensor) -> tuple[torch.Tensor, float]:
    """An empty micro-batch becomes row 0 with loss weight 0: same collectives as the other ranks, no gradient."""
    if isinstance(rows, slice) or len(rows):  # fixed-size micro-batches are slices and never empty
        return rows, 1.0
    return torch.zeros(1, dtype=torch.long, device=rows.device), 0.0


def _micro_coef(coef_BT: torch.Tensor, rows, num_cols: int, w: float) -> torch.Tensor:
    """A micro-batch's rows of a mini-batch's loss coefficients, trimmed as `trim_columns` trimmed its responses;
    a padding pass (w = 0) gets zeros."""
    out = coef_BT[rows, :num_cols]
    return out if w == 1.0 else out * w


def _flops(model, mb: Batch, share_prompts: bool) -> float:
    seqlens, attn_pairs = trunk_work(mb, share_prompts)
    head_tokens = int(mb["attention_mask"][:, -mb["responses"].shape[1]:].sum())
    return training_flops(model.config, seqlens, lm_head_tokens=head_tokens, attn_pairs=attn_pairs)


# losses whose gradient w.r.t. log pi is the same at every point where old = log pi (the ratio is exactly 1)
_VALUE_FREE_GRAD_LOSSES = ("vanilla", "gspo", "gpg")


def loss_coefficients(s: "UpdateSettings", mb: Batch, num_tokens, num_seqs, scale: float):
    """(dL/dlogp, dL/dentropy or None) [B, T] of the on-policy single pass, before any forward.

    With old log-probs equal to the current ones the ratio is exactly 1 wherever the log-probs are, so for the losses
    in `_VALUE_FREE_GRAD_LOSSES` the gradient does not depend on their values: autograd through the very same loss
    functions at a stand-in point (zeros) gives it exactly, for every aggregation mode and the entropy bonus."""
    mask = mb["response_mask"]
    x = torch.zeros_like(mask, dtype=torch.float32, requires_grad=True)
    with torch.enable_grad():
        loss, _ = policy_loss(s.loss_mode, old_log_prob_BT=x.detach(), log_prob_BT=x, advantages_BT=mb["advantages"],
                              response_mask_BT=mask, loss_agg_mode=s.loss_agg_mode, cfg=s.knobs, num_tokens=num_tokens,
                              num_seqs=num_seqs)
        inputs = [x]
        if s.entropy_coeff != 0:
            e = torch.zeros_like(x, requires_grad=True)
            loss = loss - s.entropy_coeff * agg_loss(e, mask, s.loss_agg_mode, num_tokens=num_tokens,
                                                     num_seqs=num_seqs, loss_scale_factor=s.knobs.loss_scale_factor)
            inputs.append(e)
        grads = torch.autograd.grad(loss * scale, inputs)
    return grads[0], (grads[1] if len(grads) > 1 else None)


@torch.no_grad()
def compute_logprobs(model, batch: Batch, *, temperature: float, micro_batch_size: int,
                     max_token_len: int | None = None, fwd: ForwardSettings | None = None, dp=None,
                     record_routes: bool = False):
    """Per-token log-probs of the responses, [B, T], in micro-batches of `micro_batch_size` rows (or by token
    budget `max_token_len`: verl's log_prob_use_dynamic_bsz; `dp`: the job's DistEnv, see `micro_batches`).

    MoE (`fwd.routing`): a batch's `routed_experts` are replayed (or compared, see ForwardSettings.replay_routes);
    `record_routes` also returns the routes this pass chose, `[B, P+T, num_moe_layers, top_k]` int16 in the batch's
    layout (-1 at padding): router_replay.mode=R2 replays them in the update. Recording packs without shared prompts
    (each row's own prompt positions get routes)."""
    fwd = fwd or ForwardSettings()
    routing = fwd.routing
    assert routing is not None or not record_routes, "record_routes needs an MoE model"
    if record_routes:
        fwd = dataclasses.replace(fwd, share_prompts=False)
    was_training = model.training
    model.eval()
    B, T = batch["responses"].shape
    L = batch["input_ids"].shape[1]
    out = torch.zeros((B, T), device=batch["responses"].device)
    routes = None
    if record_routes:
        routes = torch.full((B, L, routing.num_layers, routing.top_k), -1, dtype=torch.int16,
                            device=batch["responses"].device)
    plan = routing.plan(replay=fwd.replay_routes, record=record_routes) if routing is not None else nullcontext()
    with plan:
        for rows in micro_batches(batch, micro_batch_size, max_token_len, dp, _shares(fwd, batch["input_ids"].device)):
            rows, weight = _padding_pass(rows)
            mb = trim_columns(select(batch, rows))
            logp, _ = logprobs_and_entropy(model, mb, temperature, with_entropy=False, fwd=fwd)
            if weight:
                out[rows, : logp.shape[1]] = logp
                if record_routes:
                    Lm, Tm = mb["input_ids"].shape[1], mb["responses"].shape[1]
                    start = (L - T) - (Lm - Tm)  # trim_columns dropped this many leading (prompt padding) columns
                    routes[rows, start:start + Lm] = _routes_in_batch_layout(routing.take_recorded(), mb,
                                                                             _packs(fwd, mb["input_ids"].device))
    model.train(was_training)
    return (out, routes) if record_routes else out


def _routes_in_batch_layout(recorded_NLK: torch.Tensor, mb: Batch, packed: bool) -> torch.Tensor:
    """A forward's recorded routes back in its micro-batch's `[b, columns, layers, top_k]` layout, -1 at padding."""
    am = mb["attention_mask"].bool()
    flat = am.flatten().nonzero().squeeze(-1)
    out = recorded_NLK.new_full((am.numel(), *recorded_NLK.shape[1:]), -1)
    out[flat] = recorded_NLK if packed else recorded_NLK[flat]
    return out.view(*am.shape, *recorded_NLK.shape[1:])


@torch.no_grad()
def compute_sum_pi_squared(model, batch: Batch, *, temperature: float, micro_batch_size: int) -> torch.Tensor:
    """sum_v pi(v)^2 at every response position, [B, T] (the OTB estimators' path-variance term), from a padded
    forward with full logits per micro-batch: an extra pass that only those estimators pay for."""
    was_training = model.training
    model.eval()
    temperature = 1.0 if temperature in (0.0, 1.0) else temperature
    trunk, head = _trunk_and_head(model)
    B, T = batch["responses"].shape
    out = torch.zeros((B, T), device=batch["responses"].device)
    for rows in split_rows(B, micro_batch_size):
        mb = select(batch, rows)
        hidden = trunk(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                       position_ids=mb["position_ids"], use_cache=False).last_hidden_state[:, -T - 1:-1]
        probs = torch.softmax(head(hidden).float() / temperature, dim=-1)
        out[rows] = probs.square().sum(-1) * mb["response_mask"]
    model.train(was_training)
    return out


def make_scheduler(optimizer, *, total_steps: int, warmup_steps: int, kind: str, min_lr_ratio: float,
                   num_cycles: float):
    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        cos = 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * min(progress, 1.0)))
        return min_lr_ratio + (1.0 - min_lr_ratio) * cos

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class UpdateSettings:
    """What one `update` needs from the config, resolved to sequence counts."""

    mini_batch_size: int  # sequences per optimizer step
    micro_batch_size: int  # sequences per forward/backward
    ppo_epochs: int
    temperature: float
    loss_mode: str
    loss_agg_mode: str
    knobs: LossKnobs
    grad_clip: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    shuffle: bool = False
    calculate_entropy: bool = True
    old_from_current: bool = False  # on-policy single pass: old log-probs are the current ones (no extra pass)
    max_token_len: int | None = None  # use_dynamic_bsz: micro-batches cut by this token budget instead of rows
    rollout_correction: RolloutCorrectionConfig | None = None  # bypass mode: correct pi_theta vs pi_rollout here
    skip_mini_batches: int = 0  # already applied by an attempt that ran out of memory (trainer/oom.py resumes)

    @classmethod
    def from_config(cls, actor, *, max_response_length: int, **derived) -> UpdateSettings:
        """`actor_rollout_ref.actor.*` as they are; `derived` holds what the trainer works out per batch (batch sizes,
        temperature, old_from_current, rollout_correction, skip_mini_batches)."""
        return cls(ppo_epochs=actor.ppo_epochs, loss_mode=actor.policy_loss.loss_mode,
                   loss_agg_mode=actor.loss_agg_mode, grad_clip=actor.grad_clip, entropy_coeff=actor.entropy_coeff,
                   use_kl_loss=actor.use_kl_loss, kl_loss_coef=actor.kl_loss_coef, kl_loss_type=actor.kl_loss_type,
                   shuffle=actor.shuffle, calculate_entropy=actor.calculate_entropy,
                   knobs=LossKnobs.from_config(actor, max_response_length=max_response_length),
                   max_token_len=actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None, **derived)


class Actor:
    def __init__(self, model, optimizer, scheduler, dp=None, fwd: ForwardSettings | None = None):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.dp = dp  # polyrl.distributed.DistEnv when data-parallel (see _global_counts); None in one process
        self.fwd = fwd or ForwardSettings()
        if dp is not None and dp.sp is not None:  # Ulysses: the packed forward splits rows over the SP group
            if not self.fwd.use_remove_padding:
                raise ConfigError(f"ulysses_sequence_parallel_size={dp.sp_size} needs actor_rollout_ref.model."
                                  "use_remove_padding=True (it splits the packed row); set it to True.")
            cfg = model.config
            check_heads(cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
                        or cfg.num_attention_heads, dp.sp_size)
            self.fwd = dataclasses.replace(self.fwd, sp=dp.sp)
        if self.fwd.routing is None and find_routers(model):  # MoE: router hooks for replay and the aux loss
            self.fwd = dataclasses.replace(self.fwd, routing=MoERouting(model))
            grouped_experts(model)  # as load_policy does (a no-op there): for a model built another way
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mini_batches_applied = 0  # of the current update: where an out-of-memory retry resumes
        if self.fwd.compile_layers:
            compile_decoder_layers(model)

    def update(self, batch: Batch, s: UpdateSettings, generator: torch.Generator | None = None) -> dict[str, float]:
        # packed attention stays on through backward: checkpointed layers re-run their forward there
        packs = _packs(self.fwd, batch["input_ids"].device)
        routing = self.fwd.routing  # MoE: replay / agreement / aux loss, for forward and backward (models/moe.py)
        plan = routing.plan(replay=self.fwd.replay_routes, collect_logits=routing.aux_loss_coef > 0) \
            if routing is not None else nullcontext()
        with packed_attention(self.model) if packs else nullcontext(), plan:
            return self._update(batch, s, generator)

    def _update(self, batch: Batch, s: UpdateSettings, generator: torch.Generator | None) -> dict[str, float]:
        self.model.train()
        t_start, flops = time.perf_counter(), 0.0
        peak = peak_flops(batch["responses"].device)  # 0 off CUDA: no MFU, so no FLOP count
        offload, pin = self.fwd.activation_offload, batch["responses"].device.type == "cuda"
        B, T = batch["responses"].shape
        shares = _shares(self.fwd, batch["input_ids"].device)
        grad_first = (self.fwd.fused_head and self.fwd.head_grad_in_forward and s.old_from_current
                      and not s.use_kl_loss and s.loss_mode in _VALUE_FREE_GRAD_LOSSES and self.fwd.sp is None)
        if s.knobs.loss_scale_factor is None:  # fix the seq-mean-token-sum-norm divisor before columns get trimmed
            s = dataclasses.replace(s, knobs=dataclasses.replace(s.knobs, loss_scale_factor=float(T)))
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        skipped, num_seen = 0, 0
        routing = self.fwd.routing
        aux_coef = routing.aux_loss_coef if routing is not None else 0.0
        self.mini_batches_applied = s.skip_mini_batches

        def add(key, value, weight=1.0):
            sums[key] = sums.get(key, 0.0) + value.detach().float() * weight
            counts[key] = counts.get(key, 0) + weight

        for _ in range(s.ppo_epochs):
            order = torch.randperm(B, generator=generator) if s.shuffle else torch.arange(B)
            for mini_rows in split_rows(B, s.mini_batch_size):
                num_seen += 1
                if num_seen <= s.skip_mini_batches:  # its optimizer step is done (the shuffles replay the same)
                    continue
                mini = select(batch, order[mini_rows].to(batch["responses"].device))
                num_tokens = mini["response_mask"].sum()
                num_seqs = mini["responses"].shape[0]
                num_tokens, num_seqs = self._global_counts(num_tokens, num_seqs)
                self.optimizer.zero_grad(set_to_none=True)
                first_pass = not counts.get("_mini")
                # w = 0: an empty micro-batch kept in step with other ranks
                micro = [_padding_pass(rows) for rows in micro_batches(mini, s.micro_batch_size, s.max_token_len,
                                                                        self.dp, shares)]
                if peak > 0:  # counted up front: its host reads between micro-batches would stall the GPU queue
                    flops += sum(_flops(self.model, select(mini, rows), shares) for rows, _ in micro) / self._sp_size
                # the loss gradient per token is row-local given the mini-batch normalisers: computed once, sliced
                coefs_mini = loss_coefficients(s, mini, num_tokens, num_seqs, float(self._loss_scale)) \
                    if grad_first else None
                for rows, w in micro:
                    mb = trim_columns(select(mini, rows))
                    frac = mb["response_mask"].sum() / num_tokens.clamp_min(1) * w
                    need_entropy = s.entropy_coeff != 0 or s.calculate_entropy
                    coefs = None if coefs_mini is None else \
                        [None if c is None else _micro_coef(c, rows, mb["responses"].shape[1], w) for c in coefs_mini]
                    with torch.autograd.graph.save_on_cpu(pin_memory=pin) if offload else nullcontext():
                        logp, ent, *anchor = logprobs_and_entropy(self.model, mb, s.temperature, need_entropy,
                                                                  self.fwd, grad_coefs=coefs)
                    mask = mb["response_mask"]
                    aux_term = None
                    if aux_coef:  # the model's load-balancing loss, token-weighted over the mini-batch
                        aux = routing.aux_loss()
                        share = mb["response_mask"].sum() / num_tokens.clamp_min(1)
                        aux_term = aux_coef * aux * share
                        add("actor/moe_aux_loss", aux.detach() * share * w)
                    if routing is not None and first_pass and w:
                        agree = routing.agreement_counts()  # rollout's recorded routes vs the trainer's own
                        if agree is not None:
                            add("actor/router_agreement", agree[0] / agree[1].clamp_min(1), agree[1].float())
                    if first_pass and s.old_from_current and "rollout_log_probs" in mb and w:
                        # weights untouched since the rollout: the engine-vs-trainer gap verl logs, for free
                        gap = (logp.detach().exp() - mb["rollout_log_probs"].exp()).abs() * mask
                        key = "training/rollout_probs_diff_mean"
                        sums[key] = sums.get(key, 0.0) + gap.sum() / num_tokens.clamp_min(1)
                        counts[key] = counts.get(key, 0) + 1
                        sums["_gap_max"] = torch.maximum(sums.get("_gap_max", gap.new_zeros(())), gap.max())
                        if routing is not None:  # MoE: the mismatch KL E[log pi_rollout - log pi] (rollout_corr/kl)
                            kl = (mb["rollout_log_probs"] - logp.detach()) * mask
                            add("rollout_corr/kl", kl.sum() / mask.sum().clamp_min(1), mask.sum())
                    old = logp.detach() if s.old_from_current else mb["old_log_probs"]
                    loss_mode, is_weights, loss_mask = s.loss_mode, mb.get("rollout_is_weights"), mask
                    if s.rollout_correction is not None:  # bypass: pi_old is pi_rollout; weights and mask vs pi_theta
                        is_weights, loss_mask, rc_metrics = rollout_correction_tensors(
                            logp.detach(), mb["rollout_log_probs"], mask, s.rollout_correction)
                        if s.rollout_correction.loss_type == "reinforce":
                            loss_mode = "gpg"  # -A * log pi, times the IS weights: verl's bypass REINFORCE
                        else:
                            is_weights = None  # ppo_clip: the PPO ratio already is pi_theta / pi_rollout
                        for k, v in rc_metrics.items():
                            add(k, v, frac)
                    pg_loss, pg_metrics = policy_loss(
                        loss_mode, old_log_prob_BT=old, log_prob_BT=logp, advantages_BT=mb["advantages"],
                        response_mask_BT=loss_mask, loss_agg_mode=s.loss_agg_mode, cfg=s.knobs,
                        num_tokens=num_tokens, num_seqs=num_seqs, rollout_is_weights_BT=is_weights)
                    loss = pg_loss
                    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=s.knobs.loss_scale_factor)
                    if ent is not None:
                        ent_loss = agg_loss(ent, mask, s.loss_agg_mode, **agg)
                        add("actor/entropy", ent_loss * w)
                        if s.entropy_coeff != 0:
                            loss = loss - s.entropy_coeff * ent_loss
                    if s.use_kl_loss:
                        kl = kl_penalty(s.kl_loss_type, logp, mb["ref_log_probs"])
                        kl_loss = agg_loss(kl, mask, s.loss_agg_mode, **agg)
                        loss = loss + s.kl_loss_coef * kl_loss
                        add("actor/kl_loss", kl_loss * w)
                        add("actor/kl_coef", torch.tensor(s.kl_loss_coef), 0.0)
                    if aux_term is not None:
                        loss = loss + aux_term
                    if grad_first:  # the same gradient, its LM-head part already computed in the forward
                        (anchor[0] if aux_term is None else anchor[0] + aux_term * (self._loss_scale * w)).backward()
                    else:
                        (loss * (self._loss_scale * w)).backward()
                    add("actor/pg_loss", pg_loss * w)
                    for k, v in pg_metrics.items():
                        add(k, v, frac)
                grad_norm = clip_grad_norm_(self.params, s.grad_clip)  # plain, FSDP-sharded or mixed parameters
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                else:  # a NaN/Inf update would poison the weights: skip it, keep the weights, count it
                    skipped += 1
                    self.optimizer.zero_grad(set_to_none=True)
                add("actor/grad_norm", grad_norm)
                counts["_mini"] = counts.get("_mini", 0) + 1
                self.mini_batches_applied += 1
        self.scheduler.step()
        num_mini = counts.pop("_mini")
        gap_max = sums.pop("_gap_max", None)
        self._reduce_metric_sums(sums, counts)
        metrics = {}
        if gap_max is not None:
            metrics["training/rollout_probs_diff_max"] = float(gap_max)
        for k, v in sums.items():
            if k == "training/rollout_probs_diff_mean":
                metrics[k] = float(v)  # summed over the micro-batches of the first mini-batch, each over its tokens
            elif k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/moe_aux_loss"):
                metrics[k] = float(v) / num_mini  # these were summed over micro-batches of a mini-batch
            elif k == "actor/grad_norm":
                metrics[k] = float(v) / num_mini
            elif float(counts[k]):  # token-weighted metrics: counts are tensors summed on device
                metrics[k] = float(v) / float(counts[k])
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["actor/nonfinite_skipped"] = skipped
        if peak > 0:  # the float() calls above have synchronised the device, so the wall time is the update's
            metrics["perf/mfu/actor"] = flops / (time.perf_counter() - t_start) / peak
        return metrics

    # ---- data parallel (polyrl.distributed) --------------------------------------------------------------------
    # Each data shard (an SP group under Ulysses, else one rank) holds a slice of every mini-batch. Loss normalisers
    # count the *whole* mini-batch over the data shards, and FSDP averages gradients over all world ranks, so each
    # rank's loss is multiplied by the world size: the average of the scaled per-rank sums is the single-process
    # mini-batch loss, whatever the number of processes (the SP argument is in distributed/ulysses.py).
    @property
    def _loss_scale(self) -> int:
        return self.dp.world_size if self.dp is not None else 1

    @property
    def _num_data_shards(self) -> int:
        return self.dp.data.world_size if self.dp is not None else 1

    @property
    def _sp_size(self) -> int:
        return self.dp.sp_size if self.dp is not None else 1

    def _global_counts(self, num_tokens: torch.Tensor, num_seqs: int):
        if self._num_data_shards == 1:
            return num_tokens, num_seqs
        both = self.dp.data.all_reduce(torch.stack([num_tokens.float(), torch.tensor(float(num_seqs),
                                                                                     device=num_tokens.device)]))
        return both[0], int(both[1])

    def _reduce_metric_sums(self, sums: dict, counts: dict) -> None:
        """Per-shard partial sums -> sums over the job (grad_norm is already global; kl_coef is a constant); the
        ranks of an SP group hold identical sums, so they are reduced over the data shards only."""
        if self._num_data_shards == 1:
            return
        keys = sorted(k for k in sums if k not in ("actor/grad_norm", "actor/kl_coef"))
        dev = next(iter(sums.values())).device if sums else torch.device("cpu")
        packed = torch.stack([torch.as_tensor(x, dtype=torch.float32, device=dev).reshape(())
                              for k in keys for x in (sums[k], counts[k])])
        packed = self.dp.data.all_reduce(packed)
        for i, k in enumerate(keys):
            sums[k], counts[k] = packed[2 * i], float(packed[2 * i + 1])
