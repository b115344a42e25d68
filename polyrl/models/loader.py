"""Load HF causal LMs and tokenizers from local directories, with LoRA and gradient checkpointing applied.

The loading code is the real one (`from_pretrained(local_dir)`); the only additions are clear errors for the
common mistakes (missing directory, hub id without files, no chat template), peft LoRA wrapping, and GGUF files
(a path naming a `.gguf` file, or a directory holding one, loads dequantised through `polyrl.models.gguf`).
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import torch

from polyrl.errors import ConfigError
from polyrl.models.config import ModelConfig
from polyrl.models.gguf import find_gguf, load_gguf_causal_lm, load_gguf_tokenizer
from polyrl.models.moe import grouped_experts
from polyrl.utils.device import DTYPES, to_dtype

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
                   external_lib: str | None = None, device: torch.device | None = None):
    """`from_pretrained(path)` (or a GGUF file). On a CUDA `device` the weights stream from the files to the GPU
    (`device_map`), never all in host memory: a 61 GB checkpoint on a 128 GiB host whose /dev/shm holds it."""
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
    placed = {}
    if device is not None and device.type == "cuda":
        placed["device_map"] = {"": torch.device("cuda", torch.cuda.current_device() if device.index is None
                                                 else device.index)}
    return AutoModelForCausalLM.from_pretrained(str(p), config=config, dtype=dtype, trust_remote_code=trust_remote_code,
                                                **placed)


def apply_lora(model, *, rank: int, alpha: int, target_modules, adapter_path: str | None = None,
               target_parameters: list[str] | None = None):
    """Wrap `model` with a peft LoRA adapter (or load a saved one). `target_parameters` None: an MoE's expert
    tensors (models/moe.py `expert_parameter_targets`), nothing on a dense model."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from polyrl.models.moe import expert_parameter_targets, find_routers

    if adapter_path:
        return PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    params = expert_parameter_targets(model) if target_parameters is None else list(target_parameters)
    if targets == "all-linear" and target_parameters is not None and expert_parameter_targets(model):
        # peft's all-linear adds an MoE's expert tensors by itself (peft 0.21); an explicit target_parameters list
        # (`[]`: no experts) holds only if the modules all-linear means are named instead: Linear layers and routers
        routers = {id(r) for r in find_routers(model)}
        targets = sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                          if (isinstance(mod, torch.nn.Linear) or id(mod) in routers) and not name.endswith("lm_head")})
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM", target_parameters=params or None)
    return get_peft_model(model, cfg)


def load_policy(model_cfg: ModelConfig, *, device: torch.device, key: str = "actor_rollout_ref.model.path"):
    """The trainable policy: HF model in `model_cfg.dtype`, with LoRA and gradient checkpointing as configured."""
    dtype = to_dtype(model_cfg.dtype, "actor_rollout_ref.model.dtype")
    model = load_causal_lm(model_cfg.path, dtype=dtype, key=key, trust_remote_code=model_cfg.trust_remote_code,
                           override_config=model_cfg.override_config, external_lib=model_cfg.external_lib,
                           device=device)
    grouped_experts(model)  # MoE: bf16 grouped GEMMs over fp32 master weights, compiled or not (models/moe.py)
    if model_cfg.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if model_cfg.lora_rank > 0 or model_cfg.lora_adapter_path:
        if model_cfg.enable_gradient_checkpointing:
            model.enable_input_require_grads()
        model = apply_lora(model, rank=model_cfg.lora_rank, alpha=model_cfg.lora_alpha,
                           target_modules=model_cfg.target_modules, adapter_path=model_cfg.lora_adapter_path,
                           target_parameters=model_cfg.target_parameters)
    return model.to(device)


