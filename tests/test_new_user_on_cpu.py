"""What a new user meets first (issues 25 and 21), through the real `polyrl train` on a tiny bf16 model:
- with output sent to a file, exactly one line per logged step starts with `step` (no progress-bar redraws);
- the printed validation samples show the prompt as the model saw it, chat-template special tokens included;
- the HF export keeps the input model's dtype (bf16 in, bf16 out) unless trainer.export_dtype says otherwise, and the
  final line gives its size;
- each run gets its own run directory unless it resumes; a resumed run appends to its own, never to another's.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from polyrl.cli import main as cli_main
from polyrl.models.loader import saved_weights_dtype

@pytest.fixture(scope="module")
def bf16_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model stored in bf16, as real checkpoints are (SmolLM2-135M-Instruct ships bf16 safetensors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("bf16") / "model"
    AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(out)
    assert saved_weights_dtype(str(out)) == torch.bfloat16
    return out


def _args(model_dir, data_dir, steps, *extra, val=True):
    return ["algorithm.adv_estimator=grpo", f"data.train_files={data_dir / 'train.parquet'}",
            *([f"data.val_files={data_dir / 'val.parquet'}"] if val else []), "data.train_batch_size=4",
            "data.max_prompt_length=32",
            "data.max_response_length=6", f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.n=2",
            f"trainer.total_training_steps={steps}", *extra]


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_log_file_samples_and_export_of_a_run_sent_to_a_file(bf16_model_dir, synth_data_dir, tmp_path, monkeypatch,
                                                             capfd):
    monkeypatch.chdir(tmp_path)  # default run and checkpoint folders; capfd sends fds 1 and 2 to files, not a TTY
    code = cli_main(["train", *_args(bf16_model_dir, synth_data_dir, 3, "trainer.log_val_generations=2",
                                     "trainer.test_freq=1", "trainer.logger=[console,file]")])  # bar: default (on)
    out, err = capfd.readouterr()
    text = out + err
    assert code == 0, text[-3000:]
    assert "\r" not in text  # no bar redraws (ours or transformers') in a file
    lines = out.splitlines()
    step_lines = [line for line in lines if line.startswith("step")]
    assert [int(line.split()[1]) for line in step_lines] == [0, 1, 2, 3], step_lines  # 0: validation before training
    assert all("score" in line for line in step_lines[1:])

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bf16_model_dir))
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    specials = [s for s in tok.all_special_tokens if s in rendered]
    assert specials, rendered  # the template does use special tokens (<|im_start|>, <|im_end|>)
    samples = [line for line in lines if line.startswith("[val 0] prompt=")]
    assert len(samples) == 4  # before training and after each of the 3 steps (test_freq=1)
    for s in specials:
        assert s in samples[0], (s, samples[0])

    runs = list((tmp_path / "runs" / "polyrl" / "run").iterdir())
    assert len(runs) == 1 and _steps(runs[0]) == [0, 1, 2, 3]
    export = tmp_path / "checkpoints" / "polyrl" / "run" / "global_step_3" / "huggingface"
    assert saved_weights_dtype(str(export)) == saved_weights_dtype(str(bf16_model_dir)) == torch.bfloat16
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    last = lines[-1]
    assert last.startswith("polyrl: done;") and str(runs[0].name) in last, last
    assert re.search(r"HF export \S+huggingface \([\d.]+ [KMG]?B in bfloat16\)", last), last


def test_each_run_gets_its_own_directory_unless_it_resumes(bf16_model_dir, synth_data_dir, tmp_path, monkeypatch,
                                                           capsys):
    monkeypatch.chdir(tmp_path)  # the default run and checkpoint folders are relative
    quiet = ["trainer.logger=[file]", "actor_rollout_ref.rollout.name=hf"]
    assert cli_main(["train", *_args(bf16_model_dir, synth_data_dir, 1, *quiet, val=False)]) == 0
    root = tmp_path / "runs" / "polyrl" / "run"
    (first,) = root.iterdir()
    assert _steps(first) == [1]
    with open(first / "metrics.jsonl", "a") as f:  # a row the run logged after its last checkpoint, then crashed
        f.write(json.dumps({"step": 2, "critic/score/mean": -1.0}) + "\n")

    # the same command, two steps: it resumes step 1's checkpoint and goes on in the first run's directory
    assert cli_main(["train", *_args(bf16_model_dir, synth_data_dir, 2, *quiet, val=False)]) == 0
    assert list(root.iterdir()) == [first]
    rows = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["critic/score/mean"] != -1.0

    # a fresh run (no resume) of the same experiment gets a directory of its own; export dtype as asked
    assert cli_main(["train", *_args(bf16_model_dir, synth_data_dir, 1, *quiet, "trainer.resume_mode=disable",
                                     "trainer.export_dtype=float32", val=False)]) == 0
    (second,) = set(root.iterdir()) - {first}
    assert _steps(second) == [1] and _steps(first) == [1, 2]
    export = tmp_path / "checkpoints" / "polyrl" / "run" / "global_step_1" / "huggingface"
    assert saved_weights_dtype(str(export)) == torch.float32
    capsys.readouterr()

    # a named run directory holding another run is refused when nothing is resumed
    assert cli_main(["train", *_args(bf16_model_dir, synth_data_dir, 1, *quiet, "trainer.resume_mode=disable",
                                     f"trainer.run_dir={first}", val=False)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"trainer.run_dir={first}" in err and "metrics.jsonl" in err, err
    assert _steps(first) == [1, 2]


def test_docs_state_real_model_costs_from_the_benchmark_script():
    """Every `benchmarks/real_model_cost.py` row of the benchmark history (CPU, GPU) is quoted in the docs site's cost
    section."""
    root = Path(__file__).resolve().parent.parent
    history = [json.loads(line) for line in (root / "benchmarks" / "history.jsonl").read_text().splitlines()]
    rows = [(r["date"], r["device"], r["title"], r["shape"], r["polyrl"]) for r in history
            if r["benchmark"] == "real_model_cost"]
    assert rows, "benchmarks/history.jsonl has no row from benchmarks/real_model_cost.py"
    readme = (root / "docs" / "install.md").read_text()
    section = readme[readme.index("## What a real model costs"):] + "\n## "
    section = section[: section.index("\n## ", 3)]
    assert "benchmarks/real_model_cost.py" in section
    for date, device, _, shape, value, *_ in rows:
        assert value in section and device in section, (device, value)
    assert any(row[1].startswith("CPU") for row in rows)
