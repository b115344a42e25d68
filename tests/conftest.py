import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# run reports build their figures but skip drawing them (a third of a short training test's CPU time; inherited by the
# tests' subprocesses); tests/test_report_on_cpu.py draws them
os.environ.setdefault("POLYRL_REPORT_BLANK_PLOTS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: tiny and memory-bound models gain nothing from a second OpenMP thread, and on
    a busy 2-core box its spin-waits cost ~10 ms per call (10-20x on a 135M forward under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama + char tokenizer saved in HF format (the real from_pretrained path loads it)."""
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, layers=1, heads=2,
                            kv_heads=1, intermediate=64, max_position_embeddings=128)


@pytest.fixture(scope="session")
def tp_model_dir(tmp_path_factory):
    """The tiny model with 2 kv heads, which a tensor-parallel replica of 2 ranks splits."""
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tp") / "model", hidden_size=32, layers=1, heads=2, kv_heads=2,
                            intermediate=64, max_position_embeddings=128)


@pytest.fixture(scope="session")
def quickstart_cache(tmp_path_factory):
    """One POLYRL_CACHE for the session, so the quickstart tests share its tiny model and SFT warm-up."""
    return tmp_path_factory.mktemp("polyrl_cache")


@pytest.fixture(scope="session")
def synth_data_dir(tmp_path_factory):
    from polyrl.data.dataset import write_parquet
    from polyrl.data.synthetic import make_rows

    d = tmp_path_factory.mktemp("data")
    write_parquet(make_rows("reverse", 64, seed=1, split="train"), d / "train.parquet")
    write_parquet(make_rows("reverse", 16, seed=1, split="val"), d / "val.parquet")
    return d


@pytest.fixture
def tiny_qwen2():
    """A tiny Qwen2 (q/k/v biases, GQA 4:2, untied head) built in memory: the architecture of the GPU benchmarks."""
    import torch
    from transformers import AutoModelForCausalLM

    from polyrl.models.tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(100, arch="qwen2", hidden_size=32, layers=2, heads=4, kv_heads=2, intermediate=64, tie=False)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg)


@pytest.fixture
def triton_interpreter_scalars(monkeypatch):
    """Triton 3.5's interpreter turns a loaded scalar (a 1-element array) into a loop bound with int(array), which
    numpy >= 2.3 refuses; `.item()` is what it means."""
    import triton.runtime.interpreter as interp

    patch = interp._patch_lang_tensor

    def patched(tensor):
        patch(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.item())

    monkeypatch.setattr(interp, "_patch_lang_tensor", patched)
