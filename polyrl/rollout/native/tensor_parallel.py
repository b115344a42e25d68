"""Tensor parallelism for the native engine, applied from outside the model (`shard_model(model, tp)`).

One rollout replica spans `tp.size` GPUs (`actor_rollout_ref.rollout.tensor_model_parallel_size`); replicas are
data-parallel. The model code stays single-GPU: `shard_model` swaps each block's projections for their local slice,
rewrites the model's `spec` to the local shape (so the engine allocates a KV cache of its own kv heads only, and
the HF-name loader maps onto local sizes), and adds the all-reduce as a forward hook on the two row-parallel layers.

The split is Megatron's:
- `qkv` and `gate_up` are column-parallel: rank r keeps q heads [r*H/N, (r+1)*H/N), kv heads likewise, and the
  matching gate and up rows. Attention is per head, so RoPE, q/k norms, the paged cache writes and the decode
  kernels run unchanged on the local heads (the fused RoPE paths included).
- `o` and `down` are row-parallel (their input columns split the same way); each gives a partial sum, and one
  all-reduce per attention block and one per MLP block (a forward hook on `o` and `down`) makes it whole. Hooks fire
  on both the plain and the fused forward, and inside CUDA-graph capture (`dist.all_reduce` on NCCL is capturable
  in torch >= 2.x; the graph's warm-up run creates the communicator before capture).
- The embedding and the LM head are replicated. Why: after the all-reduce every rank holds the same hidden state,
  so a replicated head gives every rank the same logits and the same sampled token from the same seed, with no
  collective at the head. The cost is V*D bytes read per decode step on each rank (1.55 GB at Qwen3-32B, about 9%
  of a TP4 rank's 16 GB of layer weights); a vocab-parallel head would read V*D/N instead but all-gather [B, V]
  logits every step (78 MB at 256 rows in bf16), which at the batch sizes RL decodes costs about as much, and it
  needs a sampler over sharded logits. Ranks still broadcast group rank 0's sampled ids and log-probs after each
  step (`same_tokens`, 12 bytes a row): a single diverging token would desynchronise the schedulers and hang the
  collectives, so agreement is enforced, not assumed.
- Fused paths: the fused RoPE (rope_kv, paged_decode_rope) and FP8-fed inputs (add_rmsnorm / silu_mul handing
  `FP8Rows` on) work on the local shapes unchanged. The down projection's partial products (bf16 `SLICED_DOWN`,
  FP8 `PARTIALS`, summed by the next add_rmsnorm) are turned off: the all-reduce needs one output tensor, and
  reducing every partial would move `parts` times the bytes. Their launch tables are keyed by the full models'
  shapes anyway.
- FP8 weights: `quantize_model` runs after sharding (the engine's `__init__`), so every e4m3 row is scaled by its
  local slice; `update_weights` slices before quantising (`local_tensors`).

MoE layers (moe.py) are split along the experts' intermediate dimension, not expert-parallel: each rank keeps
columns [r*I/N, (r+1)*I/N) of every expert (`Experts.narrow_intermediate`: those gate and up rows of each expert's
[2I, H] `gate_up`, the matching columns of its [H, I] `down`), and Qwen2-MoE's shared expert is cut like a dense MLP.
The router (HF `mlp.gate`) and the shared expert's sigmoid gate are replicated. Why this over expert parallelism:
after the attention all-reduce every rank holds the same hidden state, so the replicated router picks the same top-k
on every rank, and each rank computes its slice of every chosen expert; there is no all-to-all dispatch and combine,
no load imbalance between ranks (a hot expert costs every rank the same 1/N), and every shape depends on the token
count only, so CUDA graphs capture the MoE step as they do a dense one. The block ends with one all-reduce (a forward
hook on the MoE module) over the sum of the routed experts' partial output and the shared expert's partial output:
the shared gate sigmoid(g(x)) is computed from the replicated x and scales a partial sum, which is linear, so the
sum over ranks of (experts_r + gate * shared_r) is the whole output, counted once; neither `down` has a hook of its
own. Routes (R3) are recorded on every rank before that all-reduce and are equal across ranks (same input, same
router); `ReplicaRollout` hands back the rows of this rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from polyrl.errors import ConfigError
from polyrl.rollout.native.moe import MoE

# The all-reduce of decode-sized messages (rows x hidden, 2.6 MB at 256 rows of a 32B): "nccl" (default;
# `dist.all_reduce`, captured in the decode graphs) or an experiment, "symm_one" / "symm_two": torch's
# symmetric-memory one-shot / two-shot all-reduce over NVLink peer access (`SymmAllReduce`), for messages up to
# SYMM_MAX_ROWS rows; larger ones (prefill chunks) stay on NCCL. `benchmarks/tp_decode.py --allreduce` times all three
# at the decode message size and end to end; the loser goes once measured.
ALLREDUCE = os.environ.get("POLYRL_TP_ALLREDUCE", "nccl")
SYMM_MAX_ROWS = 1024


@dataclass
class TPGroup:
    """The ranks of one rollout replica: `size` consecutive ranks, this process being `rank` among them."""

    rank: int = 0
    size: int = 1
    group: object = None  # torch ProcessGroup (None: one process)
    src: int = 0  # global rank of the group's rank 0 (broadcast source)

    @classmethod
    def consecutive(cls, size: int) -> "TPGroup":
        """Groups of `size` consecutive ranks over the whole job (every rank must call this: `new_group` is
        collective). With one process, or size 1, a group of one."""
        if size == 1 or not dist.is_initialized():
            assert size == 1, f"tensor parallel size {size} needs a process group"
            return cls()
        world, me = dist.get_world_size(), dist.get_rank()
        assert world % size == 0, (world, size)
        mine = None
        for first in range(0, world, size):
            g = dist.new_group(list(range(first, first + size)))
            if first <= me < first + size:
                mine = cls(rank=me - first, size=size, group=g, src=first)
        return mine

    @property
    def index(self) -> int:
        """Which replica this rank belongs to (the group's first global rank / size)."""
        return self.src // self.size

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def min_int(self, x: int) -> int:
        """The smallest of every rank's `x` (KV block counts must agree: the schedulers run in lockstep)."""
        if self.size == 1:
            return x
        t = torch.tensor([x], dtype=torch.long, device=_collective_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast_(self, *ts: torch.Tensor) -> None:
        if self.size > 1:
            for t in ts:
                dist.broadcast(t, src=self.src, group=self.group)


def _collective_device(group) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")


def _split_dims(spec) -> tuple[tuple[str, int], ...]:
    """The dims each rank holds an equal share of: heads, kv heads, the dense MLP, the experts' and the shared
    expert's intermediate (0 where the model has none; a MoE model's dense width only where a layer is dense)."""
    dense = len(getattr(spec, "moe_layers", ())) < getattr(spec, "num_layers", 1)
    return (("num_attention_heads", spec.num_heads), ("num_key_value_heads", spec.num_kv_heads),
            ("intermediate_size", spec.intermediate_size if dense else 0),
            ("moe_intermediate_size", getattr(spec, "moe_intermediate_size", 0)),
            ("shared_expert_intermediate_size", getattr(spec, "shared_expert_intermediate_size", 0)))


def check_divides(spec, size: int) -> None:
    """Refuse a TP size that does not split the heads, kv heads, MLP and experts evenly (one sentence, the fix)."""
    key = f"actor_rollout_ref.rollout.tensor_model_parallel_size={size}"
    for what, n in _split_dims(spec):
        if n % size:
            raise ConfigError(f"{key} does not divide the model's {what}={n} (each rank holds an equal share); use "
                              f"a divisor of {n}.")


def local_spec(spec, size: int):
    """The shape one rank holds: heads, kv heads, MLP and expert widths divided by `size` (the rest replicated)."""
    return dataclasses.replace(spec, num_heads=spec.num_heads // size, num_kv_heads=spec.num_kv_heads // size,
                               intermediate_size=spec.intermediate_size // size,
                               moe_intermediate_size=spec.moe_intermediate_size // size,
                               shared_expert_intermediate_size=spec.shared_expert_intermediate_size // size)


def _rows(t: torch.Tensor, parts: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t[lo:hi] for lo, hi in parts])


class TensorParallel:
    """What `shard_model` returns: the group, the full and local shapes, and `local_tensors` (HF tensors -> this
    rank's slices, for `load_hf_weights`)."""

    def __init__(self, tp: TPGroup, full_spec, shard_spec):
        self.group, self.full, self.local = tp, full_spec, shard_spec

    def _split(self, name: str) -> tuple[int, int, int] | None:
        """(dim, local length, halves) of the HF tensor `name` that this rank slices, or None when it is replicated.
        halves=2: the dim holds two stacked parts (HF's fused `experts.gate_up_proj`, [E, 2I, H], gate rows then
        up rows), each cut the same way."""
        if ".layers." not in name:
            return None
        s = self.local
        q, kv, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
        moe, shared = s.moe_intermediate_size, s.shared_expert_intermediate_size
        if name.endswith(".experts.gate_up_proj"):
            return 1, moe, 2
        if name.endswith(".experts.down_proj"):
            return 2, moe, 1
        if ".shared_expert." in name:
            inter = shared
        elif ".experts." in name:  # per-expert names: experts.N.{gate,up,down}_proj.weight
            inter = moe
        kind = ".".join(name.rsplit(".", 2)[-2:])  # e.g. q_proj.weight; the router and the shared gate: replicated
        table = {"q_proj.weight": (0, q), "q_proj.bias": (0, q), "k_proj.weight": (0, kv), "k_proj.bias": (0, kv),
                 "v_proj.weight": (0, kv), "v_proj.bias": (0, kv), "o_proj.weight": (1, q),
                 "gate_proj.weight": (0, inter), "up_proj.weight": (0, inter), "down_proj.weight": (1, inter)}
        split = table.get(kind)
        return None if split is None else (*split, 1)

    def local_tensor(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full HF tensor `name` (the tensor itself where replicated)."""
        split = self._split(name)
        if split is None:
            return t
        dim, n, halves = split
        size, r = self.group.size, self.group.rank
        assert t.shape[dim] == n * size * halves, (name, tuple(t.shape), n, size)
        if halves > 1:
            return torch.cat([t.narrow(dim, h * n * size + r * n, n) for h in range(halves)], dim=dim)
        piece = t.narrow(dim, r * n, n)
        return piece.contiguous() if dim else piece  # column slices: the FP8 quantiser wants rows in one piece

    def local_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            yield name, self.local_tensor(name, t)

    def same_tokens(self, tok: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Group rank 0's sampled ids and log-probs on every rank, in place (module docstring)."""
        self.group.broadcast_(tok, logprobs)


def shard_model(model, tp: TPGroup, log=print) -> TensorParallel:
    """Cut `model` (a `model.CausalLM`, on any device, meta included) down to this rank's slice in place and add the
    row-parallel all-reduces; returns the `TensorParallel` the engine loads weights through. Call before
    `quantize_model` (FP8 scales are per local row)."""
    full = model.spec
    check_divides(full, tp.size)
    s = local_spec(full, tp.size)
    r, hd = tp.rank, full.head_dim
    q, kv, inter = s.num_heads * hd, s.num_kv_heads * hd, s.intermediate_size
    Q, KV = full.num_heads * hd, full.num_kv_heads * hd
    qkv_rows = [(r * q, (r + 1) * q), (Q + r * kv, Q + (r + 1) * kv), (Q + KV + r * kv, Q + KV + (r + 1) * kv)]
    reduce = _ReduceOutput(tp, SymmAllReduce(tp, ALLREDUCE, SYMM_MAX_ROWS * full.hidden_size)
                           if tp.size > 1 and ALLREDUCE != "nccl" else None)
    with torch.no_grad():
        for blk in model.layers:
            a, m = blk.attn, blk.mlp
            a.qkv = _linear(_rows(a.qkv.weight, qkv_rows), _rows(a.qkv.bias, qkv_rows) if a.qkv.bias is not None
                            else None)
            a.o = _linear(a.o.weight[:, r * q:(r + 1) * q], None)
            a.num_heads, a.num_kv_heads, a.q_size, a.kv_size = s.num_heads, s.num_kv_heads, q, kv
            if isinstance(m, MoE):  # one all-reduce on the block's output: routed + gated shared partials
                n = s.moe_intermediate_size
                m.experts.narrow_intermediate(r * n, (r + 1) * n)
                if m.shared is not None:
                    _split_mlp(m.shared, r, s.shared_expert_intermediate_size)
                last = m
            else:
                _split_mlp(m, r, inter)
                last = m.down
            if tp.size > 1:
                a.o.register_forward_hook(reduce)
                last.register_forward_hook(reduce)
    model.spec = s
    model._targets = None  # HF-name targets are rebuilt for the local shapes on the next load
    if tp.size > 1 and getattr(model, "split_down", False):
        model.split_down = False
        if tp.rank == 0:
            log(f"polyrl: tensor parallel {tp.size}: the down projection's split-K partials are off (the all-reduce "
                "needs one output per block)")
    return TensorParallel(tp, full, s)


def _split_mlp(m, r: int, inter: int) -> None:
    """A gated-SiLU MLP (dense, or the shared expert) cut to gate and up rows [r*inter, (r+1)*inter) and the
    matching down columns; `inter` is the local width."""
    full = m.inter
    rows = [(r * inter, (r + 1) * inter), (full + r * inter, full + (r + 1) * inter)]
    m.gate_up = _linear(_rows(m.gate_up.weight, rows), None)
    m.down = _linear(m.down.weight[:, r * inter:(r + 1) * inter], None)
    m.inter = inter


class _ReduceOutput:
    """Forward hook: sum a row-parallel layer's partial output over the group, in place."""

    def __init__(self, tp: TPGroup, symm: "SymmAllReduce | None" = None):
        self.tp, self.symm = tp, symm

    def __call__(self, module, args, out):
        if self.symm is not None and self.symm.serves(out):
            return self.symm(out)
        return self.tp.all_reduce_(out)


class SymmAllReduce:
    """In-place sum over the group through a symmetric-memory buffer (torch.distributed._symmetric_memory): the
    message is copied into this rank's buffer, then `one_shot_all_reduce_out` (each rank reads every peer's buffer
    and sums) or `two_shot_all_reduce_` (reduce-scatter + all-gather through the buffers) writes the sum. The buffer
    is allocated and exchanged (a collective) on the first CUDA call, which every rank makes at the same point
    (the engine's profiling prefill), never inside graph capture."""

    def __init__(self, tp: TPGroup, kind: str, max_numel: int):
        if kind not in ("symm_one", "symm_two"):
            raise ConfigError(f"POLYRL_TP_ALLREDUCE={kind!r} is not an all-reduce; use nccl, symm_one or symm_two.")
        self.tp, self.kind, self.max_numel = tp, kind, max_numel
        self.buf = None

    def serves(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.is_contiguous() and x.numel() <= self.max_numel

    def _setup(self, x: torch.Tensor) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        name = self.tp.group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(name)
        self.buf = symm_mem.empty(self.max_numel, dtype=x.dtype, device=x.device)
        symm_mem.rendezvous(self.buf, self.tp.group)
        self.group_name = name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.buf is None:
            self._setup(x)
        flat = x.view(-1)
        part = self.buf[: flat.numel()]
        part.copy_(flat)
        if self.kind == "symm_one":
            torch.ops.symm_mem.one_shot_all_reduce_out(part, "sum", self.group_name, flat)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(part, "sum", self.group_name)
            flat.copy_(part)
        return x


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                    dtype=weight.dtype)
    lin.weight.data = weight.contiguous()
    if bias is not None:
        lin.bias.data = bias.contiguous()
    return lin


@dataclass(frozen=True)
class Kept:
    """A replica's kept KV cache of one row, as its callers hold it (`Generation.handles`, `continuations`): a number
    every rank of the group maps to its own engine's `KeptRow` (they keep the same rows: their calls are the same)."""

    key: int


class ReplicaRollout:
    """The rollout interface for one rank of a TP replica: the group's ranks each bring their own prompts (the
    trainer deals prompts to every rank as in data-parallel rollout), the replica generates all of them in one
    engine call on every rank of the group, and each rank gets back its own rows. So the trainer, FSDP over all
    ranks, is unchanged. Everything else passes through to the engine.

    Kept caches (partial rollouts, multi-turn) are `Kept` numbers, given out in the same order on every rank, so a
    continuation named on one rank finds each rank's own cache of that row; `release_kept` is collective.

    Work whose engine calls one rank decides alone (agent loops, whose turns wait on tools; partial rollouts, whose
    loop runs until enough groups finish) runs on the group's rank 0: inside `lead()` each call below that it makes
    is announced to the other ranks, which `follow()` it with no rows of their own until it leaves."""

    _ROW_FIELDS = ("forced_lengths", "max_new_tokens_per_row", "continuations")

    def __init__(self, engine, tp: TPGroup):
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "tp", tp)
        object.__setattr__(self, "by_key", {})  # Kept.key -> this rank's engine KeptRow
        object.__setattr__(self, "num_keys", 0)  # keys given out so far
        object.__setattr__(self, "leading", False)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __setattr__(self, name, value):
        setattr(self.engine, name, value)

    # ---- collective calls: every rank of the group makes them, in the same order --------------------------------
    def generate(self, prompt_ids, sampling):
        from polyrl.rollout.base import Generation

        self._announce("generate")
        box = self._gather((list(prompt_ids), sampling))
        counts = [len(p) for p, _ in box]
        bringing = [sp for ps, sp in box if ps]
        if not bringing:
            return Generation(prompt_index=[], token_ids=[], logprobs=[], finish_reason=[])
        merged = dataclasses.replace(bringing[0])  # the first rank with rows: its settings (seed included) for all
        for f in self._ROW_FIELDS:
            lists = [getattr(sp, f) for sp in bringing]
            if any(x is not None for x in lists):
                assert all(x is not None for x in lists), f"{f} set on some ranks of a TP group only"
                setattr(merged, f, [v for x in lists for v in x])
        if merged.continuations is not None:  # each rank continues on its own cache of the named rows
            merged.continuations = [None if h is None else self.by_key.get(h.key) for h in merged.continuations]
        out = self.engine.generate([p for ps, _ in box for p in ps], merged)
        if out.handles is not None:
            out.handles = [None if h is None else self._key(h) for h in out.handles]
        live = {id(h) for h in self.engine.kept}  # a cache the engine let go (continued, evicted) is gone
        object.__setattr__(self, "by_key", {k: h for k, h in self.by_key.items() if id(h) in live})
        return prompt_rows(out, sum(counts[: self.tp.rank]), counts[self.tp.rank], merged.n)

    def release_kept(self, handles) -> None:
        self._announce("release_kept")
        box = self._gather([h.key for h in handles if h is not None])
        self.engine.release_kept([self.by_key.pop(k) for keys in box for k in keys if k in self.by_key])

    def resume(self) -> None:
        self._announce("resume")
        self.engine.resume()

    def release_memory(self, offload_weights: bool = False) -> None:
        self._announce("release_memory", offload_weights)
        self.engine.release_memory(offload_weights)
        object.__setattr__(self, "by_key", {})  # the engine let every kept cache go

    def _gather(self, obj) -> list:
        box = [None] * self.tp.size
        dist.all_gather_object(box, obj, group=self.tp.group)
        return box

    def _key(self, row) -> Kept:
        key = Kept(self.num_keys)
        object.__setattr__(self, "num_keys", self.num_keys + 1)
        self.by_key[key.key] = row
        return key

    # ---- one rank drives, the others follow ------------------------------------------------------------------
    def _announce(self, *op) -> None:
        if self.leading:
            self._broadcast(op)

    def _broadcast(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=self.tp.src, group=self.tp.group)
        return box[0]

    @contextlib.contextmanager
    def lead(self):
        """On the group's rank 0, while the others are in `follow()`: its engine calls go to every rank."""
        assert self.tp.rank == 0 and not self.leading
        object.__setattr__(self, "leading", True)
        try:
            yield self
        finally:
            self._announce("end")
            object.__setattr__(self, "leading", False)

    def follow(self) -> None:
        """On the group's other ranks: make each call rank 0 makes inside `lead()`, with no rows of their own."""
        from polyrl.rollout.base import SamplingParams

        while True:
            op, *args = self._broadcast()
            if op == "end":
                return
            if op == "generate":
                self.generate([], SamplingParams())
            elif op == "release_kept":
                self.release_kept([])
            else:
                getattr(self, op)(*args)

    def run_led(self, items: list, run):
        """`run(self, all_items)` on rank 0 over the items of every rank (in rank order), the other ranks following
        its engine calls; each rank gets back `prompt_rows` of the result (prompt-major rows) for its own items. A
        failure on rank 0 ends the call on every rank with that error. Inside `lead()` rank 0 already drives: `run`
        runs there over its own items (the other ranks bring none)."""
        if self.leading:
            return run(self, list(items))
        box = self._gather(list(items))
        counts = [len(b) for b in box]
        if self.tp.rank != 0:
            self.follow()
            parts = self._broadcast()
            if isinstance(parts, BaseException):
                raise parts
            return parts[self.tp.rank]
        try:
            with self.lead():
                out = run(self, [x for b in box for x in b])
        except Exception as e:
            self._broadcast(e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}"))
            raise
        n = len(out.prompt_index) // max(1, sum(counts))
        parts = [prompt_rows(out, sum(counts[:r]), c, n) for r, c in enumerate(counts)]
        self._broadcast(parts)
        return parts[0]


def _picklable(obj) -> bool:
    import pickle

    try:
        pickle.dumps(obj)
        return True
    except Exception:
        return False


def prompt_rows(out, first: int, count: int, n: int):
    """The rows of prompts [first, first + count) of a prompt-major generation with `n` rows a prompt, renumbered
    from 0."""
    from polyrl.rollout.base import select_rows

    lo, hi = first * n, (first + count) * n
    return select_rows(out, range(lo, hi), [i - first for i in out.prompt_index[lo:hi]])
