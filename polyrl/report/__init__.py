"""Run report: `build_report(run_dir)` writes a self-contained HTML page from metrics.jsonl; `polyrl report RUN_DIR`.

`collect_env()` is what trainers write to `<run_dir>/env.json` at start, so the report knows the device's limits.
"""

from polyrl.report.env import collect_env
from polyrl.report.page import build_report, main

__all__ = ["build_report", "collect_env", "main"]
