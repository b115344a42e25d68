"""Memory-aware defaults: token budgets, gradient checkpointing, compile, the engine's memory share and whether it
keeps its KV cache through the update.

Every key handled here defaults to None ("auto"); an explicit user value is never touched. `plan_memory` reads the
model's shape, the sequence lengths and the memory actually free on the device (after the policy is loaded: on the
GPU with one process, in host memory with several, where each GPU gets FSDP2 shards and the engine's copy), picks
a value for each auto key, writes it into the config and prints it once with its reason.

The memory model (bytes on one device during the update; the engine's KV cache is released by then):
- static: Adam state and gradients (3 x master bytes per trainable parameter), a reference copy, the engine's bf16
  weights, a critic, and the LM head's chunk workspace (`logprob_chunk_size` x vocab logits);
- per token of a micro-batch: each decoder layer keeps `2 (6h + 3i)` bytes of activations with compiled layers in
  bf16 autocast (q/k/v/o, norms, gate/up/act), x1.4 eager (unfused elementwise ops save more); with gradient
  checkpointing only each layer's fp32 input stays (4h), plus one layer re-run in backward.
Checked against the benchmarks (H200, Qwen2.5-1.5B, compiled, no checkpointing: budget 49152 peaked at 122.8 GiB and
65536 ran out; the H100 fits 24576 and not 49152, issue 18): 1.93 MiB per token here, 1.96 measured; eager/compiled
1.4 from NOTES_training.md (86.6 / 60.5 GiB). A wrong guess costs one retry, not the run (trainer/oom.py halves the
budget on an out-of-memory error). With several processes an OOM cannot be retried (one rank alone cannot leave the
collectives), so the spare memory is scaled by `MULTI_PROCESS_SAFETY` there.

On CPU (tests) the same arithmetic runs on host memory; `device_memory` is the one function to replace in a test.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from polyrl.learner.flops import peak_flops as device_peak_flops
from polyrl.rollout.config import DEFAULT_MAX_NUM_SEQS

GiB = 2**30
MAX_UPDATE_TOKENS = 49152  # the best hand-tuned H200 rows' budget; past it, bigger micro-batches gain nothing
MAX_LOGPROB_TOKENS = 65536  # no-grad passes keep one layer's activations at a time
MIN_FAST_TOKENS = 8192  # below this many tokens per micro-batch, checkpointing beats tiny micro-batches
EAGER_ACTIVATION_RATIO = 1.4  # NOTES_training.md: 86.6 vs 60.5 GiB peak, eager vs compiled
CHECKPOINT_SAFETY = 1.5  # the re-run layer's transient buffers, unmeasured: err on the small side
HEADROOM = 0.10  # of total memory, for the allocator's fragmentation and CUDA context growth
MEASURED_HEADROOM = 0.05  # of total memory, above a measured peak (allocator overhead; expandable segments keep it low)
COMPILE_MIN_UPDATE_S = 1.0  # estimated update compute per step below which a cold compile (~20 s) does not pay
COMPILE_ESTIMATE_MFU = 0.35  # for that estimate: the update's typical model-FLOPs utilisation (the benchmarks)
MAX_AUTO_NUM_SEQS = 1024  # auto seats (CUDA graphs are captured up to this batch)
MULTI_PROCESS_SAFETY = 0.75  # of the spare memory with several processes: there an OOM cannot be retried (oom.py)


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes on `device`; host memory for CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    try:
        size = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * size, os.sysconf("SC_PHYS_PAGES") * size
    except (ValueError, OSError):  # no such sysconf name (macOS): on CPU the numbers only cap the budgets
        return 8 * GiB, 16 * GiB


@dataclass(frozen=True)
class ModelShape:
    """What memory depends on: the decoder's dims and parameter counts."""

    hidden: int
    intermediate: int
    num_layers: int
    vocab: int
    kv_bytes_per_token: int  # bf16 K and V over all layers
    num_params: int
    num_trainable: int
    param_bytes: int  # bytes per master weight
    # MoE: every expert's intermediate width and the shared expert's (0: dense); tensor parallelism splits both, and
    # num_params counts every expert (all of them sit in each engine replica, 1/N of each per TP rank)
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    # MoE: the tensors a token's routing adds per layer (router logits, its top_k copies of the hidden state and of
    # the expert outputs in the grouped GEMMs), bf16 bytes; `intermediate` is then the active width (top_k experts)
    moe_bytes_per_token: int = 0
    num_active: int | None = None  # parameters one token passes through (MoE: top_k of the experts); None: all
    # MoE full fine-tuning: the bf16 copies autocast makes of the fp32 routed experts, which the grouped GEMMs save
    # for backward: every layer's without checkpointing (a 12-layer 30B-A3B: 13 GiB the per-token activations miss;
    # a dense layer's casts are within the calibrated activation ratios), one layer's with it
    expert_cast_bytes: int = 0
    # bytes per trained weight, where they differ from `param_bytes` (LoRA: peft's fp32 adapters on a bf16 base); 0:
    # the same. A trained weight's gradient and AdamW's two moments take its dtype: 3x these bytes (`state_bytes`)
    trainable_bytes: int = 0

    @property
    def state_bytes(self) -> int:
        """Gradients and AdamW's two moments of every trained weight, unsharded."""
        return self.num_trainable * 3 * (self.trainable_bytes or self.param_bytes)

    @classmethod
    def of(cls, model) -> "ModelShape":
        from polyrl.learner.flops import is_sparse_layer, mlp_active_intermediate
        from polyrl.models.moe import expert_parameters, parameter_counts

        c = model.config
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        params = list(model.parameters())
        L = c.num_hidden_layers
        sparse = [i for i in range(L) if is_sparse_layer(c, i)]
        inter = getattr(c, "intermediate_size", None) or 4 * c.hidden_size
        moe_bytes = 0
        if sparse:  # activations scale with the active width; averaged over the layers
            inter = sum(mlp_active_intermediate(c, i) for i in range(L)) // L
            moe_bytes = 2 * (2 * c.num_experts_per_tok * c.hidden_size + c.num_experts) * len(sparse) // L
        total, active = parameter_counts(model)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        trained_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", 0) or 0
        return cls(hidden=c.hidden_size, intermediate=inter, num_layers=L,
                   vocab=c.vocab_size, kv_bytes_per_token=2 * L * kv_heads * head_dim * 2,
                   num_params=sum(p.numel() for p in params),
                   num_trainable=trainable,
                   param_bytes=params[0].element_size(),
                   trainable_bytes=trained_bytes // trainable if trainable else 0,
                   moe_intermediate=getattr(c, "moe_intermediate_size", 0) if experts else 0,
                   shared_intermediate=(getattr(c, "shared_expert_intermediate_size", 0) or 0) if experts else 0,
                   moe_bytes_per_token=moe_bytes, num_active=min(trainable, active) if sparse else None,
                   expert_cast_bytes=2 * sum(p.numel() for p in expert_parameters(model)
                                             if p.requires_grad and p.dtype == torch.float32))


