"""Load HF causal LMs and tokenizers from local directories, with LoRA and gradient checkpointing applied.

The loading code is the real one (`from_pretrained(local_dir)`); the only additions are clear errors for the
common mistakes (missing directory, hub id without files, no chat template), peft LoRA wrapping, and GGUF files
(a path naming a `.gguf` file, or a directory holding one, loads dequantised through `polyrl.models.gguf`).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from polyrl.errors import ConfigError
from polyrl.models.gguf import find_gguf, load_gguf_causal_lm, load_gguf_tokenizer
from polyrl.utils.device import to_dtype

def _check_dir(path: str | None, key: str) -> Path:
    if not path:
        raise ConfigError(f"Config key '{key}' is not set; point it at a local HF model directory "
                          "(or run `polyrl quickstart` to build a tiny one).")
    p = Path(path).expanduser()
    if not p.is_dir():
        hint = " (hub ids need the files downloaded first: `huggingface-cli download` on a machine with access)" \
            if "/" in str(path) and not str(path).startswith(("/", ".", "~")) else ""
        raise ConfigError(f"Model directory '{path}' from '{key}' does not exist{hint}; pass a local directory "
                          "holding config.json and the weights.")
    if not (p / "config.json").is_file():
        raise ConfigError(f"Model directory '{path}' from '{key}' has no config.json; point '{key}' at an HF model "
                          "directory (the one save_pretrained wrote) or a .gguf file.")
    return p


def load_tokenizer(path: str, key: str = "actor_rollout_ref.model.path", custom_chat_template: str | None = None,
                   trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    gguf = find_gguf(path) if path else None
    if gguf is not None:
        tok = load_gguf_tokenizer(gguf)
    else:
        p = _check_dir(path, key) if not Path(path).is_dir() or (Path(path) / "config.json").is_file() else Path(path)
        tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    if custom_chat_template:
        tok.chat_template = custom_chat_template
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # decoder-only models often ship without a pad token
    tok.padding_side = "left"
    return tok


def load_causal_lm(path: str, *, dtype: torch.dtype = torch.float32, key: str = "actor_rollout_ref.model.path",
                   trust_remote_code: bool = False, override_config: dict | None = None,
                   external_lib: str | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    if external_lib:
        importlib.import_module(external_lib)
    gguf = find_gguf(path) if path else None
    if gguf is not None:
        return load_gguf_causal_lm(gguf, dtype=dtype, override_config=override_config)
    p = _check_dir(path, key)
    config = AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    for k, v in (override_config or {}).items():
        setattr(config, k, v)
    model = AutoModelForCausalLM.from_pretrained(str(p), config=config, dtype=dtype,
                                                 trust_remote_code=trust_remote_code)
    return model


def apply_lora(model, *, rank: int, alpha: int, target_modules, adapter_path: str | None = None):
    """Wrap `model` with a peft LoRA adapter (or load a saved one)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if adapter_path:
        return PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def load_policy(model_cfg, *, device: torch.device, key: str = "actor_rollout_ref.model.path"):
    """The trainable policy: HF model in `model_cfg.dtype`, with LoRA and gradient checkpointing as configured."""
    dtype = to_dtype(model_cfg.dtype, "actor_rollout_ref.model.dtype")
    model = load_causal_lm(model_cfg.path, dtype=dtype, key=key, trust_remote_code=model_cfg.trust_remote_code,
                           override_config=model_cfg.override_config, external_lib=model_cfg.external_lib)
    if model_cfg.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if model_cfg.lora_rank > 0 or model_cfg.lora_adapter_path:
        if model_cfg.enable_gradient_checkpointing:
            model.enable_input_require_grads()
        model = apply_lora(model, rank=model_cfg.lora_rank, alpha=model_cfg.lora_alpha,
                           target_modules=model_cfg.target_modules, adapter_path=model_cfg.lora_adapter_path)
    return model.to(device)


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """HF-named full weights of `model` for the rollout engine and HF export; LoRA adapters are merged in."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return {k: v.detach() for k, v in model.state_dict().items()}
    # merge into a copy of each affected weight: W + scale * B @ A, without touching the trained adapter
    base = model.get_base_model()
    out = {}
    lora_layers = {name: mod for name, mod in base.named_modules() if hasattr(mod, "lora_A")}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        mod_name = name.rsplit(".", 2)[0] if ".base_layer." in name else None
        if mod_name in lora_layers and name.endswith("base_layer.weight"):
            mod = lora_layers[mod_name]
            w = tensor.detach().clone()
            for adapter in mod.active_adapters:
                if adapter in mod.lora_A:
                    a, b = mod.lora_A[adapter].weight, mod.lora_B[adapter].weight
                    w += (b.float() @ a.float()).to(w.dtype) * mod.scaling[adapter]
            out[clean] = w
        else:
            out[clean] = tensor.detach()
    return out
