"""Loads a polyrl report in headless Chromium, checks that every plot image decoded, and takes a screenshot.

    python scripts/check_report_in_browser.py [RUN_DIR] [--screenshot report.png]

Without RUN_DIR it builds the report of a synthetic run (polyrl.report.demo) in a temporary directory.
The check runs in a copy of the page with a small script appended (the report itself has no scripts): after the
load event it counts images with `complete && naturalWidth > 0` and lists the plot ids, and Chromium's
`--dump-dom` prints the result. Needs Debian's `chromium` (apt-get install -y chromium); exit code 0 when the page
loads with all plots present, 1 when not, 3 when Chromium is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

EXPECTED_IDS = [
    "plot-reward", "plot-validation", "plot-timing", "plot-throughput", "plot-mfu", "plot-response_length",
    "plot-kl", "plot-entropy", "plot-clipfrac", "plot-zero_std", "plot-samples",
]  # fmt: skip
_PROBE = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const out = document.createElement('pre');
  out.id = 'polyrl-check';
  out.textContent = JSON.stringify({
    images: imgs.length,
    loaded: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
    ids: [...document.querySelectorAll('[id^="plot-"]')].map(e => e.id),
    height: document.documentElement.scrollHeight,
    title: document.title,
  });
  document.body.appendChild(out);
});
</script>"""


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


def _chromium(binary: str, *args: str, timeout: float = 60) -> str:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout


def check_report(html_path: str, screenshot: str | None = None, width: int = 1400) -> dict:
    """Loads `html_path` in Chromium; returns {images, loaded, ids, height, title, missing_ids, ok}."""
    binary = find_chromium()
    if binary is None:
        raise FileNotFoundError("chromium is not installed; run `apt-get install -y chromium`")
    with open(html_path, encoding="utf-8") as f:
        page = f.read()
    with tempfile.TemporaryDirectory() as tmp:
        probe_path = os.path.join(tmp, "probe.html")
        with open(probe_path, "w", encoding="utf-8") as f:
            f.write(page.replace("</body>", _PROBE + "</body>"))
        dom = _chromium(binary, f"--window-size={width},1000", "--dump-dom", f"file://{probe_path}")
    match = re.search(r'<pre id="polyrl-check">(.*?)</pre>', dom, re.S)
    if match is None:
        raise RuntimeError("the page did not finish loading in chromium (no probe output in --dump-dom)")
    result = json.loads(match.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    result["missing_ids"] = [i for i in EXPECTED_IDS if i not in result["ids"]]
    result["ok"] = result["images"] > 0 and result["loaded"] == result["images"] and not result["missing_ids"]
    if screenshot:
        height = min(int(result["height"]) + 20, 16000)
        _chromium(binary, f"--window-size={width},{height}", f"--screenshot={os.path.abspath(screenshot)}",
                  f"file://{os.path.abspath(html_path)}")  # fmt: skip
        result["screenshot"] = screenshot if os.path.exists(screenshot) else None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", nargs="?", help="run directory (default: a synthetic run in a temp dir)")
    parser.add_argument("--screenshot", default="report_screenshot.png", help="where to save the screenshot")
    args = parser.parse_args(argv)
    if find_chromium() is None:
        print("chromium is not installed; run `apt-get install -y chromium` (Debian) and retry", file=sys.stderr)
        return 3
    from polyrl.report import build_report
    from polyrl.report.demo import write_synthetic_run

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or write_synthetic_run(os.path.join(tmp, "synthetic_run"))
        result = check_report(build_report(run_dir), args.screenshot)
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