def layer_activation_bytes(shape: ModelShape) -> int:
    """Bytes per token one compiled decoder layer saves for backward (bf16 autocast, no checkpointing)."""
    return 2 * (6 * shape.hidden + 3 * shape.intermediate) + shape.moe_bytes_per_token


def update_bytes_per_token(shape: ModelShape, *, checkpointing: bool, compiled: bool) -> float:
    layer = layer_activation_bytes(shape) * (1.0 if compiled else EAGER_ACTIVATION_RATIO)
    if checkpointing:
        return (shape.num_layers * 4 * shape.hidden + layer) * CHECKPOINT_SAFETY
    return shape.num_layers * layer


def logprob_bytes_per_token(shape: ModelShape) -> float:
    """A no-grad pass: the residual stream plus one layer's transient activations."""
    return 2 * 4 * shape.hidden + layer_activation_bytes(shape)


@dataclass(frozen=True)
class Choice:
    key: str
    value: object
    reason: str


def _round_down(tokens: float, floor: int, cap: int) -> int:
    return int(max(floor, min(cap, tokens // 1024 * 1024)))


def update_seconds_estimate(shape: ModelShape, tokens: int, peak_flops: float) -> float:
    """Seconds of one update's compute for `tokens` tokens: 6 FLOPs per trainable parameter and token (forward +
    backward) at `COMPILE_ESTIMATE_MFU` of the device's dense bf16 peak. Inf when the peak is unknown."""
    if peak_flops <= 0:
        return float("inf")
    active = shape.num_active if shape.num_active is not None else shape.num_trainable
    return 6 * active * tokens / (COMPILE_ESTIMATE_MFU * peak_flops)


def compile_choice(shape: ModelShape, *, cuda: bool, tokens_per_step: int, peak_flops: float) -> Choice:
    """Compiled layers run the update ~26% faster on CUDA (NOTES_training.md, 1.5B) but the first step pays a cold
    compile (~20 s on an H100: step 1 of SmolLM2-135M took 20.6 s against 0.3 s after). So: compile when one step's
    update compute is large enough that the gain repays it within a short run."""
    key = "actor_rollout_ref.actor.use_torch_compile"
    if not cuda:
        return Choice(key, False, "CPU: compiling costs more than it saves on small runs")
    est = update_seconds_estimate(shape, tokens_per_step, peak_flops)
    if est >= COMPILE_MIN_UPDATE_S:
        about = "" if est == float("inf") else f", ~{est:.1f} s of update compute per step"
        return Choice(key, True, f"CUDA{about}: compiled layers are ~26% faster and keep ~30% less activation memory")
    return Choice(key, False, f"CUDA, but only ~{est:.2f} s of update compute per step: a cold compile (~20 s) would "
                              "cost more than it saves")


def choose(shape: ModelShape, *, device: torch.device, free: int, total: int, max_seq_len: int, num_rollout_rows: int,
           engine_on_device: bool, extra_static: int, world_size: int, compile_layers: bool | None,
           checkpointing: bool | None, update_tokens: int | None = None, chunk_size: int = 2048,
           peak_flops: float = 0.0, trains: bool = True, engine_bytes: int | None = None,
           tp_size: int = 1, engine_auto: bool = False) -> dict[str, Choice]:
    """The auto values (pure function of the numbers; keys are the short names of `plan_memory`'s keys).
    `trains=False`: a process that only generates (the off-policy rollout GPU) holds no optimizer state.

    `free` is measured with the policy loaded; `extra_static` counts copies the caller knows of (reference, critic,
    rollout replica) in bytes. A user's `update_tokens` budget is kept; checkpointing is then on iff it does not fit
    without. `peak_flops` (the device's dense bf16 peak; 0: unknown) sizes the compile decision. `engine_bytes`:
    the engine's weights on this GPU where they are not a bf16 replica (a tensor-parallel slice); `tp_size`: GPUs
    per replica (its engine generates the rows of `tp_size` ranks, each rank holding 1/tp_size of their KV).
    `engine_auto`: the engine's share is ours to pick, so where its weights and one full-length row's KV cache do
    not fit beside the trainer the run is refused here (ConfigError), not by the engine after planning."""
    cuda = device.type == "cuda"
    out: dict[str, Choice] = {}
    if compile_layers is None:
        out["compile"] = compile_choice(shape, cuda=cuda, tokens_per_step=num_rollout_rows * max_seq_len,
                                        peak_flops=peak_flops)
        compile_layers = out["compile"].value
    engine = (shape.num_params * 2 if engine_bytes is None else engine_bytes) if engine_on_device else 0
    optimizer = shape.state_bytes // max(1, world_size) if trains else 0
    head = chunk_size * shape.vocab * 8  # fp32 logits + bf16 grads of one chunk, and the matmul's output
    static = optimizer + engine + head + extra_static
    spare = free - HEADROOM * total - static
    if world_size > 1:  # 2 H100s, 1.5B, 4k responses: the unscaled budget (23552) stopped the run at step 2
        spare *= MULTI_PROCESS_SAFETY
    gib = f"{free / GiB:.1f} GiB free of {total / GiB:.1f}, {static / GiB:.1f} GiB more for optimizer/engine/copies"
    floor = max_seq_len  # one whole sequence must fit a micro-batch
    casts = {False: shape.expert_cast_bytes, True: shape.expert_cast_bytes // max(1, shape.num_layers)}
    if checkpointing is None:
        fast = (spare - casts[False]) / update_bytes_per_token(shape, checkpointing=False, compiled=compile_layers)
        # enough tokens per micro-batch to keep the GEMMs efficient, and one whole sequence: at long context a single
        # sequence already is a large micro-batch, and checkpointing would re-run every layer (~1/3 more compute)
        want = update_tokens or max(MIN_FAST_TOKENS, max_seq_len)
        checkpointing = fast < want
        out["checkpointing"] = Choice(
            "actor_rollout_ref.model.enable_gradient_checkpointing", checkpointing,
            f"without it {max(0, int(fast))} tokens fit per micro-batch, {want} wanted ({gib})" if checkpointing
            else f"{int(min(fast, 1e9))} tokens fit per micro-batch without it, {want} wanted ({gib})")
    per_token = update_bytes_per_token(shape, checkpointing=checkpointing, compiled=compile_layers)
    spare -= casts[bool(checkpointing)]
    budget = _round_down(spare / per_token, floor, MAX_UPDATE_TOKENS)
    out["update_tokens"] = Choice(
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", budget,
        f"{per_token / 2**10:.1f} KiB of activations per token, {gib}"
        + (f"; capped at {MAX_UPDATE_TOKENS}" if budget == MAX_UPDATE_TOKENS else "")
        + ("; raised to one whole sequence (may not fit)" if budget == floor and spare / per_token < floor else ""))
    lp = _round_down(spare / logprob_bytes_per_token(shape), floor, MAX_LOGPROB_TOKENS)
    out["logprob_tokens"] = Choice("log_prob_max_token_len_per_gpu", lp,
                                   f"{logprob_bytes_per_token(shape) / 2**10:.1f} KiB per token without gradients")
    if engine_on_device:
        # during rollout the trainer holds weights + optimizer state (already in `free` / `static`); the engine needs
        # its weights, a prefill reserve and the KV cache of every row at full length (more only queues rows)
        kv = num_rollout_rows * (max_seq_len + 32) * shape.kv_bytes_per_token
        want = engine + 2 * GiB + 1.25 * kv
        room = free - HEADROOM * total - (static - engine)
        one_row = (max_seq_len + 32) * shape.kv_bytes_per_token
        lora = trains and shape.num_trainable < shape.num_params // 4
        if lora and shape.param_bytes > 2:  # an fp32 frozen base: its bf16 twin could be the engine's weights
            advice = ("set actor_rollout_ref.model.dtype=bfloat16 (a bf16 frozen LoRA base is the engine's weights "
                      "too, not a copy), use more GPUs or a smaller model.")
        else:
            advice = (("set actor_rollout_ref.actor.fsdp_config.offload_policy=True, " if trains else "")
                      + ("" if lora else "train LoRA (actor_rollout_ref.model.lora_rank=64), ")
                      + "use more GPUs or a smaller model.")
        if engine_auto and room < engine + 2 * GiB + one_row:
            from polyrl.errors import ConfigError

            raise ConfigError(
                f"the rollout engine needs {(engine + 2 * GiB + one_row) / GiB:.1f} GiB per GPU ({engine / GiB:.1f} "
                f"GiB of weights, a {max_seq_len}-token row of KV cache and its 2 GiB reserve) but only "
                f"{room / GiB:.1f} GiB is left beside the trainer's {(static - engine) / GiB:.1f} GiB of optimizer "
                f"state and copies ({gib}); " + advice)
        util = max(0.05, min(want, room) / total)
        out["engine"] = Choice("actor_rollout_ref.rollout.gpu_memory_utilization", round(min(0.95, util), 3),
                               f"KV cache for {num_rollout_rows} rows x {max_seq_len} tokens = {kv / GiB:.1f} GiB "
                               f"+ {engine / GiB:.1f} GiB weights; {room / GiB:.1f} GiB left beside the trainer")
        # every row of a call decodes at once where the cache holds them at full length: no second wave, no tail
        # paid twice (512 rows on one H100 at 256 seats decode in two waves)
        fit = int((min(want, room) - engine - 2 * GiB) / ((max_seq_len + 32) * shape.kv_bytes_per_token) * tp_size)
        replica_rows = num_rollout_rows * tp_size
        seats = max(DEFAULT_MAX_NUM_SEQS, min(MAX_AUTO_NUM_SEQS, replica_rows, fit) // 8 * 8)
        out["seats"] = Choice("actor_rollout_ref.rollout.max_num_seqs", seats,
                              f"{replica_rows} rows per generation call, {max(0, fit)} fit the KV cache at full "
                              f"length; between {DEFAULT_MAX_NUM_SEQS} (verl's default) and {MAX_AUTO_NUM_SEQS}")
        # the KV cache may stay through the update when both fit: no re-allocation, CUDA graphs kept
        cache = min(0.95, util) * total - engine
        need = budget * per_token
        keep = spare - cache >= need
        out["free_cache"] = Choice(
            "actor_rollout_ref.rollout.free_cache_engine", not keep,
            f"the {cache / GiB:.1f} GiB KV cache and the update's {need / GiB:.1f} GiB of activations "
            + (f"fit together in {spare / GiB:.1f} GiB: the cache stays" if keep
               else f"do not fit together in {spare / GiB:.1f} GiB: the cache is released while training"))
    return out


TP_ENGINE_RESERVE = 2 * GiB  # the engine's prefill activations and sampler, as `choose` reserves
# auto tensor parallelism asks for a KV cache that holds this many of a replica's rows at full length: rows past it
# queue, and since most rows are shorter than the maximum, the engine (which gives its cache all the memory left)
# usually runs more at once
TP_MIN_SEATS = 64


def engine_weight_bytes(shape: ModelShape, tp_size: int = 1, *, fp8: bool = False, tied: bool = False) -> int:
    """One rank's engine weights: the decoder layers' 1/tp_size (e4m3 bytes with FP8 weights: `quantization=fp8`
    puts every large layer GEMM in FP8), plus the embedding and LM head, which every rank holds whole
    (tensor_parallel.py says why)."""
    vocab = shape.vocab * shape.hidden * (1 if tied else 2)
    layers = max(0, shape.num_params - vocab)
    return int(2 * vocab + layers * (1 if fp8 else 2) / tp_size)


def choose_tp_size(shape: ModelShape, *, num_heads: int, num_kv_heads: int, gpus_per_node: int, room: int,
                   rows_per_rank: int, max_seq_len: int, fp8: bool, tied: bool,
                   seats: int = TP_MIN_SEATS) -> Choice:
    """`rollout.tensor_model_parallel_size=auto`: the fewest GPUs per replica whose share of the weights and of a KV
    cache big enough for the batch fit in `room` (bytes free beside the trainer's state on one GPU). Big enough: the
    replica's rows at full length, up to `seats` of them (TP_MIN_SEATS). A TP group of N ranks generates the rows
    of its N ranks, and each rank holds 1/N of every row's KV (its kv heads), so a rank's KV share does not grow
    with N while its share of the layer weights falls as 1/N; data-parallel replicas (N = 1) decode fastest when
    they fit. Candidates: divisors of the node's GPUs that split the heads, kv heads, MLP and experts evenly (MoE
    weights: `num_params` counts every expert, each rank holds 1/N of each; tensor_parallel.py). With FP8
    weights off, the reason says whether they would have fitted at a smaller N (`rollout.quantization=fp8`)."""
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    split = (num_heads, num_kv_heads, shape.intermediate, shape.moe_intermediate, shape.shared_intermediate)
    sizes = [n for n in range(1, gpus_per_node + 1) if gpus_per_node % n == 0 and all(d % n == 0 for d in split)]

    def need(n: int, fp8_w: bool) -> tuple[int, int, int]:
        kv = min(n * rows_per_rank, seats) * (max_seq_len + 32) * shape.kv_bytes_per_token // n
        w = engine_weight_bytes(shape, n, fp8=fp8_w, tied=tied)
        return w + TP_ENGINE_RESERVE + kv, w, kv

    for n in sizes:
        total, w, kv = need(n, fp8)
        if total <= room:
            why = (f"{w / GiB:.1f} GiB of {'FP8 ' if fp8 else ''}weights + {kv / GiB:.1f} GiB of KV cache "
                   f"({min(n * rows_per_rank, seats)} rows x {max_seq_len} tokens) + {TP_ENGINE_RESERVE / GiB:.0f} "
                   f"GiB per GPU fit the {room / GiB:.1f} GiB beside the trainer")
            if n > 1:
                smaller = sizes[sizes.index(n) - 1]
                why += f"; at {smaller} they need {need(smaller, fp8)[0] / GiB:.1f} GiB"
                if not fp8 and need(smaller, True)[0] <= room:
                    why += (f" (with FP8 weights, rollout.quantization=fp8, {smaller} GPU(s) per replica would fit: "
                            f"{need(smaller, True)[0] / GiB:.1f} GiB)")
            return Choice(key, n, why)
    n = sizes[-1]
    return Choice(key, n, f"even at {n} GPUs per replica the engine needs {need(n, fp8)[0] / GiB:.1f} GiB per GPU, "
                          f"{room / GiB:.1f} GiB free beside the trainer: the largest size, its KV cache will be "
                          "smaller than the batch")


def resolve_switches(cfg) -> None:
    """The auto switches that need no memory numbers: token-budget micro-batches unless a micro-batch size is set;
    the log-prob passes follow the actor unless their own size is set (verl's interpolated default). Runs before the
    batch-size checks (it decides which of them apply)."""
    roles = cfg.actor_rollout_ref
    a = roles.actor
    if a.use_dynamic_bsz is None:
        a.use_dynamic_bsz = a.ppo_micro_batch_size_per_gpu is None and a.ppo_micro_batch_size is None
    for role in (roles.rollout, roles.ref):
        if role.log_prob_use_dynamic_bsz is None:
            role.log_prob_use_dynamic_bsz = a.use_dynamic_bsz and (role.log_prob_micro_batch_size_per_gpu is None
                                                                   and role.log_prob_micro_batch_size is None)


def plan_memory(cfg, model, device: torch.device, *, dist=None, log=print, role: str = "colocated") -> list[Choice]:
    """Fill every auto (None) memory key of the PPO config `cfg` for `model` (loaded on `device`, or on the host by a
    multi-GPU run: see `copies_bytes`); print each choice once. `role`: colocated (trains and generates), train (no engine on this GPU) or rollout (no optimizer).
    Returns the choices made (empty when the user set every key). With several processes (`dist`, a DistEnv) every
    rank plans from the least free memory of any rank, so all make the same choices (FSDP2's collectives
    must pair up: a rank that checkpoints re-gathers its blocks in backward)."""
    world_size = dist.world_size if dist is not None else 1
    resolve_switches(cfg)
    roles, data = cfg.actor_rollout_ref, cfg.data
    a, r, ref, m = roles.actor, roles.rollout, roles.ref, roles.model
    shape = ModelShape.of(model)
    max_seq_len = data.max_prompt_length + data.max_response_length
    uses_ref = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
    extra = copies_bytes(cfg, shape, world_size)
    free, total = device_memory(device)
    if device.type == "cuda":  # what the allocator caches but no tensor holds is free to this process
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if world_size > 1:
        free = int(dist.all_reduce(torch.tensor(free, dtype=torch.float64, device=device), op="min"))
    rows = data.train_batch_size * r.n // max(1, world_size)
    tp_choice, engine_bytes = _tensor_parallel(cfg, model, shape, device, world_size, role, rows, max_seq_len, free)
    if engine_bytes is not None and device.type == "cuda" and next(model.parameters()).is_cuda:
        free += shape.num_params * shape.param_bytes  # the loaded policy leaves the GPU (ppo.py): no replica there
    if engine_bytes is None and r.quantization == "fp8":  # a whole replica, its layer GEMMs in e4m3
        engine_bytes = engine_weight_bytes(shape, 1, fp8=True,
                                           tied=bool(getattr(model.config, "tie_word_embeddings", False)))
    if engine_bytes is None and r.name == "native" and role != "train":  # LoRA: the frozen base is shared, not copied
        from polyrl.rollout.native.engine import shared_weight_bytes

        shared = shared_weight_bytes(r, model, device)
        if shared:
            engine_bytes = shape.num_params * 2 - shared
    compile_set = a.use_torch_compile if a.use_torch_compile is not None else (a.fsdp_config.use_torch_compile or None)
    choices = choose(shape, device=device, free=free, total=total, max_seq_len=max_seq_len, num_rollout_rows=rows,
                     engine_on_device=device.type == "cuda" and r.name == "native" and role != "train",
                     trains=role != "rollout" and not a.fsdp_config.cpu_offload,  # offloaded: host memory
                     extra_static=extra, world_size=world_size, compile_layers=compile_set,
                     checkpointing=m.enable_gradient_checkpointing, update_tokens=a.ppo_max_token_len_per_gpu,
                     peak_flops=device_peak_flops(device) if device.type == "cuda" else 0.0,
                     engine_bytes=engine_bytes, tp_size=cfg.actor_rollout_ref.rollout.tensor_model_parallel_size,
                     engine_auto=r.gpu_memory_utilization is None)
    made: list[Choice] = [tp_choice] if tp_choice else []

    def take(name, holder, attr, key=None, read=True):
        """Fill an auto key; log it only where it is read (a budget without token-budget micro-batches is not)."""
        if getattr(holder, attr) is None and name in choices:
            c = choices[name]
            setattr(holder, attr, c.value)
            if read:
                made.append(Choice(key or c.key, c.value, c.reason))

    take("compile", a, "use_torch_compile")
    if a.use_torch_compile is None:  # fsdp_config.use_torch_compile=True decided it
        a.use_torch_compile = True
    take("checkpointing", m, "enable_gradient_checkpointing")
    take("update_tokens", a, "ppo_max_token_len_per_gpu", read=a.use_dynamic_bsz)
    take("logprob_tokens", r, "log_prob_max_token_len_per_gpu",
         "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", read=r.log_prob_use_dynamic_bsz)
    take("logprob_tokens", ref, "log_prob_max_token_len_per_gpu",
         "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", read=uses_ref and ref.log_prob_use_dynamic_bsz)
    if r.max_num_seqs is None:  # logged where it differs from verl's default
        seats = choices.get("seats")
        r.max_num_seqs = seats.value if seats else DEFAULT_MAX_NUM_SEQS
        if seats and seats.value != DEFAULT_MAX_NUM_SEQS:
            made.append(seats)
    engine_auto = r.gpu_memory_utilization is None
    if engine_auto:
        if "engine" in choices:
            take("engine", r, "gpu_memory_utilization")
        else:  # no engine memory on this device (CPU, or the hf engine that shares the actor's weights)
            r.gpu_memory_utilization = 0.5
    if r.free_cache_engine is None:  # kept only where the planned engine share and update budget were both ours
        if engine_auto and a.ppo_max_token_len_per_gpu == choices["update_tokens"].value and "free_cache" in choices:
            take("free_cache", r, "free_cache_engine")
        else:
            r.free_cache_engine = True
    if made and m.enable_gradient_checkpointing and any(c.key.endswith("checkpointing") for c in made):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # (an explicit True was applied by load_policy)
    for c in made:
        log(f"polyrl: auto {c.key}={c.value} ({c.reason})")
    return made


def copies_bytes(cfg, shape: ModelShape, world_size: int) -> int:
    """Bytes on each GPU of the copies beside the optimizer state that the memory measured at plan time does not
    hold (ppo.py keeps the loaded policy in host memory on multi-GPU runs): the trained weights' FSDP2 shard
    (several processes), a frozen reference (full fine-tuning with a KL term; FSDP2-sharded like the policy,
    ppo.py's parallelize_frozen) and a critic (weights, gradients and Adam state, whole on each GPU). One account
    for `plan_memory` and `choose_tp_size`."""
    a, m = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.model
    weights = shape.num_params * shape.param_bytes
    out = weights // world_size if world_size > 1 and not a.fsdp_config.cpu_offload else 0  # offloaded: host
    if (a.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not m.lora_rank and not m.lora_adapter_path:
        out += weights // world_size
    if cfg.critic.enable:
        out += weights * 4
    return out


def trainer_state_bytes(cfg, shape: ModelShape, world_size: int) -> int:
    """The trainer's bytes on each GPU outside the update's activations: Adam state and gradients (FSDP-sharded over
    `world_size`), the copies `copies_bytes` counts, and the LM head's chunk workspace (as `choose` counts them)."""
    offloaded = cfg.actor_rollout_ref.actor.fsdp_config.cpu_offload  # FSDP2 keeps the state in host memory
    optimizer = 0 if offloaded else shape.state_bytes // max(1, world_size)
    return optimizer + copies_bytes(cfg, shape, world_size) + 2048 * shape.vocab * 8


def _tensor_parallel(cfg, model, shape: ModelShape, device, world_size: int, role: str, rows: int,
                     max_seq_len: int, free: int) -> tuple[Choice | None, int | None]:
    """Resolve `rollout.tensor_model_parallel_size` (auto: `choose_tp_size`, on CUDA with the native engine and
    several processes; else 1) and return (the auto choice or None, one rank's engine weight bytes under TP or
    None for a full replica). A set size is kept; one the model's heads do not divide is refused here. `free`: the
    least free bytes of any rank, measured as `plan_memory` does (a policy still on the GPU leaves it)."""
    from polyrl.rollout.native.tensor_parallel import check_divides
    from polyrl.distributed.launch import gpus_per_node

    r, c = cfg.actor_rollout_ref.rollout, model.config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    tied = bool(getattr(c, "tie_word_embeddings", False))
    made = None
    if r.tensor_model_parallel_size is None:
        r.tensor_model_parallel_size = 1
        if device.type == "cuda" and r.name == "native" and role == "colocated" and world_size > 1:
            _, total = device_memory(device)
            if next(model.parameters()).is_cuda:
                free += shape.num_params * shape.param_bytes
            per_node = min(world_size, gpus_per_node(cfg.trainer.n_gpus_per_node))
            trainer = trainer_state_bytes(cfg, shape, world_size)
            made = choose_tp_size(shape, num_heads=heads, num_kv_heads=kv_heads, gpus_per_node=per_node,
                                  room=int(free - HEADROOM * total - trainer), rows_per_rank=rows,
                                  max_seq_len=max_seq_len, fp8=r.quantization == "fp8", tied=tied)
            r.tensor_model_parallel_size = made.value
    n = r.tensor_model_parallel_size
    if n == 1:
        return made, None
    check_divides(_Heads(heads, kv_heads, shape.intermediate, shape.moe_intermediate, shape.shared_intermediate), n)
    return made, engine_weight_bytes(shape, n, fp8=r.quantization == "fp8", tied=tied)


@dataclass(frozen=True)
class _Heads:
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0


CPU_PACK_MAX_TOKENS = 2048
"""Longest micro-batch (tokens, before sharing) the CPU packs: its attention is a dense-mask SDPA, O(N^2)."""


def cpu_packs_shared_prompts(cfg, device: torch.device, num_data_shards: int = 1, log=print) -> bool:
    """On CPU, train on packed rows that carry each prompt once (GRPO's n samples of one prompt; learner/packing.py)
    when every micro-batch is short enough for the CPU's dense-mask attention. Measured on 2 cores, SmolLM2-135M,
    16 rows of a 56-token prompt x 8 samples + responses up to 32: forward + backward 2.8 s packed and shared vs
    6.5 s padded, the same log-probs. Packing without sharing is no faster than padding on CPU, so it stays off."""
    from polyrl.learner.config import micro_batch_per_gpu

    roles, data = cfg.actor_rollout_ref, cfg.data
    a, r, ref = roles.actor, roles.rollout, roles.ref
    if device.type != "cpu" or roles.rollout.n < 2 or not (roles.model.use_shared_prompt and
                                                           roles.model.use_remove_padding):
        return False
    seq = data.max_prompt_length + data.max_response_length
    actor_rows = micro_batch_per_gpu(a.ppo_micro_batch_size_per_gpu, a.ppo_micro_batch_size, num_data_shards) or 0
    bounds = [a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else actor_rows * seq]
    for role in (r, ref):  # the log-prob passes: their own micro-batch keys, else the actor's (as ppo.py uses them)
        rows = micro_batch_per_gpu(role.log_prob_micro_batch_size_per_gpu, role.log_prob_micro_batch_size,
                                   num_data_shards) or actor_rows
        bounds.append(role.log_prob_max_token_len_per_gpu if role.log_prob_use_dynamic_bsz else rows * seq)
    if not all(bounds) or max(bounds) > CPU_PACK_MAX_TOKENS:  # an unknown bound (0, None) is no bound
        return False
    longest = max(bounds)
    log(f"polyrl: auto CPU packing with shared prompts (micro-batches of at most {longest} tokens: each prompt "
        f"is computed once for its {roles.rollout.n} samples; about 2x faster than padded rows on CPU)")
    return True


# ------------------------------------------------------------------------------- calibration at the first update
def calibrated_budget(budget: int, *, base: int, peak: int, growth: int, total: int, floor: int) -> int | None:
    """What the first update measured says about the next ones (pure arithmetic, bytes).

    The first update ran micro-batches of up to `budget` tokens and peaked at `peak`, starting from `base` allocated;
    the optimizer state it created (`growth`: Adam's moments appear at the first optimizer step, after that update's
    peak) is there for every later one. Returns a smaller budget when `peak + growth` would not stay under `total`
    less `MEASURED_HEADROOM`, else None. Activations are taken as `(peak - base) / budget` per token: a micro-batch
    holds at most `budget` tokens, so this is a lower bound and the new budget may still be optimistic (oom.py
    retries then)."""
    limit = (1 - MEASURED_HEADROOM) * total
    if peak + growth <= limit or peak <= base:
        return None
    per_token = (peak - base) / budget
    return min(budget, _round_down((limit - base - growth) / per_token, floor, budget))


class FirstUpdateCalibration:
    """Wraps the first `update_actor` of a run whose token budget was chosen here (`plan_memory`): measures its peak
    and the optimizer state it created, and lowers `ppo_max_token_len_per_gpu` for the next steps when they would not
    fit (the plan's per-token estimate was checked at 1k-token responses; on 2 H100s with 4k-token responses, 1.5B,
    one step fit and the next ran out of memory). All processes take the smallest budget any of them needs."""

    def __init__(self, cfg, device: torch.device, optimizer, dist, log=print, enabled: bool = True):
        self.cfg, self.device, self.optimizer, self.dist, self.log = cfg, device, optimizer, dist, log
        self.pending = enabled and device.type == "cuda"  # enabled: plan_memory chose the budget

    @contextlib.contextmanager
    def around_update(self):
        if not self.pending:
            yield
            return
        self.pending = False
        budget = self.cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
        state_before = optimizer_state_bytes(self.optimizer)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        yield
        if self.cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu != budget:  # oom.py shrank it: a retried
            return  # update's peak is the failed attempt's
        peak = torch.cuda.max_memory_allocated(self.device)
        self.apply(base=base, peak=peak, growth=optimizer_state_bytes(self.optimizer) - state_before,
                   total=torch.cuda.mem_get_info(self.device)[1])

    def apply(self, *, base: int, peak: int, growth: int, total: int) -> int | None:
        a = self.cfg.actor_rollout_ref.actor
        floor = self.cfg.data.max_prompt_length + self.cfg.data.max_response_length
        new = calibrated_budget(a.ppo_max_token_len_per_gpu, base=base, peak=peak, growth=growth, total=total,
                                floor=floor)
        if self.dist is not None and self.dist.is_distributed:
            mine = float(new if new is not None else a.ppo_max_token_len_per_gpu)
            new = int(self.dist.all_reduce(torch.tensor(mine, device=self.device), op="min"))
            new = None if new >= a.ppo_max_token_len_per_gpu else new
        if new is None:
            return None
        self.log(f"polyrl: auto actor_rollout_ref.actor.ppo_max_token_len_per_gpu={new} (recalibrated after the first "
                 f"update: it peaked at {peak / GiB:.1f} GiB with micro-batches of up to {a.ppo_max_token_len_per_gpu}"
                 f" tokens, and later ones also hold {growth / GiB:.1f} GiB of optimizer state; "
                 f"{(1 - MEASURED_HEADROOM) * total / GiB:.1f} GiB usable)")
        a.ppo_max_token_len_per_gpu = new
        return new


def optimizer_state_bytes(optimizer) -> int:
    """Device bytes of the optimizer's state on this process (a sharded DTensor counts its local shard)."""
    local = [v.to_local() if hasattr(v, "to_local") else v for s in optimizer.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in local if t.device.type != "cpu")


# ------------------------------------------------------------------------------- optimizer state in host memory
TRAINING_STATE_BYTES = 16  # per trained parameter: fp32 master, its gradient and AdamW's two moments
STATE_SHARE = 0.6  # of a GPU's memory the training state may take; the rest is for activations and the engine


def optimizer_offload_choice(num_trainable: int, *, total: int, world_size: int) -> Choice:
    """Whether FSDP2 keeps parameters, gradients and AdamW state in host memory (pure arithmetic): on when this
    process's shard of them, 16 bytes per trained parameter, is more than `STATE_SHARE` of the GPU. An MoE counts all
    its experts here (every expert has weights and state), not the active ones."""
    need = TRAINING_STATE_BYTES * num_trainable / max(1, world_size)
    room = STATE_SHARE * total
    on = need > room
    return Choice("actor_rollout_ref.actor.fsdp_config.offload_policy", on,
                  f"{num_trainable / 1e9:.2f}B trained parameters keep {need / GiB:.1f} GiB of fp32 weights, gradients "
                  f"and AdamW state per GPU over {world_size} GPU(s); {room / GiB:.1f} GiB ({STATE_SHARE:.0%} of "
                  f"{total / GiB:.1f}) is their share" + ("; they go to host memory" if on else ": they stay"))


def trainable_parameters_of(model_cfg) -> int:
    """Parameters the actor will train, counted on a meta-device build of its config (no weights read); LoRA: 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_cfg.lora_rank > 0 or model_cfg.lora_adapter_path:
        return 0
    config = AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code)
    for k, v in (model_cfg.override_config or {}).items():
        setattr(config, k, v)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    return sum(p.numel() for p in model.parameters())


def resolve_optimizer_offload(cfg, *, world_size: int, device: torch.device, log=print) -> None:
    """Fill an auto `actor.fsdp_config.offload_policy` before the job starts (FSDP2's offload picks the collective
    backends): off on CPU and when the state fits; on, logged with its reason, when it does not and several GPUs
    train (FSDP2's CPUOffloadPolicy); a single GPU that cannot hold it is refused with one sentence."""
    from polyrl.errors import ConfigError

    fsdp = cfg.actor_rollout_ref.actor.fsdp_config
    if fsdp.offload_policy is not None:
        return
    fsdp.offload_policy = False
    if device.type != "cuda":
        return
    c = optimizer_offload_choice(trainable_parameters_of(cfg.actor_rollout_ref.model),
                                 total=device_memory(device)[1], world_size=world_size)
    if not c.value:
        return
    if world_size == 1:
        raise ConfigError(f"{c.reason.split(';')[0]}: more than one GPU holds; train on several GPUs "
                          "(trainer.n_gpus_per_node, the state then moves to host memory by itself) or LoRA "
                          "(actor_rollout_ref.model.lora_rank=64).")
    fsdp.offload_policy = True
    log(f"polyrl: auto {c.key}=True ({c.reason})")


def check_training_state_fits(optimizer, device: torch.device, world_size: int = 1, *, offloaded: bool = False) -> None:
    """Refuse, before the first rollout, a run whose gradients and two AdamW moments (3x the bytes of what the optimizer
    steps, this process's shard) cannot fit in the GPU memory left after loading: full fine-tuning of a model too big
    for its GPUs would otherwise run a whole rollout and then fail in the first update. Memory this process's
    allocator holds but does not use counts as free. Nothing to check on CPU or with the state offloaded."""
    from polyrl.errors import ConfigError

    if device.type != "cuda" or offloaded:
        return
    params = [p.to_local() if hasattr(p, "to_local") else p for g in optimizer.param_groups for p in g["params"]]
    need = 3 * sum(p.numel() * p.element_size() for p in params)
    free, _ = device_memory(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if need > free:
        count = sum(p.numel() for g in optimizer.param_groups for p in g["params"]) / 1e9
        gpus = f"each of the {world_size} GPUs" if world_size > 1 else "the GPU"
        raise ConfigError(
            f"Training {count:.1f}B parameters keeps their gradients and two AdamW moments, {need / GiB:.1f} GiB on "
            f"{gpus}, and {free / GiB:.1f} GiB is free after loading; train LoRA (actor_rollout_ref.model.lora_rank=64), "
            "shard over more GPUs (trainer.n_gpus_per_node), or keep that state in host memory "
            "(actor_rollout_ref.actor.fsdp_config.offload_policy=True)."
        )
