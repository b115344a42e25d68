"""Imports only run downhill (STYLE.md 14): measured on the source by scripts/code_facts.py, no module imported."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _code_facts():
    spec = importlib.util.spec_from_file_location("code_facts", ROOT / "scripts" / "code_facts.py")
    module = sys.modules["code_facts"] = importlib.util.module_from_spec(spec)  # dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def facts():
    return _code_facts().facts(ROOT)


def test_no_import_cycle_involves_a_cli_module(facts):
    with_cli = [c["modules"] for label in ("all", "top_level") for c in facts["cycles"][label] if c["cli"]]
    assert with_cli == []


def test_nothing_under_distributed_imports_a_trainer_or_the_cli(facts):
    assert facts["distributed_upward_imports"] == []


def test_nothing_below_the_loops_imports_a_loop_or_the_cli(facts):
    """learner, rollout, algorithms, models, rewards, data, utils, report: none imports trainer/ or a CLI module."""
    assert facts["lower_layer_upward_imports"] == []


def test_no_config_class_name_is_defined_twice(facts):
    assert facts["duplicate_config_classes"] == {}


def test_the_checks_can_fail(tmp_path):
    """The script finds a planted CLI cycle, an upward import and a duplicate config name."""
    module = _code_facts()
    files = {
        "polyrl/__init__.py": "",
        "polyrl/cli.py": "def _train():\n    from polyrl.trainer import loop\n",
        "polyrl/trainer/__init__.py": "",
        "polyrl/trainer/loop.py": "from polyrl.distributed import launch\n"
                                  "from dataclasses import dataclass\n@dataclass\nclass ActorConfig:\n    x: int = 1\n",
        "polyrl/distributed/__init__.py": "",
        "polyrl/distributed/launch.py": "def main():\n    from polyrl.cli import _train\n",
        "polyrl/learner/__init__.py": "",
        "polyrl/learner/config.py": "import dataclasses\n@dataclasses.dataclass\nclass ActorConfig:\n    x: int = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    f = module.facts(tmp_path)
    assert [c["modules"] for c in f["cycles"]["all"]] == [["polyrl.cli", "polyrl.distributed.launch",
                                                          "polyrl.trainer.loop"]]
    assert f["cycles"]["all"][0]["cli"] == ["polyrl.cli"] and f["cycles"]["top_level"] == []
    assert [u["imports"] for u in f["distributed_upward_imports"]] == ["polyrl.cli"]
    assert [(u["module"], u["imports"]) for u in f["lower_layer_upward_imports"]] == [
        ("polyrl.distributed.launch", "polyrl.cli")]
    assert list(f["duplicate_config_classes"]) == ["ActorConfig"]
