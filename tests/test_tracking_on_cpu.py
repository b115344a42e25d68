import glob
import json
import os

import numpy as np
import pytest
import torch

from polyrl.errors import ConfigError
from polyrl.utils.tracking import Tracker, image_grid, to_floats


def _tracker(tmp_path, loggers):
    return Tracker(loggers, str(tmp_path), project_name="p", experiment_name="e", config={"a": {"b": 1}})


def test_file_backend_writes_one_json_object_per_step(tmp_path):
    tr = _tracker(tmp_path, ["file"])
    tr.log({"critic/score/mean": torch.tensor(0.5), "actor/pg_loss": 1.25, "n": 3}, step=1)
    # flushed before close: a crashed run keeps its metrics
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "critic/score/mean": 0.5, "actor/pg_loss": 1.25, "n": 3.0}
    tr.log({"actor/pg_loss": float("nan"), "x": np.float32(2.0)}, step=2)
    tr.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    row = json.loads(lines[1], parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert row == {"step": 2, "actor/pg_loss": None, "x": 2.0}


def test_to_floats_rejects_non_scalars_with_the_key():
    with pytest.raises(ValueError, match="actor/entropy"):
        to_floats({"actor/entropy": torch.ones(3)})
    with pytest.raises(ValueError, match="note"):
        to_floats({"note": "hello"})
    assert to_floats({"a": torch.tensor([2.5], dtype=torch.bfloat16), "b": True}) == {"a": 2.5, "b": 1.0}


def test_tensorboard_writes_an_event_file(tmp_path):
    tr = _tracker(tmp_path, ["tensorboard", "file"])
    for step in range(1, 4):
        tr.log({"critic/score/mean": step / 10}, step=step)
    tr.close()
    events = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
    assert len(events) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = acc.Scalars("critic/score/mean")
    assert [s.step for s in scalars] == [1, 2, 3]
    assert scalars[-1].value == pytest.approx(0.3)


def test_console_prints_one_compact_line(tmp_path, capsys):
    tr = _tracker(tmp_path, "console")
    tr.log({"critic/score/mean": 0.75, "timing_s/step": 1.5, "val-core/gsm8k/acc/mean@1": 0.4, "z": 1.0}, step=7)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    assert "step 7" in out[0] and "0.75" in out[0] and "gsm8k/acc/mean@1" in out[0] and "+1 more" in out[0]


def test_unknown_logger_is_a_config_error_naming_key_value_and_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.logger.*'mlflow'.*console"):
        _tracker(tmp_path / "run", ["console", "mlflow"])
    assert not (tmp_path / "run").exists()


def test_missing_package_is_a_config_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"trainer\.logger.*'wandb'.*pip install wandb"):
        _tracker(tmp_path, ["wandb"])


def test_log_images_saves_a_png_grid(tmp_path):
    from PIL import Image

    tr = _tracker(tmp_path, ["file", "tensorboard"])
    imgs = [np.full((8, 10, 3), 40 * i, dtype=np.uint8) for i in range(5)]
    path = tr.log_images("samples", imgs, step=3)
    path2 = tr.log_images("val", [Image.new("RGB", (10, 8), "red")], step=3)
    tr.close()
    assert path == str(tmp_path / "samples" / "step_3.png")
    assert os.path.basename(path2) == "step_3_val.png"
    grid = Image.open(path)
    assert grid.size == (3 * 10 + 2 * 2, 2 * 8 + 2)  # 5 tiles -> 3 columns x 2 rows with 2 px gaps
    assert grid.getpixel((11 + 5, 4)) == (40, 40, 40)  # second tile
    assert grid.text["polyrl_tag"] == "samples"
    with pytest.raises(ValueError, match="uint8"):
        image_grid([np.zeros((4, 4, 3), dtype=np.float32)])


def test_wandb_backend_runs_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional (pip install wandb)")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    tr = _tracker(tmp_path, ["wandb"])
    tr.log({"critic/score/mean": 0.5}, step=1)
    tr.log_images("samples", [np.zeros((4, 4, 3), dtype=np.uint8)], step=1)
    tr.close()
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(runs) == 1 and glob.glob(os.path.join(runs[0], "*.wandb"))
