"""The report's plots: a list of `Plot(id, title, fn)`; each `fn(metrics, env)` returns a figure and a caption, or
a string saying why it was skipped (a missing metric is normal: an SFT run has no KL, an LLM run no zero-std ratio).

Figures are built with matplotlib's object API on the Agg canvas (no pyplot global state, no display needed).
Noisy curves with many points are drawn raw and faint, with an exponential moving average on top.
"""

from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from polyrl.report.metrics import Metrics

PALETTE = ["#3b6ea8", "#e07b39", "#4a9a5b", "#c44e52", "#8172b3", "#937860", "#d684bd", "#7f7f7f", "#b5a33a", "#3fa7c0"]
# verl's stage order (DESIGN.md), so the stacks read bottom-up in dataflow order
STAGE_ORDER = [
    "gen", "reward", "old_log_prob", "ref", "values", "adv",
    "update_critic", "update_actor", "update_weights", "save_checkpoint", "testing",
]  # fmt: skip


@dataclass
class Plot:
    id: str
    """HTML id (`plot-<id>`) and test handle."""
    title: str
    """Card heading and image alt text."""
    fn: Callable[[Metrics, dict], "tuple[Figure, str] | str | None"]
    """Builds the figure and its caption, or returns the reason it is skipped (None: not a plot for this run)."""


def _figure(ylabel: str, height: float = 3.3) -> tuple[Figure, "object"]:
    fig = Figure(figsize=(6.4, height), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, color="#e6e6e6", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    for side in ("left", "bottom"):
        ax.spines[side].set_color("#9a9a9a")
    ax.tick_params(colors="#555555", labelsize=8.5)
    return fig, ax


def _ema(values: np.ndarray, span: int) -> np.ndarray:
    alpha, out, acc = 2.0 / (span + 1), np.empty_like(values), np.nan
    for i, v in enumerate(values):
        if np.isfinite(v):
            acc = v if not np.isfinite(acc) else alpha * v + (1 - alpha) * acc
        out[i] = acc
    return out


def _curve(ax, m: Metrics, key: str, label: str, color: str, band: tuple[str, str] | None = None, **kw) -> None:
    """Draws `key`; raw plus EMA when noisy and long; optional min/max band from two other metrics."""
    steps, values = m.series(key)
    if band and m.has(band[0]) and m.has(band[1]):
        lo_s, lo = m.series(band[0])
        hi_s, hi = m.series(band[1])
        if len(lo_s) == len(hi_s) and np.array_equal(lo_s, hi_s):
            ax.fill_between(lo_s, lo, hi, color=color, alpha=0.12, linewidth=0, label=f"{label} min–max")
    if len(steps) > 30:
        ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8, **kw)
        span = int(np.clip(len(steps) / 15, 3, 50))
        ax.plot(steps, _ema(values, span), color=color, linewidth=1.8, label=f"{label} (EMA {span})", **kw)
    else:
        marker = "o" if len(steps) <= 12 else None
        ax.plot(steps, values, color=color, linewidth=1.6, marker=marker, markersize=3.5, label=label, **kw)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, frameon=False, loc="best")


def _missing(*keys: str) -> str:
    return "no " + " or ".join(f"`{k}`" for k in keys) + " in metrics.jsonl"


def _lines(m: Metrics, keys: list[tuple[str, str]], ylabel: str, percent: bool = False) -> "tuple[Figure, str] | str":
    present = [(k, label) for k, label in keys if m.has(k)]
    if not present:
        return _missing(*(k for k, _ in keys))
    fig, ax = _figure(ylabel)
    for i, (key, label) in enumerate(present):
        _curve(ax, m, key, label, PALETTE[i % len(PALETTE)])
    if percent:
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    _legend(ax)
    last = ", ".join(f"{label} {m.last(k):.4g}" for k, label in present if m.last(k) is not None)
    return fig, f"last: {last}" if last else ""


def reward(m: Metrics, env: dict) -> "tuple[Figure, str] | str":
    for key, stat in (("critic/score/mean", "critic/score"), ("critic/rewards/mean", "critic/rewards")):
        if m.has(key):
            fig, ax = _figure("reward")
            _curve(ax, m, key, key, PALETTE[0], band=(f"{stat}/min", f"{stat}/max"))
            _legend(ax)
            _, values = m.series(key)
            finite = values[np.isfinite(values)]
            return fig, f"`{key}`: first {finite[0]:.4g}, last {finite[-1]:.4g}, best {finite.max():.4g}"
    return _missing("critic/score/mean", "critic/rewards/mean")


