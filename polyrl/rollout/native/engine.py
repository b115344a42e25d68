"""NativeEngine: polyrl's own rollout backend (`actor_rollout_ref.rollout.name=native`).

    engine = NativeEngine.from_hf(hf_model_or_dir, gpu_memory_utilization=0.5)
    out = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, max_new_tokens=1024))
    engine.release_memory(); ...train...; engine.resume(); engine.update_weights(actor.state_dict().items())

The loop: the scheduler picks a step (prefill chunks or one decode token per running sequence), the engine launches
it (decode as a CUDA-graph replay), samples on the device into a per-sequence token buffer the next step reads, and
copies the sampled ids to pinned host memory. The host then processes the *previous* step's ids while the device
works on this one, so the GPU never waits on Python between decode steps (`scheduler.py` explains the one-step lag).

Memory (GPU): like vLLM, `gpu_memory_utilization` is the fraction of the GPU's total memory this engine may use:
weights + activation peak (profiled once with a max_num_batched_tokens prefill) + KV cache; the KV cache takes the
rest, never more than is free. On CPU the cache holds `num_kv_tokens` tokens.

Low precision (`kv_cache_dtype="fp8"`, `quantization="fp8"`): the KV cache stores e4m3 values with per-(token, head)
scales (attention.py), so the same memory holds about twice the tokens and decode reads half the KV bytes; the
decode GEMMs can run on e4m3 weights quantised from the trainer's weights on every `update_weights` (fp8_linear.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from polyrl.rollout.base import Generation, SamplingParams, register_rollout
from polyrl.rollout.native.attention import (DECODE_KERNEL_CHOICES, FP8, AttnMeta, choose_decode_kernel,
                                             decode_kernel_module)
from polyrl.rollout.native.block_manager import BlockManager
from polyrl.rollout.native.model import (CausalLM, ModelSpec, UnsupportedModel, load_hf_weights, materialize,
                                        required_hf_names, shared_weights, SUPPORTED_ROPE_TYPES)
from polyrl.rollout.native.moe import RouteRecorder, route_bytes_per_token
from polyrl.rollout.native.scheduler import Scheduler, Sequence, Step
from polyrl.rollout.token_sampling import sample, sample_fused


KV_CACHE_DTYPES = {"auto": None, "fp8": FP8, "fp8_e4m3": FP8}  # vLLM's names; auto = the model's dtype
QUANTIZATIONS = (None, "fp8")


@dataclass
class _InFlight:
    step: Step
    tokens: torch.Tensor  # host (pinned on CUDA) ids of this step's samples
    logprobs: torch.Tensor
    event: torch.cuda.Event | None


def _hf_rope(hf_model) -> tuple[torch.Tensor, float]:
    rot = getattr(getattr(hf_model, "model", hf_model), "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        raise UnsupportedModel(f"rollout.name=native cannot find rotary_emb.inv_freq on {type(hf_model).__name__}")
    rope_type = getattr(rot, "rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(f"rollout.name=native supports rope types {SUPPORTED_ROPE_TYPES}, got {rope_type!r}")
    return rot.inv_freq.detach().float().cpu(), float(getattr(rot, "attention_scaling", 1.0))


@dataclass(eq=False)
class KeptRow:
    """A row whose KV blocks outlive its `generate` call (`SamplingParams.keep_unfinished`): pass it back in
    `SamplingParams.continuations` to continue it on that cache; valid for the next call only."""

    seq: Sequence


class NativeEngine:
    """Paged-KV, continuously batched, CUDA-graph decoding for Qwen2/2.5/3, Llama and Qwen2/3-MoE models.
    `record_routes`: MoE routing replay (R3), `Generation.routed_experts` (moe.py's RouteRecorder)."""

    @classmethod
    def from_hf(
        cls,
        model_or_path,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        block_size: int = 16,
        seed: int = 0,
        num_kv_tokens: int | None = None,
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
        fp8_min_elements: int | None = None,
        decode_kernel: str = "auto",
        fp8_lm_head: bool = False,
        record_routes: bool = False,
        tp=None,
        prefill_kernel: bool = True,
        fp8_splitk: bool = True,
        share: dict[str, torch.Tensor] | None = None,
    ) -> "NativeEngine":
        """Build from an HF `PreTrainedModel` or a local directory (`from_pretrained`). The HF model is not kept.
        `tp`: a `tensor_parallel.TPGroup` of more than one rank makes this engine one rank's slice of a replica
        (tensor_parallel.py); every rank of the group then calls every method with the same arguments.
        `share`: HF-named tensors that never change (a LoRA trainer's frozen base, `loader.frozen_weights`); each
        that is a whole engine weight in the engine's dtype and device becomes that weight, not a copy of it
        (`shared_weights`), and is never written, offloaded or counted in the engine's memory."""
        if isinstance(model_or_path, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(model_or_path, dtype=dtype or "auto")
        else:
            hf = model_or_path
        spec = ModelSpec.from_hf_config(hf.config)
        inv_freq, attn_scaling = _hf_rope(hf)
        hf_param = next(hf.parameters())
        dtype = dtype or hf_param.dtype
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        max_model_len = max_model_len or spec.max_position_embeddings
        with torch.device("meta"):
            model = CausalLM(spec)
        shards = None
        if tp is not None and tp.size > 1:  # cut on the meta device: no rank ever allocates the full model
            from polyrl.rollout.native.tensor_parallel import shard_model

            shards = shard_model(model, tp)
        model = model.to(dtype)
        used = shared_weights(model, share or {}, dtype, device) if shards is None and quantization is None else {}
        materialize(model, device, used)
        if used:
            gib = sum(t.numel() * t.element_size() for t in used.values()) / 2**30
            print(f"polyrl: the rollout engine uses {len(used)} frozen weights of the trainer in place ({gib:.2f} GiB "
                  "not copied)")
        model.set_rope(inv_freq, attn_scaling, max_model_len, device)
        named = hf.state_dict().items()
        loaded = load_hf_weights(model, shards.local_tensors(named) if shards else named)
        missing = required_hf_names(model) - loaded
        if missing:
            raise ValueError(
                f"the HF model lacks {len(missing)} parameters the engine needs, e.g. {sorted(missing)[:3]}."
            )
        return cls(model, device=device, gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                   enforce_eager=enforce_eager, block_size=block_size, seed=seed, num_kv_tokens=num_kv_tokens,
                   kv_cache_dtype=kv_cache_dtype, quantization=quantization, fp8_min_elements=fp8_min_elements,
                   decode_kernel=decode_kernel, fp8_lm_head=fp8_lm_head, record_routes=record_routes,
                   shards=shards, prefill_kernel=prefill_kernel, fp8_splitk=fp8_splitk)

    def __init__(self, model: CausalLM, *, device, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens,
                 max_model_len, enforce_eager, block_size, seed, num_kv_tokens, kv_cache_dtype="auto",
                 quantization=None, fp8_min_elements=None, decode_kernel="auto", fp8_lm_head=False,
                 record_routes=False, shards=None, prefill_kernel=True, fp8_splitk=True):
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1].")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs={max_num_seqs} and max_num_batched_tokens={max_num_batched_tokens} must be >= 1."
            )
        self.model, self.spec, self.device = model.eval(), model.spec, torch.device(device)
        self.shards = shards  # tensor_parallel.TensorParallel: this engine is one rank of a TP replica (or None)
        model.fused = self.device.type == "cuda"
        self.dtype = model.embed.weight.dtype
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; use one of {sorted(KV_CACHE_DTYPES)}.")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={quantization!r} is not supported; use one of {QUANTIZATIONS}.")
        if decode_kernel not in DECODE_KERNEL_CHOICES:
            raise ValueError(f"decode_kernel={decode_kernel!r} is not a paged-decode kernel; use one of "
                             f"{list(DECODE_KERNEL_CHOICES)}.")
        self.kv_fp8 = KV_CACHE_DTYPES[kv_cache_dtype] is not None
        self.decode_kernel, why = choose_decode_kernel(decode_kernel, self.kv_fp8, block_size)
        if decode_kernel == "auto" and self.device.type == "cuda":
            print(f"polyrl: auto actor_rollout_ref.rollout.engine_kwargs.native.decode_kernel={self.decode_kernel} "
                  f"({why})")
        self.kv_dtype = FP8 if self.kv_fp8 else self.dtype
        self.quantization = quantization
        if fp8_lm_head and quantization != "fp8":
            raise ValueError("engine_kwargs.native.fp8_lm_head=True needs actor_rollout_ref.rollout.quantization=fp8.")
        if quantization == "fp8":
            from polyrl.rollout.native.fp8_linear import quantize_model

            quantize_model(model, min_elements=fp8_min_elements, lm_head=fp8_lm_head, splitk=fp8_splitk)
        self.cuda = self.device.type == "cuda"
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len, self.block_size, self.seed = max_model_len, block_size, seed
        self.use_graphs = self.cuda and not enforce_eager
        self.prefill_kernel = self.cuda and prefill_kernel  # prefill attention: paged_prefill.py or gather
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        s = self.spec
        per_head = s.head_dim * self.kv_dtype.itemsize + (4 if self.kv_fp8 else 0)  # + the fp32 scale
        self.block_bytes = 2 * s.num_layers * block_size * s.num_kv_heads * per_head
        # MoE routing replay (R3): top-k expert ids per token and MoE layer, indexed like the KV cache (moe.py)
        self.routes = RouteRecorder(model, block_size) if record_routes else None
        self.block_bytes += block_size * route_bytes_per_token(model) if record_routes else 0
        # per-slot state: row max_num_seqs is the dummy that CUDA-graph padding rows point at
        rows = max_num_seqs + 1
        self.bt_host = np.zeros((rows, self.max_blocks_per_seq), dtype=np.int64)
        self.bt_dev = torch.zeros(rows, self.max_blocks_per_seq, dtype=torch.int32, device=self.device)
        self.tok_buf = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.dec_meta = torch.zeros(4, max_num_seqs, dtype=torch.long, device=self.device)  # slots, pos, slot_map, ctx
        pin = self.cuda
        self._meta_host = [torch.zeros(4, max_num_seqs, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._tok_host = [torch.zeros(max_num_seqs, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._lp_host = [torch.zeros(max_num_seqs, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._ring = 0
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.cuda else 0
        self.graphs = None
        self.kv = self.kv_scale = None
        self.offloaded = False
        self.released = False
        self.num_calls = 0
        self.kept: list[KeptRow] = []  # rows whose KV blocks outlive a call (partial rollouts, multi-turn)
        self._saved: dict[int, int] = {}  # prompt -> tokens its kept cache spared the last call's prefill
        self.last_update_weights_s = 0.0
        self.stats: dict[str, float] = {}
        self.num_blocks = self._plan_kv(gpu_memory_utilization, num_kv_tokens)
        if shards is not None:  # the ranks' schedulers run in lockstep: one cache size for the group
            self.num_blocks = shards.group.min_int(self.num_blocks)
        self._alloc_kv()

    # ---- memory ------------------------------------------------------------------------------------------------
    def own_weights(self) -> list[torch.Tensor]:
        """The weights this engine holds: all but those it uses in place of the trainer's (`share`)."""
        shared = getattr(self.model, "shared", frozenset())
        return [p for p in self.model.parameters() if id(p) not in shared]

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.own_weights())  # FP8: e4m3 bytes + scales

    def _plan_kv(self, util: float, num_kv_tokens: int | None) -> int:
        if not self.cuda:
            tokens = num_kv_tokens or 16384
            return max(2, -(-tokens // self.block_size) + 1)
        if num_kv_tokens:
            return -(-num_kv_tokens // self.block_size) + 1
        act = self._profile_activation_bytes()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = min(util * total - self.weight_bytes() - act, free - act - (256 << 20))
        num_blocks = int(budget // self.block_bytes)
        if num_blocks < 2:
            raise ValueError(
                f"gpu_memory_utilization={util} leaves no room for a KV cache ({budget / 2**30:.2f} GiB after "
                f"{self.weight_bytes() / 2**30:.2f} GiB of weights and {act / 2**30:.2f} GiB of activations); raise it."
            )
        self.stats["activation_reserve_gib"] = act / 2**30
        return num_blocks

    @torch.no_grad()
    def _profile_activation_bytes(self) -> int:
        """Peak extra memory of a max_num_batched_tokens prefill plus sampling max_num_seqs rows."""
        length = min(self.max_num_batched_tokens, self.max_model_len)
        num_blocks = -(-length // self.block_size) + 1
        self.num_blocks = num_blocks
        self._alloc_kv()
        seqs, chunks = [], []
        remaining = self.max_num_batched_tokens
        self.bt_host[self.max_num_seqs, : num_blocks - 1] = np.arange(1, num_blocks)
        while remaining > 0:
            c = min(length, remaining)
            seq = Sequence(row=0, prompt_index=0, tokens=[0] * c, num_prompt=c, max_new=1, slot=self.max_num_seqs)
            seqs.append(seq), chunks.append((0, c))
            remaining -= c
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        ids, pos, meta, last = self._prefill_inputs(seqs, chunks)
        h = self.model(ids, pos, meta)
        rows = h[last[:1]].expand(self.max_num_seqs, -1)
        sample(self.model.logits(rows), 1.0, 50, 0.9)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.bt_host[self.max_num_seqs] = 0
        del h, rows
        self.kv = self.kv_scale = None
        torch.cuda.empty_cache()
        return int(peak * 1.1) + (64 << 20)

    def _alloc_kv(self) -> None:
        s = self.spec
        self.kv = torch.zeros(s.num_layers, 2, self.num_blocks, self.block_size, s.num_kv_heads, s.head_dim,
                              dtype=self.kv_dtype, device=self.device)
        if self.kv_fp8:
            self.kv_scale = torch.zeros(s.num_layers, 2, self.num_blocks, self.block_size, s.num_kv_heads,
                                        dtype=torch.float32, device=self.device)
        for i, layer in enumerate(self.model.layers):
            layer.attn.k_cache, layer.attn.v_cache = self.kv[i, 0], self.kv[i, 1]
            if self.kv_fp8:
                layer.attn.k_scale, layer.attn.v_scale = self.kv_scale[i, 0], self.kv_scale[i, 1]
        self.blocks = BlockManager(self.num_blocks, self.block_size)
        if self.routes is not None:
            self.routes.alloc(self.num_blocks, self.device)

    def release_memory(self, offload_weights: bool = False) -> None:
        """Free the KV cache and CUDA graphs (and move weights to host memory if `offload_weights`). Kept rows lose
        their cache: a later continuation recomputes it."""
        self.kept = []
        self.graphs = None
        self.kv = self.kv_scale = None
        for layer in self.model.layers:
            layer.attn.k_cache = layer.attn.v_cache = layer.attn.k_scale = layer.attn.v_scale = None
        if self.routes is not None:
            self.routes.release()
        if offload_weights and not self.offloaded:
            if self.cuda:  # a shared weight stays: the trainer holds it on the GPU anyway
                for p in self.own_weights():
                    host = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
                    host.copy_(p.data)
                    p.data = host
            self.offloaded = self.cuda
        self.released = True
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def resume(self) -> None:
        """Bring weights back (if offloaded) and re-allocate the KV cache; graphs are recaptured on next generate."""
        if self.offloaded:
            for p in self.own_weights():
                p.data = p.data.to(self.device, non_blocking=True)
            self.offloaded = False
        if self.kv is None:
            self._alloc_kv()
        self.released = False

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, sliced: bool = False) -> None:
        """Copy HF-named tensors into the fused layout in place (graphs stay valid); time in `last_update_weights_s`.
        `sliced`: the tensors already are this tensor-parallel rank's slices (the off-policy pipeline sends them so)."""
        t0 = time.perf_counter()
        if self.shards is not None and not sliced:  # this rank's slice of each full tensor
            named_tensors = self.shards.local_tensors(named_tensors)
        load_hf_weights(self.model, named_tensors)  # FP8 weights are quantised row by row as they arrive
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.last_update_weights_s = time.perf_counter() - t0

    # ---- step inputs -------------------------------------------------------------------------------------------
    def _slots_of(self, slot_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        bs = self.block_size
        return self.bt_host[slot_rows, positions // bs] * bs + positions % bs

    def _upload(self, a, dtype=np.int64) -> torch.Tensor:
        """A host array on the engine's device. On CUDA through pinned memory and asynchronously: a pageable copy
        waits for the step in flight. (For the prefill chunks' inputs this measured no change on an H100: (a)'s
        prefill took 0.32-0.35 s against 0.31-0.37 with pageable copies, 2026-11-27.)"""
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))
        if self.cuda:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _push_table_updates(self, sched: Scheduler) -> None:
        if not sched.table_updates:
            return
        upd = np.asarray(sched.table_updates, dtype=np.int64)
        sched.table_updates.clear()
        self.bt_host[upd[:, 0], upd[:, 1]] = upd[:, 2]
        u = self._upload(upd)
        self.bt_dev[u[:, 0], u[:, 1]] = u[:, 2].to(torch.int32)

    def _prefill_inputs(self, seqs: list[Sequence], chunks: list[tuple[int, int]]):
        S = len(seqs)
        Q = max(c for _, c in chunks)
        K = max(st + c for st, c in chunks)
        ids, pos, slot_rows = [], [], []
        for seq, (st, c) in zip(seqs, chunks):
            ids += seq.tokens[st : st + c]
            pos.append(np.arange(st, st + c))
            slot_rows.append(np.full(c, seq.slot))
        pos_T = np.concatenate(pos)
        T = len(pos_T)
        slot_map = self._slots_of(np.concatenate(slot_rows), pos_T)
        starts = np.array([st for st, _ in chunks])
        lens = np.array([c for _, c in chunks])
        offs = np.concatenate([[0], np.cumsum(lens)[:-1]])
        t = self._upload
        last = t(offs + lens - 1)
        if self.prefill_kernel:  # the kernel reads the paged cache itself: no gather indices
            rows = np.stack([[s.slot for s in seqs], offs, starts, lens])
            meta = AttnMeta(slot_mapping=t(slot_map), block_tables=self.bt_dev, prefill_rows=t(rows), max_q=Q)
            return t(ids), t(pos_T), meta, last
        j = np.arange(Q)[None, :]
        q_index = np.where(j < lens[:, None], offs[:, None] + j, T)
        out_index = np.concatenate([i * Q + np.arange(c) for i, c in enumerate(lens)])
        k = np.arange(K)[None, :]
        ctx = starts + lens
        rows = np.array([s.slot for s in seqs])[:, None]
        gather = self._slots_of(np.broadcast_to(rows, (S, K)), np.minimum(k, ctx[:, None] - 1))
        mask = None
        if starts.any():  # a cached prefix: causal with an offset, so an explicit mask
            qpos = starts[:, None, None] + np.arange(Q)[None, :, None]
            m = (k[:, None, :] <= qpos) & (k[:, None, :] < ctx[:, None, None])
            mask = t(m[:, None], dtype=bool)
        meta = AttnMeta(slot_mapping=t(slot_map), gather_slots=t(gather), q_index=t(q_index),
                        out_index=t(out_index), mask=mask)
        return t(ids), t(pos_T), meta, last

    def _decode_meta(self, batch: int) -> AttnMeta:
        """Paged-kernel metadata over the static decode buffers (rows: slots, positions, cache slots, context)."""
        m, s = self.dec_meta, self.spec
        splits = decode_kernel_module(self.decode_kernel).choose_num_splits(batch, s.num_kv_heads, self.num_sms,
                                                                            self.kv_fp8, num_heads=s.num_heads)
        return AttnMeta(slot_mapping=m[2, :batch], decode=True, seq_slots=m[0, :batch], block_tables=self.bt_dev,
                        context_lens=m[3, :batch], use_kernel=True, num_splits=splits,
                        decode_kernel=self.decode_kernel)

    def _decode_forward(self, batch: int) -> torch.Tensor:
        """Decode forward over static buffers (the function CUDA graphs capture). Returns logits [batch, V]."""
        m = self.dec_meta
        ids = self.tok_buf[m[0, :batch]]
        h = self.model(ids, m[1, :batch], self._decode_meta(batch))
        return self.model.logits(h)

    # ---- launching and processing steps ------------------------------------------------------------------------
    @torch.no_grad()
    def _launch(self, step: Step, sched: Scheduler, sp: SamplingParams, gen) -> _InFlight:
        self._push_table_updates(sched)
        k = self._ring = 1 - self._ring
        if step.decode:
            B = len(step.seqs)
            slots = np.array([s.slot for s in step.seqs], dtype=np.int64)
            pos = np.array([c[0] for c in step.chunks], dtype=np.int64)
            if self.cuda:
                Bp = self.graphs.size_for(B) if self.graphs is not None else B
                host = self._meta_host[k]
                h = host.numpy()
                h[0, :B], h[1, :B], h[2, :B], h[3, :B] = slots, pos, self._slots_of(slots, pos), pos + 1
                h[0, B:Bp], h[1:, B:Bp] = self.max_num_seqs, 0  # padding rows: dummy slot, scratch block 0
                self.dec_meta[:, :Bp].copy_(host[:, :Bp], non_blocking=True)
                logits = self.graphs.run(Bp)[:B] if self.graphs is not None else self._decode_forward(B)
            else:
                ids = self.tok_buf[torch.from_numpy(slots)]
                meta = self._gather_decode_meta(slots, pos)
                h = self.model(ids, torch.from_numpy(pos), meta)
                logits = self.model.logits(h)
            sample_slots = self.dec_meta[0, :B] if self.cuda else torch.from_numpy(slots)
        else:
            ids, pos, meta, last = self._prefill_inputs(step.seqs, step.chunks)
            h = self.model(ids, pos, meta)
            logits = self.model.logits(h[last[self._upload(step.sample_src)]])
            sample_slots = self._upload([s.slot for s in step.sample_seqs])
            if step.copies:  # forked samples get their own copy of the partial last prompt block
                src, dst = (self._upload(x) for x in zip(*step.copies))
                kv = self.kv.view(torch.uint8) if self.kv_fp8 else self.kv  # no float8 index_put on CPU
                kv[:, :, dst] = kv[:, :, src]
                if self.kv_fp8:
                    self.kv_scale[:, :, dst] = self.kv_scale[:, :, src]
                if self.routes is not None:
                    self.routes.copy_blocks(src, dst)
        if self.cuda and not 0 < sp.top_k < logits.shape[-1] and sp.top_p >= 1.0:
            tok, lp = sample_fused(logits, sp.temperature, int(self._step_seeds.integers(2**31 - 1)))
        else:
            tok, lp = sample(logits, sp.temperature, sp.top_k, sp.top_p, gen)
        if self.shards is not None:
            self.shards.same_tokens(tok, lp)
        self.tok_buf[sample_slots] = tok
        R = len(step.sample_seqs)
        th, lh = self._tok_host[k][:R], self._lp_host[k][:R]
        th.copy_(tok, non_blocking=True)
        lh.copy_(lp, non_blocking=True)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        for seq in step.retired:  # at their length limit
            sched.retire(seq, park=sched.keep_at_limit(seq.row))
        return _InFlight(step, th, lh, event)

    def _gather_decode_meta(self, slots: np.ndarray, pos: np.ndarray) -> AttnMeta:
        B, K = len(slots), int(pos.max()) + 1
        k = np.arange(K)[None, :]
        gather = self._slots_of(np.broadcast_to(slots[:, None], (B, K)), np.minimum(k, pos[:, None]))
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        return AttnMeta(slot_mapping=t(self._slots_of(slots, pos)), gather_slots=t(gather),
                        q_index=t(np.arange(B)[:, None]), out_index=t(np.arange(B)),
                        mask=torch.from_numpy((k <= pos[:, None])[:, None, None, :].copy()))

    def _process(self, inf: _InFlight, sched: Scheduler, stop: set[int]) -> None:
        if inf.event is not None:
            inf.event.synchronize()
        for seq, t, lp in zip(inf.step.sample_seqs, inf.tokens.tolist(), inf.logprobs.tolist()):
            if seq.finish_reason is not None:
                continue  # a token sampled after the stop token (the one-step lag); dropped
            seq.tokens.append(t)
            seq.logprobs.append(lp)
            if t in stop:
                seq.finish_reason = "stop"
                if not seq.done_scheduling:
                    sched.retire(seq, park=sched.park_on_stop)
            elif len(seq.tokens) - seq.num_prompt >= seq.max_new:
                seq.finish_reason = "length"

    # ---- the public call ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> Generation:
        if self.released:
            raise RuntimeError("generate() after release_memory(): call resume() first.")
        n = sampling.n
        if not 1 <= n <= self.max_num_seqs:
            raise ValueError(f"SamplingParams.n={n} must be between 1 and max_num_seqs={self.max_num_seqs}.")
        num_rows = len(prompt_ids) * n
        limits = sampling.row_limits(num_rows)
        max_new = (lambda r: int(limits[r])) if limits is not None else (lambda r: sampling.max_new_tokens)
        for p, ids in enumerate(prompt_ids):
            longest = max(max_new(p * n + j) for j in range(n))
            if not ids:
                raise ValueError(f"prompt {p} is empty; every prompt needs at least one token.")
            if min(max_new(p * n + j) for j in range(n)) < 1:
                raise ValueError(
                    f"prompt {p} asks for fewer than 1 new token; max_new_tokens/forced_lengths must be >= 1."
                )
            if len(ids) + longest > self.max_model_len:
                raise ValueError(
                    f"prompt {p} has {len(ids)} tokens + {longest} new > max_model_len={self.max_model_len}; "
                    "raise max_model_len or shorten the prompt."
                )
            if self.blocks.blocks_for(len(ids) + longest) + n > self.num_blocks - 1:
                raise ValueError(f"prompt {p} needs more KV blocks than the cache has ({self.num_blocks - 1}); "
                                 "raise gpu_memory_utilization (or num_kv_tokens on CPU).")
        if self.use_graphs and self.graphs is None:  # sizes are captured on first use (cuda_graph.py)
            from polyrl.rollout.native.cuda_graph import DecodeGraphs, default_batch_sizes

            self.graphs = DecodeGraphs(self._decode_forward, default_batch_sizes(self.max_num_seqs))
        if self.graphs is not None:
            self.graphs.new_call()

        seed = sampling.seed if sampling.seed is not None else self.seed + self.num_calls
        self.num_calls += 1
        gen = None
        self._step_seeds = np.random.default_rng(seed)  # per-step seeds of the fused CUDA sampler
        if not sampling.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        stop = set() if sampling.ignore_eos else set(sampling.stop_token_ids)
        sched = Scheduler(self.blocks, self.max_num_seqs, self.max_num_batched_tokens, self.max_blocks_per_seq, max_new)
        if self.routes is not None:  # a finished row's routes are gathered before its blocks are freed
            self.routes.new_call()
            sched.on_retire = self.routes.retired
        self._saved = {}
        resumed = self._resume_kept(sched, prompt_ids, sampling.continuations, max_new, sampling.keep_cache) \
            if n == 1 else {}
        parents = [Sequence(row=p * n, prompt_index=p, tokens=list(map(int, ids)), num_prompt=len(ids),
                            max_new=max_new(p * n), n=n) for p, ids in enumerate(prompt_ids) if p not in resumed]
        sched.waiting.extend(parents)
        if sampling.keep_unfinished:  # a row stopped at its cap, not at a forced length (an emulated end)
            caps = sampling.max_new_tokens_per_row
            sched.keep_at_limit = lambda r: max_new(r) >= (caps[r] if caps is not None else sampling.max_new_tokens)
        if sampling.keep_cache:
            sched.keep_at_limit, sched.park_on_stop = (lambda r: True), True
        all_seqs: dict[int, Sequence] = {}
        inflight: list[_InFlight] = []

        def drain():
            while inflight:
                self._process(inflight.pop(), sched, stop)

        sched.drain = drain
        num_steps = num_decode = max_batch = prefill_tokens = 0
        capture_before = self.graphs.capture_s if self.graphs is not None else 0.0
        decode_start = None  # CUDA: an event before the first decode step (stats["decode_gpu_s"])
        first_start = None  # CUDA: an event before the first step (stats["prefill_gpu_s"]: up to the first decode step)
        while sched.has_work() or inflight:
            step = sched.schedule() if sched.has_work() else None
            if step is None:
                if not inflight and sched.waiting and self._let_kept_go(sched):
                    continue
                assert inflight, "scheduler stalled with work left and nothing in flight"
                drain()
                continue
            for s in step.sample_seqs:
                all_seqs[s.row] = s
            num_steps += 1
            num_decode += step.decode
            prefill_tokens += 0 if step.decode else sum(c for _, c in step.chunks)
            max_batch = max(max_batch, len(step.seqs))
            if first_start is None and self.cuda:
                first_start = torch.cuda.Event(enable_timing=True)
                first_start.record()
            if step.decode and decode_start is None and self.cuda:
                decode_start = torch.cuda.Event(enable_timing=True)
                decode_start.record()
            launched = self._launch(step, sched, sampling, gen)
            drain()
            inflight.append(launched)
        decode_gpu_s = prefill_gpu_s = 0.0
        if decode_start is not None:  # GPU time from the first decode step to the last (later prefills included)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            decode_gpu_s = decode_start.elapsed_time(end) / 1e3
            prefill_gpu_s = first_start.elapsed_time(decode_start) / 1e3  # the steps before it: prefill chunks
        rows = [all_seqs[r] for r in range(num_rows)]
        keep = sampling.keep_unfinished or sampling.keep_cache
        handles = self._keep(sched, rows, keep_all=sampling.keep_cache) if keep else None
        held = {b for h in self.kept for b in h.seq.blocks}
        assert self.blocks.num_free == self.num_blocks - 1 - len(held), "KV blocks leaked"
        self.stats.update(num_steps=num_steps, num_decode_steps=num_decode, max_batch=max_batch,
                          prefill_tokens=prefill_tokens, decode_gpu_s=decode_gpu_s,
                          prefill_gpu_s=prefill_gpu_s,
                          num_preempted=sched.num_preempted, num_resumed=len(resumed), num_kept=len(self.kept),
                          prefill_tokens_saved=sum(self._saved.values()),
                          graph_capture_s=(self.graphs.capture_s - capture_before) if self.graphs is not None else 0.0)
        return Generation(
            prompt_index=[r // n for r in range(num_rows)],
            token_ids=[s.tokens[s.num_prompt :] for s in rows],
            logprobs=[s.logprobs for s in rows],
            finish_reason=[s.finish_reason for s in rows],
            handles=handles,
            routed_experts=self.routes.result(rows) if self.routes is not None else None,
        )

    # ---- partial rollouts: rows that keep their KV cache between calls -----------------------------------------
    def _resume_kept(self, sched: Scheduler, prompt_ids, continuations, max_new, extend: bool = False
                     ) -> dict[int, Sequence]:
        """Seat the rows that continue on their kept cache (their last token is fed as a one-token prefill); every
        other kept row lets its blocks go (a kept row lives one call). Returns {prompt: sequence} of those seated.

        `extend` (multi-turn): a continuation's prompt may extend the kept tokens (the new ones are prefilled after
        the cached prefix), and kept rows not continued stay kept, except the oldest ones when this call's prompts
        would not fit beside them."""
        kept, self.kept = self.kept, []
        mine = {id(h) for h in kept}

        def matches(h, ids):
            old = h.seq.tokens
            return len(ids) >= len(old) and ids[:len(old)] == old if extend else old == ids

        wanted = {id(h): p for p, h in enumerate(continuations or [])
                  if id(h) in mine and matches(h, list(map(int, prompt_ids[p])))}
        if extend:  # room for this call: let the oldest idle kept rows go until its prompts' blocks are free
            need = sum(self.blocks.blocks_for(len(ids) + max_new(p)) for p, ids in enumerate(prompt_ids))
            idle = [h for h in kept if id(h) not in wanted]
            while idle and self.blocks.num_free < need:
                h = idle.pop(0)
                self.blocks.release(h.seq.blocks)
                kept.remove(h)
        resumed = {}
        for h in kept:
            p = wanted.get(id(h))
            if p is None and extend:
                self.kept.append(h)
                continue
            if p is None or len(resumed) >= self.max_num_seqs:
                self.blocks.release(h.seq.blocks)
                continue
            seq = h.seq
            tokens = list(map(int, prompt_ids[p]))
            grow = self.blocks.blocks_for(len(tokens)) - len(seq.blocks)  # the last token's K/V is not written
            if grow > self.blocks.num_free:
                self.blocks.release(seq.blocks)
                continue
            seq.blocks += self.blocks.allocate(grow) if grow > 0 else []
            cached = len(seq.tokens) - 1
            seq.tokens = tokens
            seq.row, seq.prompt_index, seq.num_prompt, seq.max_new = p, p, len(seq.tokens), max_new(p)
            seq.logprobs, seq.finish_reason, seq.done_scheduling, seq.n = [], None, False, 1
            seq.prefilled, seq.num_cached, seq.length, seq.resumed = False, cached, len(seq.tokens), True
            seq.slot = sched.free_slots.pop()
            sched._set_blocks(seq)
            sched.running.append(seq)
            resumed[p] = seq
            self._saved[p] = cached
        return resumed

    def _let_kept_go(self, sched: Scheduler) -> bool:
        """Nothing decodes and a waiting prompt lacks the KV blocks that kept caches hold (multi-turn: this call's
        finished rows parked by keep_cache, then idle rows kept from earlier calls): let one go, its row losing its
        cache (a later continuation recomputes it). False when none is held."""
        if sched.parked:
            seq = min(sched.parked, key=lambda q: q.row)
            sched.parked.discard(seq)  # `_keep` then hands back no cache for it
            self.blocks.release(seq.blocks)
            return True
        if self.kept:
            self.blocks.release(self.kept.pop(0).seq.blocks)
            return True
        return False

    def release_kept(self, handles) -> None:
        """Let kept rows go (multi-turn: their trajectories ended); handles already gone are skipped."""
        drop = {id(h) for h in handles if h is not None}
        for h in [h for h in self.kept if id(h) in drop]:
            self.blocks.release(h.seq.blocks)
            self.kept.remove(h)

    def _keep(self, sched: Scheduler, rows: list[Sequence], keep_all: bool = False) -> list:
        """After a call with keep_unfinished: rows that reached their limit without a stop token keep their blocks
        (handles); the rest, parked by the scheduler until their last token was known, let theirs go. `keep_all`
        (keep_cache): every parked row keeps them, whatever ended it."""
        handles = []
        for seq in rows:
            parked = seq in sched.parked
            if parked and (keep_all or seq.finish_reason == "length"):
                self.kept.append(KeptRow(seq))
                handles.append(self.kept[-1])
            else:
                if parked:
                    self.blocks.release(seq.blocks)
                handles.append(None)
        return handles


@register_rollout("native")
def build_native_rollout(cfg, model, *, pad_token_id: int, device: torch.device, max_model_len: int, tp=None):
    """`rollout.name=native`: the engine around the actor's (LoRA-merged) weights, sized by `cfg`; for a model it
    cannot run, the hf backend with one line saying why (fallback.py). `tp` (a `tensor_parallel.TPGroup` of more
    than one rank): this rank's slice of a replica, behind `ReplicaRollout`."""
    from polyrl.rollout.config import DEFAULT_MAX_NUM_SEQS
    from polyrl.utils.device import to_dtype

    from polyrl.models.loader import frozen_weights
    from polyrl.rollout.native.fallback import check_routing_record, fall_back_to_hf

    dtype = torch.float32 if device.type == "cpu" else to_dtype(cfg.dtype, "actor_rollout_ref.rollout.dtype")
    record = bool(getattr(cfg, "enable_rollout_routing_replay", False))  # R3 (moe.py's RouteRecorder)
    try:  # an unsupported model is refused before any weight is copied
        check_routing_record(cfg, ModelSpec.from_hf_config(model.config), record)
        engine = NativeEngine.from_hf(
            model if tp is not None else _merged_view(model), device=device, dtype=dtype,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_num_seqs=cfg.max_num_seqs or DEFAULT_MAX_NUM_SEQS, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len or max_model_len, enforce_eager=cfg.enforce_eager, seed=cfg.seed,
            kv_cache_dtype=cfg.kv_cache_dtype, quantization=cfg.quantization, record_routes=record, tp=tp,
            share=frozen_weights(model) if tp is None and isinstance(model, torch.nn.Module) else None,
            **(cfg.engine_kwargs.get("native") or {}))
    except UnsupportedModel as why:
        return fall_back_to_hf(cfg, model, why, record_routes=record, pad_token_id=pad_token_id, device=device,
                               max_model_len=max_model_len)
    if tp is not None and tp.size > 1:
        from polyrl.rollout.native.tensor_parallel import ReplicaRollout

        return ReplicaRollout(engine, tp)
    return engine


def shared_weight_bytes(cfg, model, device: torch.device) -> int:
    """Bytes of `model`'s frozen weights that `build_native_rollout` (rollout config `cfg`) on `device` would use in
    place rather than copy (`NativeEngine.from_hf(share=)`): what the memory planner takes off the engine's replica."""
    from polyrl.models.loader import frozen_weights
    from polyrl.utils.device import to_dtype

    if cfg.quantization is not None or (cfg.tensor_model_parallel_size or 1) > 1:
        return 0
    try:
        spec = ModelSpec.from_hf_config(model.config)
    except UnsupportedModel:
        return 0
    with torch.device("meta"):
        meta = CausalLM(spec)
    dtype = torch.float32 if device.type == "cpu" else to_dtype(cfg.dtype, "actor_rollout_ref.rollout.dtype")
    used = shared_weights(meta.to(dtype), frozen_weights(model), dtype, device)
    return sum(t.numel() * t.element_size() for t in used.values())


class _MergedLoRAView:
    """What `NativeEngine.from_hf` reads from an HF model (config, rope, parameters, state dict), for a peft model:
    the base model's attributes with the LoRA adapters merged into the weights, under plain HF names."""

    def __init__(self, peft_model):
        from polyrl.models.loader import merged_state_dict

        self._base = peft_model.get_base_model()
        self._state = merged_state_dict(peft_model)

    def state_dict(self):
        return self._state

    def __getattr__(self, name):
        return getattr(self._base, name)


def _merged_view(model):
    from peft import PeftModel

    return _MergedLoRAView(model) if isinstance(model, PeftModel) else model
