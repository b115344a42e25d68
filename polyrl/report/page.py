"""`build_report(run_dir)`: one self-contained HTML page (plots as embedded PNGs, no scripts, no network) from
`metrics.jsonl` alone, plus `config.yaml`, `env.json` and `samples/*.png` when the run dir has them.

It reads only files the run flushes as it goes, so it works on a crashed or still-running run. The page leads with
the numbers a person asks first (did reward go up, how fast, how close to the hardware), then the plots, then what
was not shown and why, then config and environment.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import html
import io
import json
import os
import re
import sys

import numpy as np
import yaml

from polyrl.errors import UserError
from polyrl.report.env import collect_env, device_limits
from polyrl.report.metrics import Metrics, load_metrics
from polyrl.report.plots import PLOTS, render_png

CONFIG_HIGHLIGHTS = [
    "algorithm.adv_estimator",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.lora_rank",
    "data.train_files",
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef",
    "algorithm.use_kl_in_reward",
    "trainer.total_training_steps",
    "trainer.total_epochs",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
]
ENV_KEYS = [
    "device_name", "num_gpus", "world_size", "torch", "cuda", "transformers", "diffusers", "peft", "python",
    "polyrl", "polyrl_commit", "platform", "cpu_count", "model_num_params", "time",
]  # fmt: skip
MAX_SAMPLE_STEPS = 4
MAX_SAMPLE_WIDTH = 900

CSS = """
:root { --ink:#1f2933; --muted:#66717d; --line:#e3e7eb; --bg:#f6f7f9; --card:#fff; --accent:#3b6ea8; --warn:#b7472a; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
  font:15px/1.45 -apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif; }
