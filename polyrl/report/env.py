"""The environment a run ran in: versions and device, written to `<run_dir>/env.json` when a run starts.

The report draws physical limits from it: `peak_flops` is the dense BF16 peak of one GPU (989e12 for H100 SXM,
H200 and H800, as torchtitan and verl's flops counter use), and `measured_gemm_flops` the best 8192^3 BF16 GEMM we
measured on the lent machines (research/peers.md), a ceiling no real step reaches.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys

import torch

# (substring of the device name, peak dense bf16 FLOP/s, measured 8192^3 bf16 GEMM FLOP/s or None); first match wins
KNOWN_DEVICES: list[tuple[str, float, float | None]] = [
    ("H100 PCIe", 756e12, None),
    ("H100", 989e12, 798e12),
    ("H200", 989e12, 788e12),
    ("H800", 989e12, None),
    ("A100", 312e12, None),
]


def device_limits(device_name: str | None) -> tuple[float | None, float | None]:
    """(peak, measured GEMM) FLOP/s of one `device_name` GPU; (None, None) when we do not know the device."""
    for key, peak, gemm in KNOWN_DEVICES:
        if device_name and key.lower() in device_name.lower():
            return peak, gemm
    return None, None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def collect_env(model: torch.nn.Module | None = None) -> dict:
    """Versions, device and its FLOP/s limits; pass the actor `model` to record its parameter count too."""
    cuda = torch.cuda.is_available()
    device_name = torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine()
    peak, gemm = device_limits(device_name) if cuda else (None, None)
    env = {
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "diffusers": _version("diffusers"),
        "peft": _version("peft"),
        "polyrl": _version("polyrl"),
        "polyrl_commit": _git_commit(),
        "device": "cuda" if cuda else "cpu",
        "device_name": device_name,
        "num_gpus": torch.cuda.device_count() if cuda else 0,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "cpu_count": os.cpu_count(),
        "peak_flops": peak,
        "measured_gemm_flops": gemm,
        "argv": sys.argv,
    }
    if model is not None:
        env["model_num_params"] = sum(p.numel() for p in model.parameters())
    return env
