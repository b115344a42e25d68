"""`actor_rollout_ref.rollout.*`: the generation engine and its sampling settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from polyrl.agents.config import AgentConfig, MultiTurnConfig
from polyrl.utils.profiler import RoleProfilerConfig


DEFAULT_MAX_NUM_SEQS = 256  # verl's rollout.max_num_seqs: where the auto choice (learner/memory.py) is not made


@dataclass
class ValKwargs:
    n: int = 1
    """Samples per validation prompt."""
    temperature: float = 0.0
    """Validation temperature; 0 is greedy."""
    top_k: int = -1
    """Validation top-k; -1 is off."""
    top_p: float = 1.0
    """Validation top-p."""
    do_sample: bool = False
    """Sample during validation; False means greedy regardless of temperature."""


@dataclass
class RolloutConfig:
    name: str = "native"
    """Engine: native (polyrl's own, CPU and GPU) or hf (transformers generate, the reference)."""
    mode: str = "sync"
    """verl's rollout mode (sync or async); polyrl's engine runs in-process either way."""
    n: int = 1
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are computed at this temperature."""
    top_k: int = -1
    """Top-k sampling; -1 or 0 is off."""
    top_p: float = 1.0
    """Top-p (nucleus) sampling."""
    do_sample: bool = True
    """False makes training rollouts greedy."""
    response_length: int | None = None
    """Max new tokens; defaults to data.max_response_length."""
    prompt_length: int | None = None
    """Max prompt tokens; defaults to data.max_prompt_length."""
    dtype: str = "bfloat16"
    """Engine weight dtype on GPU (CPU always uses float32)."""
    kv_cache_dtype: str = "auto"
    """KV cache dtype (vLLM's names): auto = the engine dtype; fp8 (= fp8_e4m3) stores e4m3 with per-token, per-head
    scales: about twice the tokens in the same memory and half the KV bytes per decode step (rollout.name=native)."""
    quantization: str | None = None
    """fp8: the engine's decode GEMMs use e4m3 weights quantised from the trainer's weights at every sync; training
    stays bf16 with fp32 masters (rollout.name=native). Pair with algorithm.rollout_correction."""
    gpu_memory_utilization: float | None = None
    """Fraction of GPU memory the engine may use for weights + KV cache; None: auto from the batch (memory.py)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    free_cache_engine: bool | None = None
    """Release the KV cache while the trainer trains; None: auto, kept when it fits beside the update (memory.py)."""
    load_format: str = "dummy"
    """verl's initial weight format; polyrl syncs real weights before the first rollout either way."""
    tensor_model_parallel_size: int | None = None
    """GPUs per rollout replica (tensor parallelism, native engine; must divide a node's GPUs); replicas are
    data-parallel. None: auto, the fewest GPUs where the weights and a KV cache for the batch fit beside the trainer
    (learner/memory.py; 1 for models that fit one GPU)."""
    data_parallel_size: int = 1
    """Rollout data parallel size (derived from the number of processes)."""
    max_num_batched_tokens: int = 8192
    """Max tokens per engine step (prefill chunking)."""
    max_model_len: int | None = None
    """Max prompt + response length the KV cache is sized for."""
    max_num_seqs: int | None = None
    """Max sequences decoded at once (hf engine: rows per generate call); None: auto, the rows of one generation
    call where the KV cache holds them at full length, between 256 (verl's default) and 1024 (learner/memory.py)."""
    enable_chunked_prefill: bool = True
    """Split long prefills into chunks of max_num_batched_tokens."""
    enable_prefix_caching: bool = True
    """Share prompt KV blocks among the n samples of a prompt."""
    log_prob_micro_batch_size: int | None = None
    """Deprecated global form of log_prob_micro_batch_size_per_gpu."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Sequences per micro-batch when recomputing old log-probs."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Cut log-prob micro-batches by token budget; None: as the actor, unless a micro-batch size is set."""
    log_prob_max_token_len_per_gpu: int | None = None
    """Token budget per log-prob micro-batch; None: auto from free memory (training/memory.py)."""
    calculate_log_probs: bool = True
    """Return per-token log-probs from the engine (used for training/rollout_probs_diff_mean)."""
    enable_rollout_routing_replay: bool = False
    """MoE: the engine records each token's top-k expert ids per layer (Generation.routed_experts), for
    actor.router_replay.mode=R3."""
    seed: int = 0
    """Engine sampling seed."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    """Sampling during validation."""
    engine_kwargs: dict = field(default_factory=dict)
    """Extra engine arguments per backend, as in verl (engine_kwargs.<backend>.<arg>); only `native` is read:
    block_size, num_kv_tokens (CPU cache size), fp8_min_elements (quantization=fp8 only for weights with more elements
    than this; default 2^23 on CUDA, which puts a 1.5B model's gate_up and down projections in FP8; 16777216 keeps down
    in bf16; measurements in fp8_linear.py), decode_kernel (CUDA paged-decode kernel: auto, the default, picks v2 for
    either cache dtype, as measured on an H100, and v1 where v2 cannot run (a block size that is not a power of two);
    v1, one program per kv head; v2, whole pages of several kv heads per program, paged_decode_v2.py) and fp8_lm_head
    (with quantization=fp8, the LM head in FP8 too, a tied one as an e4m3 copy of the embedding: a recipe, off by
    default, since the sampled tokens' log-probs then come from e4m3 logits; pair it with
    algorithm.rollout_correction). Fallbacks from a Triton kernel, both on by default: prefill_kernel (False: CUDA
    prefill attends through the gather path and SDPA instead of paged_prefill.py) and fp8_splitk (False: FP8 decode
    GEMMs run cuBLAS _scaled_mm and w8a16 instead of splitk_fp8.py); docs/switches.md."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn, tool-using rollouts (polyrl/agents, polyrl/tools; docs/tools.md)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Agent loops: the default one and your own (polyrl/agents)."""
    profiler: RoleProfilerConfig = field(default_factory=RoleProfilerConfig)
    """Per-role profiler settings (see global_profiler)."""
