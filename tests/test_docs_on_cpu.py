"""The generated key table is up to date with the config dataclasses, and every key has help text."""

import os
import subprocess
import sys
from pathlib import Path

from polyrl.config import key_table
from polyrl.trainer.config import PPOConfig

ROOT = Path(__file__).resolve().parent.parent


def test_config_key_doc_is_current():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_keys.py"), "--check"], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})  # this checkout's polyrl, not another
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_key_has_help():
    missing = [key for key, _, _, help_ in key_table(PPOConfig()) if not help_]
    assert not missing, missing
