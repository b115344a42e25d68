"""`actor_rollout_ref.model.*`: which HF model to load and how."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    path: str | None = None
    """Local HF model directory (config.json + weights + tokenizer). Hub ids need the files downloaded first."""
    tokenizer_path: str | None = None
    """Tokenizer directory when it differs from `path`."""
    dtype: str = "float32"
    """Dtype of the trained (master) weights: float32, bfloat16 or float16. Compute dtype is actor.fsdp_config.dtype."""
    use_remove_padding: bool = True
    """Pack sequences without padding for log-prob and update passes (padding-free attention)."""
    use_shared_prompt: bool = True
    """polyrl: in packed passes, a prompt's n samples share one copy of its tokens (exact; ~10% fewer trunk tokens
    at prompt 128 / response 1024, n=8). Not under Ulysses sequence parallelism."""
    enable_gradient_checkpointing: bool | None = None
    """Recompute activations in backward; None: auto (polyrl train: on only when memory is short; sft: off)."""
    enable_activation_offload: bool = False
    """Offload checkpointed activations to CPU memory (GPU only)."""
    lora_rank: int = 0
    """LoRA rank; 0 trains the full model."""
    lora_alpha: int = 16
    """LoRA scaling alpha."""
    target_modules: str | list[str] = "all-linear"
    """LoRA target modules: 'all-linear' or a list of module names."""
    target_parameters: list[str] | None = None
    """LoRA on nn.Parameters (peft's target_parameters), e.g. an MoE's 3-D expert tensors [experts.gate_up_proj,
    experts.down_proj]; None: those of every MoE layer when the model has experts (none for dense); []: none."""
    lora_adapter_path: str | None = None
    """Start from a saved peft adapter directory."""
    use_fused_kernels: bool = False
    """verl's fused linear + cross-entropy kernels: refused (polyrl computes log-probs in LM-head chunks instead)."""
    use_liger: bool = False
    """Liger kernels (not bundled; refused)."""
    trust_remote_code: bool = False
    """Allow model code from the model directory."""
    override_config: dict = field(default_factory=dict)
    """Overrides applied to the HF config at load time."""
    external_lib: str | None = None
    """Python module imported before loading (registers custom models)."""
    custom_chat_template: str | None = None
    """A Jinja chat template that replaces the tokenizer's."""
    use_shm: bool = False
    """verl: copy the model to shared memory first (no effect here: models load from local disk)."""
