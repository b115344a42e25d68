"""The `hf` rollout backend: any HF causal LM, a plain KV-cached decode loop. Slow but universal.

It is the reference the native engine is checked against and the fallback for architectures the native engine does
not implement. Prompts are left-padded into one batch (per chunk of `max_batch_size` rows); the `n` samples of a
prompt are separate rows (no KV sharing here).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Iterable

import torch

from polyrl.rollout.base import Generation, SamplingParams, register_rollout
from polyrl.rollout.config import DEFAULT_MAX_NUM_SEQS
from polyrl.rollout.token_sampling import sample


class HFRollout:
    """`lockstep(n)`: the max of `n` over the ranks whose model shares collectives (an FSDP2-sharded model: the
    off-policy trainer's ranks validating). Every forward all-gathers the weights, so every rank must run as many:
    all ranks decode until the last is done and run as many chunks, a rank out of rows a one-row stand-in."""

    def __init__(self, model, *, pad_token_id: int, max_batch_size: int = 512, seed: int = 0, lockstep=None):
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.lockstep = lockstep
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> Generation:
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        rows = [i for i in range(len(prompt_ids)) for _ in range(sampling.n)]
        out = Generation(prompt_index=rows, token_ids=[], logprobs=[], finish_reason=[])
        was_training = self.model.training
        self.model.eval()
        limits = sampling.row_limits(len(rows))
        routing, stack = None, ExitStack()
        if sampling.record_routes:  # forward hooks on the routers record each step's expert ids (models/moe.py)
            from polyrl.models.moe import MoERouting, find_routers

            routing = MoERouting(self.model) if find_routers(self.model) else None
            out.routed_experts = [] if routing is not None else None
        try:
            if routing is not None:
                stack.enter_context(routing.plan(record=True))
            starts = list(range(0, len(rows), self.max_batch_size))
            for _ in range(len(starts), self.lockstep(len(starts)) if self.lockstep else 0):
                self._generate_chunk([[self.pad_token_id]], sampling, [1])  # lockstep: a stand-in, discarded
            for start in starts:
                chunk = rows[start:start + self.max_batch_size]
                caps = limits[start:start + len(chunk)] if limits is not None else None
                prompts = [prompt_ids[i] for i in chunk]
                steps = [] if routing is not None else None
                toks, lps, reasons = self._generate_chunk(prompts, sampling, caps, routing=routing, routes=steps)
                out.token_ids += toks
                out.logprobs += lps
                out.finish_reason += reasons
                if routing is not None:
                    out.routed_experts += _routes_per_row(steps, prompts, toks)
        finally:
            self.model.train(was_training)
            stack.close()
            if routing is not None:
                routing.remove()
        return out

    def _generate_chunk(self, prompts, sampling: SamplingParams, caps, routing=None, routes=None):
        """`caps`: each row's new-token limit (exact when forced_lengths are set: stop tokens are then ignored).
        With `routing` (models/moe.MoERouting), each forward's expert ids are appended to `routes` as
        `[B, columns, num_moe_layers, top_k]`."""
        forced = sampling.forced_lengths is not None
        B, P = len(prompts), max(len(p) for p in prompts)
        dev = self.device
        input_ids = torch.full((B, P), self.pad_token_id, dtype=torch.long, device=dev)
        mask = torch.zeros((B, P), dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            input_ids[b, P - len(p):] = torch.tensor(p, device=dev)
            mask[b, P - len(p):] = 1
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        stop = torch.tensor(list(sampling.stop_token_ids) or [-1], device=dev)
        max_new = max(caps) if caps else sampling.max_new_tokens
        if self.lockstep:
            max_new = self.lockstep(max_new)
        limit_B = torch.tensor(caps, device=dev) if caps else torch.full((B,), max_new, device=dev)
        tokens_BT = torch.full((B, max_new), self.pad_token_id, dtype=torch.long, device=dev)
        logp_BT = torch.zeros((B, max_new), device=dev)
        length_B = torch.zeros(B, dtype=torch.long, device=dev)
        done_B = torch.zeros(B, dtype=torch.bool, device=dev)
        stopped_B = torch.zeros(B, dtype=torch.bool, device=dev)
        past = None
        cur_ids, cur_pos = input_ids, position_ids
        # an MoE config asking for the aux loss (output_router_logits, for training) would make HF compute it on every
        # decode step, against a mask the step's rows do not match
        moe_kw = {"output_router_logits": False} if getattr(self.model.config, "output_router_logits", False) else {}
        for t in range(max_new):
            if routing is not None:
                routing.begin()
            out = self.model(input_ids=cur_ids, attention_mask=mask, position_ids=cur_pos, past_key_values=past,
                             use_cache=True, **moe_kw)
            if routing is not None:
                routes.append(routing.take_recorded().view(*cur_ids.shape, routing.num_layers, routing.top_k))
            past = out.past_key_values
            tok_B, lp_B = sample(out.logits[:, -1], sampling.temperature, sampling.top_k, sampling.top_p,
                                 generator=self.generator)
            live_B = ~done_B
            tokens_BT[:, t] = torch.where(live_B, tok_B, tokens_BT[:, t])
            logp_BT[:, t] = torch.where(live_B, lp_B, logp_BT[:, t])
            length_B += live_B.long()
            if not sampling.ignore_eos and not forced:
                hit_B = torch.isin(tok_B, stop) & live_B
                stopped_B |= hit_B
                done_B |= hit_B
            done_B |= length_B >= limit_B
            live = int(not bool(done_B.all()))  # one host sync per step: fine for the reference backend
            if (self.lockstep(live) if self.lockstep else live) == 0:
                break
            cur_ids = tok_B[:, None]
            cur_pos = cur_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=dev)], dim=1)
        lengths = length_B.tolist()
        toks = [tokens_BT[b, :n].tolist() for b, n in enumerate(lengths)]
        lps = [logp_BT[b, :n].tolist() for b, n in enumerate(lengths)]
        reasons = ["stop" if s else "length" for s in stopped_B.tolist()]
        return toks, lps, reasons

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.state_dict())
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name in params and params[name].data_ptr() != tensor.data_ptr():
                    params[name].copy_(tensor)

    def release_memory(self) -> None:
        pass  # the KV cache lives only inside generate()

    def resume(self) -> None:
        pass


def _routes_per_row(steps: list[torch.Tensor], prompts: list[list[int]], tokens: list[list[int]]) -> list:
    """Each row's routes at its prompt and response positions (`Generation.routed_experts`): the left-padded prefill
    columns, then one column per decode step (step t fed response token t-1); the last token was never fed: -1."""
    cols = torch.cat(steps, dim=1).cpu()  # [B, P + steps - 1, L, K]
    P = steps[0].shape[1]
    out = []
    for b, (p, toks) in enumerate(zip(prompts, tokens)):
        r = torch.full((len(p) + len(toks), *cols.shape[2:]), -1, dtype=torch.int16)
        fed = len(p) + max(len(toks) - 1, 0)
        r[:fed] = cols[b, P - len(p):P - len(p) + fed]
        out.append(r)
    return out


@register_rollout("hf")
def build_hf_rollout(cfg, model, *, pad_token_id: int, device: torch.device, max_model_len: int) -> HFRollout:
    """`rollout.name=hf`: generates with the actor's own module (LoRA adapters apply as they are; no weight copy)."""
    return HFRollout(model, pad_token_id=pad_token_id, seed=cfg.seed,
                     max_batch_size=cfg.max_num_seqs or DEFAULT_MAX_NUM_SEQS)
