"""Every `from polyrl... import name` in benchmarks/, examples/ and scripts/ (at any depth, inside functions too) names
something that exists. The benchmarks run on the GPU machine, far from CI; a renamed class once left
`benchmarks/probes/flow_fp8_rollout.py` unable to start, and nothing here noticed until a device call failed."""

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(p for d in ("benchmarks", "examples", "scripts") for p in (ROOT / d).rglob("*.py"))
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _polyrl_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "polyrl":
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "polyrl":
                    yield node.lineno, a.name, []


def _needs_triton(module: str, name: str | None = None) -> bool:
    """Modules whose import needs Triton (the CUDA kernels): not importable on CI's CPU-only torch."""
    full = f"{module}.{name}" if name else module
    return not HAS_TRITON and any(k in full for k in ("paged_decode", "fused", "triton"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_polyrl_names_imported_by_scripts_exist(path):
    missing = []
    for line, module, names in _polyrl_imports(path):
        if _needs_triton(module):
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] == "triton":
                continue
            missing.append(f"{path.name}:{line} {module} ({e})")
            continue
        for name in names:
            if hasattr(mod, name) or _needs_triton(module, name):
                continue
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError as e:
                if not (e.name and e.name.split(".")[0] == "triton"):  # a Triton-kernel module imports on the GPU
                    missing.append(f"{path.name}:{line} {module}.{name}")
    assert not missing, missing