def validation(m: Metrics, env: dict) -> "tuple[Figure, str] | str":
    keys = m.match("val-core/*")
    if not keys:
        return _missing("val-core/*")
    fig, ax = _figure("validation")
    for i, key in enumerate(keys):
        steps, values = m.series(key)
        ax.plot(steps, values, marker="o", markersize=4, linewidth=1.6, color=PALETTE[i % len(PALETTE)],
                label=key.removeprefix("val-core/"))  # fmt: skip
    _legend(ax)
    best = ", ".join(f"{k.removeprefix('val-core/')} best {np.nanmax(m.series(k)[1]):.4g}" for k in keys[:4])
    return fig, best


def step_time(m: Metrics, env: dict) -> "tuple[Figure, str] | str":
    stages = [k for k in m.match("timing_s/*") if k != "timing_s/step"]
    if not stages:
        return _missing("timing_s/<stage>")
    rank = {f"timing_s/{s}": i for i, s in enumerate(STAGE_ORDER)}
    stages.sort(key=lambda k: (rank.get(k, len(rank)), k))
    steps = np.array(m.steps, dtype=float)
    stack = np.array([[m.rows[s].get(k, 0.0) for s in m.steps] for k in stages])
    stack = np.nan_to_num(stack)
    fig, ax = _figure("seconds", height=3.6)
    labels = [k.removeprefix("timing_s/") for k in stages]
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(stages))]
    if len(steps) <= 80:
        bottom = np.zeros(len(steps))
        for row, label, color in zip(stack, labels, colors):
            ax.bar(steps, row, bottom=bottom, width=0.8, color=color, label=label, linewidth=0)
            bottom += row
    else:
        ax.stackplot(steps, stack, labels=labels, colors=colors, linewidth=0)
    if m.has("timing_s/step"):
        s, total = m.series("timing_s/step")
        ax.plot(s, total, color="#222222", linewidth=1.2, linestyle="--", label="step (total)")
    handles, names = ax.get_legend_handles_labels()
    def legend_rank(i: int) -> tuple[int, int]:
        return (0, 0) if names[i] == "step (total)" else (1, -labels.index(names[i]))

    order = sorted(range(len(names)), key=legend_rank)
    # legend top-down = stack top-down, so each entry sits beside its layer
    ax.legend([handles[i] for i in order], [names[i] for i in order], fontsize=7.5, frameon=False,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))  # fmt: skip
    mean = stack.mean(axis=1)
    share = mean / max(mean.sum(), 1e-12)
    top = sorted(zip(share, labels), reverse=True)[:3]
    caption = "mean share: " + ", ".join(f"{label} {p:.0%}" for p, label in top)
    if m.has("timing_s/step"):
        untimed = np.nanmean(m.series("timing_s/step")[1]) - mean.sum()
        caption += f"; untimed per step {untimed:.3g} s"
    return fig, caption


def _limit_line(ax, y: float, label: str, style: str = "--") -> None:
    ax.axhline(y, color="#c44e52", linestyle=style, linewidth=1.2, label=label)


def throughput(m: Metrics, env: dict) -> "tuple[Figure, str] | str":
    if not m.has("perf/throughput"):
        return _missing("perf/throughput")
    fig, ax = _figure("per GPU per second")
    _curve(ax, m, "perf/throughput", "perf/throughput", PALETTE[0])
    median = float(np.nanmedian(m.series("perf/throughput")[1]))
    caption = f"median {median:.4g}/s/GPU"
    peak, num_params = env.get("peak_flops"), env.get("model_num_params")
    if peak and num_params and m.has("response_length/mean"):  # an LLM run: the tokens bound applies
        bound = peak / (6 * num_params)
        _limit_line(ax, bound, f"training-FLOPs bound {bound:.3g} tok/s")
        if bound > 20 * np.nanmax(m.series("perf/throughput")[1]):
            ax.set_yscale("log")  # keep the curve readable when it is far below the bound
        caption += (
            f", {median / bound:.1%} of the bound = peak {peak / 1e12:.0f} TFLOP/s ÷ 6·N "
            f"(N = {num_params / 1e9:.3g}B; training FLOPs alone, so no step can reach it)"
        )
    else:
        caption += "; no limit line (env.json lacks peak_flops or model_num_params)"
    _legend(ax)
    return fig, caption