main { max-width:1320px; margin:0 auto; padding:28px 28px 48px; }
header h1 { margin:0 0 4px; font-size:26px; letter-spacing:-.01em; }
.sub { color:var(--muted); font-size:13.5px; }
.tiles { display:grid; grid-template-columns:repeat(auto-fit,minmax(170px,1fr)); gap:12px; margin:22px 0; }
.tile { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:12px 14px; }
.tile .k { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.05em; }
.tile .v { font-size:24px; font-weight:600; margin-top:2px; font-variant-numeric:tabular-nums; }
.tile .d { color:var(--muted); font-size:12.5px; }
.up { color:#2f7d43; } .down { color:var(--warn); }
.warn { background:#fff4ef; border:1px solid #f1c6b5; color:#7a2e17; border-radius:10px; padding:10px 14px;
  margin:0 0 18px; font-size:14px; }
.grid { display:grid; grid-template-columns:repeat(auto-fill,minmax(560px,1fr)); gap:16px; }
figure.card { margin:0; background:var(--card); border:1px solid var(--line); border-radius:10px; padding:12px 14px; }
figure.card h2, section h2 { font-size:16px; margin:0 0 6px; }
figure.card img { width:100%; height:auto; display:block; }
figcaption { color:var(--muted); font-size:13px; margin-top:4px; }
section { margin-top:26px; }
.samples { display:grid; grid-template-columns:repeat(auto-fill,minmax(280px,1fr)); gap:14px; }
.samples figure { margin:0; background:var(--card); border:1px solid var(--line); border-radius:10px; padding:8px; }
.samples img { width:100%; image-rendering:pixelated; border-radius:6px; display:block; }
table { border-collapse:collapse; background:var(--card); border:1px solid var(--line); border-radius:10px;
  font-size:13.5px; width:100%; overflow:hidden; }
td { padding:6px 12px; border-top:1px solid var(--line); vertical-align:top; }
tr:first-child td { border-top:none; }
td.key { color:var(--muted); font-family:ui-monospace,SFMono-Regular,Menlo,monospace; font-size:12.5px; width:38%; }
.cols { display:grid; grid-template-columns:repeat(auto-fit,minmax(420px,1fr)); gap:16px; }
details { margin-top:10px; } summary { cursor:pointer; color:var(--accent); }
pre { background:var(--card); border:1px solid var(--line); border-radius:10px; padding:12px; overflow:auto;
  font-size:12px; max-height:480px; }
ul.skipped { color:var(--muted); font-size:13.5px; margin:6px 0 0; padding-left:20px; }
code { font-family:ui-monospace,SFMono-Regular,Menlo,monospace; font-size:.92em; }
footer { color:var(--muted); font-size:12px; margin-top:30px; }
"""


def _e(text: object) -> str:
    return html.escape(str(text))


def _md_code(text: str) -> str:
    """Escapes text and turns `backticks` into <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", _e(text))


def _b64_png(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    out: dict[str, object] = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def _fmt(v: float | None, unit: str = "", pct: bool = False) -> str:
    if v is None or not np.isfinite(v):
        return "–"
    return f"{v:.1%}" if pct else f"{v:.4g}{unit}"


def _tile(key: str, value: str, detail: str = "", cls: str = "") -> str:
    return (
        f'<div class="tile"><div class="k">{_e(key)}</div><div class="v {cls}">{_e(value)}</div>'
        f'<div class="d">{_e(detail)}</div></div>'
    )


def _median(m: Metrics, key: str) -> float | None:
    _, v = m.series(key)
    v = v[np.isfinite(v)]
    return float(np.median(v)) if len(v) else None


def _tiles(m: Metrics) -> str:
    tiles = []
    steps = m.steps
    tiles.append(_tile("steps logged", str(len(steps)), f"{steps[0]} → {steps[-1]}" if steps else "none yet"))
    for key in ("critic/score/mean", "critic/rewards/mean"):
        _, v = m.series(key)
        v = v[np.isfinite(v)]
        if len(v):
            k = max(1, min(5, len(v) // 5))  # compare averages of the first and last few steps, not two noisy points
            first, last = float(v[:k].mean()), float(v[-k:].mean())
            cls = "up" if last > first else "down" if last < first else ""
            tiles.append(_tile("reward", _fmt(last), f"from {_fmt(first)} (mean of {k} first/last steps)", cls))
            break
    val = m.match("val-core/*")
    if val:
        _, v = m.series(val[0])
        tiles.append(_tile("best validation", _fmt(np.nanmax(v)), val[0].removeprefix("val-core/")))
    if (t := _median(m, "timing_s/step")) is not None:
        tiles.append(_tile("step time", f"{t:.3g} s", "median"))
    if (t := _median(m, "perf/throughput")) is not None:
        tiles.append(_tile("throughput", f"{t:,.0f}/s", "median, per GPU"))
    if (t := _median(m, "perf/mfu/actor")) is not None:
        tiles.append(_tile("MFU (actor)", _fmt(t, pct=True), "median"))
    if (t := _median(m, "response_length/mean")) is not None:
        tiles.append(_tile("response length", f"{t:.0f}", "median of means, tokens"))
    return '<div class="tiles">' + "".join(tiles) + "</div>"


def _warnings(m: Metrics) -> str:
    notes = []
    if m.bad_lines:
        notes.append(f"{m.bad_lines} line(s) of metrics.jsonl could not be read (a run stopped mid-write?); skipped.")
    for key, steps in m.non_finite.items():
        shown = ", ".join(map(str, steps[:8])) + (" …" if len(steps) > 8 else "")
        notes.append(f"`{key}` was NaN or inf at step(s) {shown}.")
    if not notes:
        return ""
    return '<div class="warn">' + "<br>".join(_md_code(n) for n in notes) + "</div>"


def _samples(run_dir: str) -> str:
    folder = os.path.join(run_dir, "samples")
    if not os.path.isdir(folder):
        return ""

    def step_of(name: str) -> int:
        match = re.search(r"step_(\d+)", name)
        return int(match.group(1)) if match else -1

    files = sorted((f for f in os.listdir(folder) if f.lower().endswith(".png")), key=lambda f: (step_of(f), f))
    if not files:
        return ""
    if len(files) > MAX_SAMPLE_STEPS:  # first, last and evenly spaced between
        idx = np.unique(np.linspace(0, len(files) - 1, MAX_SAMPLE_STEPS).round().astype(int))
        files = [files[i] for i in idx]
    from PIL import Image

    cards = []
    for name in files:
        img = Image.open(os.path.join(folder, name)).convert("RGB")
        if img.width > MAX_SAMPLE_WIDTH:
            img = img.resize((MAX_SAMPLE_WIDTH, round(img.height * MAX_SAMPLE_WIDTH / img.width)))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        label = f"step {step_of(name)}" if step_of(name) >= 0 else name
        cards.append(f'<figure><img alt="samples {_e(label)}" src="{_b64_png(buf.getvalue())}">'
                     f"<figcaption>{_e(label)} · {_e(name)}</figcaption></figure>")  # fmt: skip
    return (
        '<section id="plot-samples"><h2>Samples</h2><div class="samples">' + "".join(cards) + "</div></section>"
    )


def _table(rows: list[tuple[str, object]]) -> str:
    body = "".join(f'<tr><td class="key">{_e(k)}</td><td>{_e(v)}</td></tr>' for k, v in rows)
    return f"<table>{body}</table>"


def _config(run_dir: str) -> str:
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return "<h2>Config</h2><p class='sub'>no config.yaml in the run dir</p>"
    text = open(path, encoding="utf-8").read()
    try:
        flat = _flatten(yaml.safe_load(text) or {})
    except yaml.YAMLError as e:
        why = _e(str(e).splitlines()[0])
        return f"<h2>Config</h2><p>config.yaml is not valid YAML ({why})</p><pre>{_e(text)}</pre>"
    rows = [(k, flat[k]) for k in CONFIG_HIGHLIGHTS if k in flat and flat[k] not in (None, "", [])]
    return (
        "<h2>Config</h2>" + _table(rows or [("keys", len(flat))])
        + f"<details><summary>full config.yaml ({len(flat)} keys)</summary><pre>{_e(text)}</pre></details>"
    )  # fmt: skip


def _load_env(run_dir: str) -> tuple[dict, str]:
    path = os.path.join(run_dir, "env.json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                env = json.load(f)
            if env.get("peak_flops") is None and env.get("device_name"):  # env.json written by another tool
                env["peak_flops"], env["measured_gemm_flops"] = device_limits(env["device_name"])
            return env, "from env.json (the run's own environment)"
        except (OSError, ValueError):
            pass
    return collect_env(), "no env.json in the run dir: collected now, on the machine that built this report"


def _env_section(env: dict, source: str) -> str:
    rows = [(k, env[k]) for k in ENV_KEYS if env.get(k) is not None]
    rows = [(k, f"{v / 1e9:.3g} B ({v:,})" if k == "model_num_params" else v) for k, v in rows]
    if env.get("peak_flops"):
        rows.insert(1, ("peak bf16 FLOP/s per GPU", f"{env['peak_flops'] / 1e12:.0f} T"))
    return f"<h2>Environment</h2><p class='sub'>{_e(source)}</p>" + _table(rows)


def build_report(run_dir: str, out_path: str | None = None) -> str:
    """Writes `<run_dir>/report.html` (or `out_path`) and returns its path."""
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        raise UserError(
            f"no metrics.jsonl in {run_dir!r}; pass a run directory from a run whose trainer.logger includes 'file'"
        )
    m = load_metrics(metrics_path)
    env, env_source = _load_env(run_dir)
    cards, skipped = [], []
    for plot in PLOTS:
        result = plot.fn(m, env)
        if result is None:  # a plot for runs of another kind (multi-turn plots in a single-turn run)
            continue
        if isinstance(result, str):
            skipped.append((plot, result))
            continue
        fig, caption = result
        cards.append(
            f'<figure class="card" id="plot-{plot.id}"><h2>{_e(plot.title)}</h2>'
            f'<img alt="{_e(plot.title)}" src="{_b64_png(render_png(fig))}">'
            f"<figcaption>{_md_code(caption)}</figcaption></figure>"
        )
    samples = _samples(run_dir)
    if not samples:
        skipped.append((None, "no images in samples/ (only diffusion runs write them)"))
    skipped_html = ""
    if skipped:
        items = "".join(f"<li><b>{_e(p.title if p else 'Samples')}</b>: {_md_code(why)}</li>" for p, why in skipped)
        skipped_html = f'<section id="skipped"><h2>Not shown</h2><ul class="skipped">{items}</ul></section>'
    name = os.path.basename(os.path.abspath(run_dir))
    updated = datetime.datetime.fromtimestamp(os.path.getmtime(metrics_path)).strftime("%Y-%m-%d %H:%M:%S")
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    device = env.get("device_name") or env.get("device") or "unknown device"
    gpus = f" × {env['num_gpus']}" if env.get("num_gpus") else ""
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(name)} · polyrl report</title><style>{CSS}</style></head>
<body><main>
<header><h1>{_e(name)}</h1>
<div class="sub">{_e(os.path.abspath(run_dir))} · {_e(device)}{_e(gpus)} · metrics last written {_e(updated)}</div>
</header>
{_tiles(m)}
{_warnings(m)}
<div class="grid">{"".join(cards)}</div>
{samples}
{skipped_html}
<section class="cols"><div>{_config(run_dir)}</div><div>{_env_section(env, env_source)}</div></section>
<footer>polyrl report · built {_e(now)} from metrics.jsonl ({len(m.steps)} steps, {len(m.keys)} metrics)</footer>
</main></body></html>
"""
    out_path = out_path or os.path.join(run_dir, "report.html")
    tmp = out_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, out_path)  # a browser refreshing during a rebuild never sees half a page
    return out_path


def main(argv: list[str] | None = None) -> int:
    """`polyrl report RUN_DIR [-o OUT.html]`."""
    parser = argparse.ArgumentParser(prog="polyrl report", description="Build the HTML report of a run directory.")
    parser.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    parser.add_argument("-o", "--out", help="output HTML path (default RUN_DIR/report.html)")
    args = parser.parse_args(argv)
    try:
        path = build_report(args.run_dir, args.out)
    except UserError as e:
        print(f"polyrl report: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
