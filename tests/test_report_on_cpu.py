import base64
import importlib.util
import io
import json
import os
from html.parser import HTMLParser
from pathlib import Path

import pytest

from polyrl.errors import UserError
from polyrl.report import build_report, collect_env, main
from polyrl.report.demo import write_synthetic_run
from polyrl.report.metrics import load_metrics
from polyrl.report.plots import mfu, step_time

PLOT_IDS = ["reward", "validation", "timing", "throughput", "mfu", "response_length", "kl", "entropy", "clipfrac",
            "zero_std", "samples"]  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def drawn_plots():
    """The report's figures drawn (conftest.py has the rest of the suite skip drawing them)."""
    blank = os.environ.pop("POLYRL_REPORT_BLANK_PLOTS", None)
    yield
    if blank is not None:
        os.environ["POLYRL_REPORT_BLANK_PLOTS"] = blank


class _Page(HTMLParser):
    """Collects, per element id starting with plot-, the images inside it; and every external reference."""

    def __init__(self):
        super().__init__()
        self.stack: list[str | None] = []
        self.images: dict[str, list[str]] = {}
        self.external: list[str] = []
        self.scripts = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script":
            self.scripts += 1
        for key in ("src", "href"):
            if a.get(key, "").startswith(("http:", "https:", "//")):
                self.external.append(a[key])
        if tag == "img":
            owner = next((i for i in reversed(self.stack) if i), None)
            if owner:
                self.images.setdefault(owner, []).append(a["src"])
        if tag not in ("img", "meta", "br", "input", "link"):
            self.stack.append(a.get("id") if (a.get("id") or "").startswith("plot-") else None)

    def handle_endtag(self, tag):
        if tag not in ("img", "meta", "br", "input", "link") and self.stack:
            self.stack.pop()


def _parse(path: str) -> _Page:
    page = _Page()
    page.feed(Path(path).read_text())
    return page


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("run") / "grpo_demo")
    write_synthetic_run(run_dir, num_steps=40)
    return run_dir, build_report(run_dir)


def test_report_has_an_embedded_png_for_every_plot(synthetic):
    from PIL import Image

    run_dir, path = synthetic
    assert path == os.path.join(run_dir, "report.html")
    page = _parse(path)
    assert sorted(page.images) == sorted(f"plot-{i}" for i in PLOT_IDS)
    for plot_id, srcs in page.images.items():
        for src in srcs:
            assert src.startswith("data:image/png;base64,"), plot_id
            img = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
            assert img.format == "PNG" and img.width >= 150, plot_id
    assert len(page.images["plot-samples"]) == 3  # steps 1, 20 and 40
    assert page.external == [] and page.scripts == 0  # self-contained: opens offline, nothing runs


def test_report_shows_titles_summary_config_env_and_crash_warnings(synthetic):
    _, path = synthetic
    text = Path(path).read_text()
    for title in ["Reward", "Validation", "Step time by stage", "Throughput", "MFU", "Response length", "KL",
                  "Entropy", "Clip fraction", "Zero-std groups", "Samples"]:  # fmt: skip
        assert f"<h2>{title}</h2>" in text
    assert "NVIDIA H100 80GB HBM3" in text and "989" in text  # env.json drives the limit lines
    assert "algorithm.adv_estimator" in text and "grpo" in text  # config highlights
    assert "1 line(s) of metrics.jsonl could not be read" in text  # the half-written last line
    assert "<code>actor/pg_loss</code> was NaN or inf at step(s) 20" in text
    assert "Not shown" not in text  # every plot had its metric


def test_report_from_a_sparse_crashed_run_skips_missing_plots_with_a_note(tmp_path):
    rows = [{"step": s, "critic/rewards/mean": s / 10, "timing_s/gen": 1.0, "timing_s/step": 1.5} for s in (1, 2, 3)]
    text = "\n".join(json.dumps(r) for r in rows) + '\n{"step": 4, "crit'
    (tmp_path / "metrics.jsonl").write_text(text)
    page = _parse(build_report(str(tmp_path)))
    assert sorted(page.images) == ["plot-reward", "plot-timing"]  # reward falls back to critic/rewards/mean
    html = (tmp_path / "report.html").read_text()
    assert "<code>perf/mfu/actor</code>" in html and "<code>val-core/*</code>" in html  # notes name the metric
    assert "collected now" in html  # no env.json: the environment is collected at report time
    assert "no config.yaml" in html


def test_resumed_run_keeps_the_later_row_per_step(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 2, "a": 5.0, "b": null}\nnot json\n')
    m = load_metrics(str(p))
    assert m.steps == [1, 2] and m.series("a")[1].tolist() == [1.0, 5.0]
    assert m.non_finite == {"b": [2]} and m.bad_lines == 1


def test_step_time_stacks_stages_but_not_the_total(tmp_path):
    stages = {"timing_s/gen": 2.0, "timing_s/reward": 0.25, "timing_s/update_actor": 0.75}
    rows = [{"step": s, **stages, "timing_s/step": 3.5} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)))
    fig, caption = step_time(load_metrics(str(tmp_path / "metrics.jsonl")), {})
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    # legend reads like the stack, top layer first (update_actor above gen); the total is a line, not a layer
    assert labels == ["step (total)", "update_actor", "reward", "gen"]
    assert "gen 67%" in caption and "untimed per step 0.5 s" in caption


def test_mfu_draws_the_device_limit_only_when_known(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "perf/mfu/actor": 0.3}\n{"step": 2, "perf/mfu/actor": 0.35}')
    m = load_metrics(str(tmp_path / "metrics.jsonl"))
    fig, _ = mfu(m, {"device_name": "NVIDIA H200", "peak_flops": 989e12, "measured_gemm_flops": 788e12})
    flat = [line.get_ydata()[0] for line in fig.axes[0].lines if len(set(line.get_ydata())) == 1]
    assert 1.0 in flat and pytest.approx(788 / 989) in flat
    fig, caption = mfu(m, {"device_name": "cpu"})
    assert "no limit line" in caption


def test_collect_env_and_cli(tmp_path, capsys):
    import torch

    env = collect_env(torch.nn.Linear(3, 2))
    assert env["torch"] == torch.__version__ and env["model_num_params"] == 8 and env["python"]
    json.dumps(env)  # trainers write it as env.json
    assert main([str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    out = tmp_path / "r.html"
    assert main([str(tmp_path), "-o", str(out)]) == 0 and out.is_file()
    with pytest.raises(UserError, match="trainer.logger includes 'file'"):
        build_report(str(tmp_path / "missing"))


def test_report_loads_in_headless_chromium(synthetic, tmp_path):
    spec = importlib.util.spec_from_file_location("check_browser", ROOT / "scripts" / "check_report_in_browser.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    if check.find_chromium() is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium); the browser check needs it")
    result = check.check_report(synthetic[1], screenshot=str(tmp_path / "shot.png"))
    assert result["ok"], result
    assert result["loaded"] == result["images"] == 13  # 10 plots + 3 sample grids
    assert os.path.getsize(tmp_path / "shot.png") > 50_000