def mfu(m: Metrics, env: dict) -> "tuple[Figure, str] | str":
    keys = [k for k in ("perf/mfu/actor", "perf/mfu/critic") if m.has(k)]
    if not keys:
        return _missing("perf/mfu/actor")
    fig, ax = _figure("model FLOPs utilisation")
    for i, key in enumerate(keys):
        _curve(ax, m, key, key, PALETTE[i])
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    peak, gemm, name = env.get("peak_flops"), env.get("measured_gemm_flops"), env.get("device_name")
    caption = f"median {np.nanmedian(m.series(keys[0])[1]):.1%}"
    if peak:
        _limit_line(ax, 1.0, f"peak {peak / 1e12:.0f} TFLOP/s bf16")
        if gemm:
            _limit_line(ax, gemm / peak, f"best measured GEMM {gemm / 1e12:.0f} TFLOP/s", style=":")
        ax.set_ylim(0, 1.05)
        caption += f" of {name} peak"
    else:
        caption += "; no limit line (device unknown in env.json)"
    _legend(ax)
    return fig, caption


def response_length(m: Metrics, env: dict) -> "tuple[Figure, str] | str":
    if not m.has("response_length/mean"):
        return _missing("response_length/mean")
    fig, ax = _figure("tokens")
    _curve(ax, m, "response_length/mean", "mean", PALETTE[0], band=("response_length/min", "response_length/max"))
    caption = f"last mean {m.last('response_length/mean'):.4g} tokens"
    if m.has("response_length/clip_ratio"):
        ax2 = ax.twinx()
        s, v = m.series("response_length/clip_ratio")
        ax2.plot(s, v, color=PALETTE[3], linewidth=1.0, linestyle="--", label="clip ratio")
        ax2.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax2.set_ylabel("clipped at max length", color=PALETTE[3], fontsize=8.5)
        ax2.tick_params(colors=PALETTE[3], labelsize=8.5)
        ax2.spines["top"].set_visible(False)
        ax2.legend(fontsize=8, frameon=False, loc="lower right")
        caption += f"; clipped {m.last('response_length/clip_ratio'):.1%}"
    _legend(ax)
    return fig, caption


def agent_turns(m: Metrics, env: dict) -> "tuple[Figure, str] | str | None":
    """Multi-turn runs only (polyrl/agents): turns and tool calls per trajectory, and tool errors."""
    if not m.has("num_turns/mean"):
        return None
    return _lines(m, [("num_turns/mean", "turns / trajectory"), ("num_turns/max", "turns, max"),
                      ("tool_calls/mean", "tool calls / trajectory"), ("tool_calls/errors", "tool errors")], "count")


def agent_prefill(m: Metrics, env: dict) -> "tuple[Figure, str] | str | None":
    """Multi-turn runs only: prompt tokens the kept KV caches spared from prefilling again, beside those prefilled,
    and a trajectory's seconds in tool calls (the mean over trajectories)."""
    if not m.has("rollout/prefill_tokens_saved"):
        return None
    return _lines(m, [("rollout/prefill_tokens_saved", "prefill tokens saved"),
                      ("rollout/prefill_tokens", "prefill tokens"),
                      ("timing_s/tool_calls", "tool seconds / trajectory")], "")


PLOTS: list[Plot] = [
    Plot("reward", "Reward", reward),
    Plot("validation", "Validation", validation),
    Plot("timing", "Step time by stage", step_time),
    Plot("throughput", "Throughput", throughput),
    Plot("mfu", "MFU", mfu),
    Plot("response_length", "Response length", response_length),
    Plot("kl", "KL", lambda m, e: _lines(m, [("actor/ppo_kl", "ppo_kl"), ("actor/kl_loss", "kl_loss")], "KL")),
    Plot("entropy", "Entropy", lambda m, e: _lines(m, [("actor/entropy", "entropy")], "nats / token")),
    Plot(
        "clipfrac",
        "Clip fraction",
        lambda m, e: _lines(
            m,
            [("actor/pg_clipfrac", "pg_clipfrac"), ("actor/pg_clipfrac_lower", "lower"),
             ("actor/pg_clipfrac_higher", "higher")],  # fmt: skip
            "fraction of tokens",
            percent=True,
        ),
    ),
    Plot("agent_turns", "Turns and tool calls", agent_turns),
    Plot("agent_prefill", "Prefill saved between turns", agent_prefill),
    Plot(
        "zero_std",
        "Zero-std groups",
        lambda m, e: _lines(m, [("critic/rewards/zero_std_ratio", "zero_std_ratio")], "groups", percent=True),
    ),
]


# test hook (docs/switches.md): the suite builds every run's figures but skips drawing them (~2 CPU-s a report, a
# third of a short training test); tests/test_report_on_cpu.py draws them
BLANK_PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4//8/AAX+Av4N70a4AAAAAElFTkSuQmCC")


def render_png(fig: Figure) -> bytes:
    if os.environ.get("POLYRL_REPORT_BLANK_PLOTS") == "1":
        return BLANK_PNG
    buf = io.BytesIO()
    fig.savefig(buf, format="png", facecolor="white")
    return buf.getvalue()
