"""The documentation site (mkdocs.yml, docs/) builds in strict mode, so a broken link or a stale generated page
(docs/config_keys.md, BENCHMARKS.md: scripts/mkdocs_hooks.py checks both) fails; and the commands the pages show run.

Every ```bash block on a user page is marked on the line before it: `<!-- docs-test -->` blocks run here, in order,
in one fresh directory per page, with `polyrl` from this checkout and `$MODEL` a tiny local model; the others say
`<!-- docs-test: skip (why) -->`, naming the test that covers them where one does. The README (the site's home page)
follows the same rule; `.ci/run` runs its two commands."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
USER_PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.glob("*.md") if p.name != "config_keys.md")]  # README: home
BLOCK = re.compile(r"^(?:(<!-- docs-test(?:: skip \((?P<why>[^)]+)\))? -->)\n)?```bash\n(?P<body>.*?)^```", re.M | re.S)
HAS_MKDOCS = importlib.util.find_spec("mkdocs") is not None and importlib.util.find_spec("material") is not None


def blocks(page: Path):
    for m in BLOCK.finditer(page.read_text()):
        yield m.group(1), m.group("why"), m.group("body")


@pytest.mark.skipif(not HAS_MKDOCS, reason="needs `pip install -e .[dev]` (mkdocs-material)")
def test_site_builds_in_strict_mode(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "benchmarks" / "index.html").is_file()  # BENCHMARKS.md, served by the hook
    assert (tmp_path / "site" / "benchmarks" / "history.jsonl").is_file()
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Two commands" in home and 'href="install/"' in home  # the README, its docs/ links rewritten


def test_every_bash_block_is_marked():
    unmarked = [f"{p.name}: {body.splitlines()[0]}" for p in USER_PAGES for marker, _, body in blocks(p)
                if marker is None]
    assert not unmarked, f"mark these <!-- docs-test --> or <!-- docs-test: skip (why) -->: {unmarked}"


TESTED = [p for p in USER_PAGES if any(m and why is None for m, why, _ in blocks(p))]


@pytest.mark.parametrize("page", TESTED, ids=lambda p: p.name)
def test_the_commands_on_the_page_run(page, tiny_model_dir, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "polyrl").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m polyrl.cli "$@"\n')
    (bin_dir / "polyrl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "MODEL":
           str(tiny_model_dir), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "POLYRL_CACHE": str(tmp_path / "c")}
    work = tmp_path / "work"
    work.mkdir()
    for marker, why, body in blocks(page):
        if marker is None or why is not None:
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=work, env=env, capture_output=True,
                              text=True, timeout=120)
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"{page.name}:\n{body}\n{out[-3000:]}"
        for line in body.splitlines():  # `# polyrl: ...` lines show the output; `...` stands for text left out
            if line.startswith("# polyrl:"):
                for part in re.split(r"\(\.\.\.\)|\.\.\.", line[2:]):
                    assert part.strip() in out, f"{page.name}: {part.strip()!r} not printed by\n{body}\n{out[-3000:]}"