_SAFETENSORS_FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def saved_weights_dtype(path: str | None) -> torch.dtype | None:
    """The floating dtype holding most of a model directory's safetensors weights (read from the file headers, no
    tensor is loaded), else config.json's `dtype` / `torch_dtype`; None when neither says."""
    folder = Path(path or "")
    if not folder.is_dir():
        return None
    numel: dict[torch.dtype, int] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__" and info["dtype"] in _SAFETENSORS_FLOATS:
                dtype = _SAFETENSORS_FLOATS[info["dtype"]]
                numel[dtype] = numel.get(dtype, 0) + math.prod(info["shape"])
    if numel:
        return max(numel, key=numel.get)
    config = folder / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        return DTYPES.get(str(cfg.get("dtype") or cfg.get("torch_dtype")))
    return None


def save_hf(model, out_dir: str | Path, *, dtype: torch.dtype, state_dict: dict | None = None) -> None:
    """`save_pretrained` in `dtype` without casting the live (trained) model: tensors are cast on their way to the
    host, and config.json's `dtype` names what the files hold (transformers would write the live model's dtype)."""
    sd = model.state_dict() if state_dict is None else state_dict
    sd = {k: v.detach().to("cpu", dtype=dtype if v.is_floating_point() else v.dtype) for k, v in sd.items()}
    model.save_pretrained(out_dir, state_dict=sd)
    config = Path(out_dir) / "config.json"
    cfg = json.loads(config.read_text())
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    config.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _adapted(model):
    """(the base model, clean parameter name -> the LoRA layers adapting it); no adapters for a plain model."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        return model, {}
    base = model.get_base_model()
    adapted: dict[str, list] = {}
    for name, mod in base.named_modules():
        if isinstance(mod, LoraLayer):
            param = getattr(mod, "parameter_name", None) or "weight"
            adapted.setdefault(f"{name.replace('.base_layer', '')}.{param}", []).append(mod)
    return base, adapted


def merged_state_dict(model, trained_only: bool = False) -> dict[str, torch.Tensor]:
    """HF-named full weights of `model` for the rollout engine and HF export; LoRA adapters are merged in.

    Each adapted weight is merged into a copy (W + its adapters' deltas, peft's `get_delta_weight`), without touching
    the trained adapter: Linear layers (`target_modules`) and wrapped parameters (`target_parameters`, e.g. an MoE's
    3-D expert tensors, where wrappers nest and every `.base_layer` drops out of the name).
    `trained_only`: only what training can change (the adapted weights, any other trainable parameter), for a weight
    sync into an engine that was built from this model: the rest (`frozen_weights`) is there already. Under LoRA
    that is the merged attention of Qwen3-30B-A3B, 1.8 of its 57 GiB (with several processes, all-gathered)."""
    base, adapted = _adapted(model)
    trained = {n for n, p in base.named_parameters() if p.requires_grad} if trained_only else None
    if base is model:
        return {k: v.detach() for k, v in model.state_dict().items() if trained is None or k in trained}
    out = {}
    with torch.no_grad():
        for name, tensor in base.state_dict().items():
            if ".lora_" in name:
                continue
            clean = name.replace(".base_layer", "")
            if trained is not None and clean not in adapted and name not in trained:
                continue
            if clean in adapted:
                w = tensor.detach().clone()
                for mod in adapted[clean]:
                    for adapter in mod.active_adapters:
                        if adapter in mod.lora_A:
                            w += mod.get_delta_weight(adapter).to(w.dtype)
                out[clean] = w
            else:
                out[clean] = tensor.detach()
    return out


def frozen_weights(model) -> dict[str, torch.Tensor]:
    """HF-named weights that training never changes: frozen parameters (requires_grad off) with no LoRA adapter
    merged into them, as the live tensors themselves. Under LoRA that is the base model but its adapted weights; a
    rollout engine on the same device and dtype may use them in place of a copy (native engine, `share=`)."""
    base, adapted = _adapted(model)
    out = {}
    for name, p in base.named_parameters():
        clean = name.replace(".base_layer", "")
        if not p.requires_grad and ".lora_" not in name and clean not in adapted:
            out[clean] = p.detach()
    return out
