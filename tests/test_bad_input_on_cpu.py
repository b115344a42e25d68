"""Bad input through `polyrl train`: one sentence naming the culprit and the fix, exit 2, checkpoints untouched."""

import hashlib
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polyrl.cli import main as cli_main
from polyrl.data.dataset import read_parquet_rows, write_parquet


def _hash_tree(root):
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _args(model_dir, train, ckpt, run, *extra):
    return ["train", f"data.train_files={train}", "data.train_batch_size=4", "data.max_prompt_length=32",
            "data.max_response_length=6", f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=2", "trainer.logger=[file]",
            f"trainer.run_dir={run}", f"trainer.default_local_dir={ckpt}", "trainer.total_training_steps=2",
            "trainer.progress_bar=False", *extra]


@pytest.fixture(scope="module")
def workspace(tiny_model_dir, synth_data_dir, tmp_path_factory):
    """A finished 2-step run whose checkpoints every bad run below must leave intact."""
    ws = tmp_path_factory.mktemp("bad")
    assert cli_main(_args(tiny_model_dir, synth_data_dir / "train.parquet", ws / "ckpt", ws / "run")) == 0
    return ws


def _bad_files(d, synth_data_dir):
    rows = read_parquet_rows(str(synth_data_dir / "train.parquet"))
    (d / "corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    write_parquet([{k: v for k, v in r.items() if k != "reward_model"} for r in rows], d / "no_reward_model.parquet")
    pq.write_table(pa.table({"data_source": pa.array([], pa.string()), "prompt": pa.array([], pa.string()),
                             "reward_model": pa.array([], pa.struct([("ground_truth", pa.string())]))}),
                   d / "empty.parquet")
    write_parquet([{**r, "prompt": 7} for r in rows], d / "int_prompt.parquet")
    write_parquet([{**r, "prompt": [{"role": "user", "content": "x" * 200}]} for r in rows], d / "long.parquet")
    (d / "reward_raises.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                        "    raise ValueError('boom')\n")
    (d / "reward_nan.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                     "    return float('nan')\n")
    (d / "reward_other.py").write_text("def my_score(*a):\n    return 1.0\n")


CASES = [
    # (name, train file, extra overrides, words the last line must contain)
    ("corrupt parquet", "corrupt.parquet", [], ["corrupt.parquet"]),
    ("missing column", "no_reward_model.parquet", [], ["reward_model"]),
    ("empty dataset", "empty.parquet", [], ["empty.parquet"]),
    ("wrong value type", "int_prompt.parquet", [], ["prompt"]),
    ("prompt too long", "long.parquet", ["data.truncation=error"], ["max_prompt_length", "filter_overlong_prompts"]),
    ("unknown key", None, ["actor_rollout_ref.actor.clip_ration=0.2"], ["clip_ratio"]),
    ("wrong type", None, ["trainer.total_training_steps=many"], ["trainer.total_training_steps"]),
    ("batch sizes", None, ["actor_rollout_ref.actor.ppo_mini_batch_size=3"], ["ppo_mini_batch_size=3", "4"]),
    ("missing model dir", None, ["actor_rollout_ref.model.path=/nonexistent/model"], ["/nonexistent/model"]),
    ("no chat template", None, ["NO_TEMPLATE"], ["chat template"]),
    ("missing reward file", None, ["custom_reward_function.path=/nonexistent/reward.py"], ["/nonexistent/reward.py"]),
    ("missing reward fn", None, ["custom_reward_function.path=BAD/reward_other.py"], ["compute_score", "my_score"]),
    ("reward raises", None, ["custom_reward_function.path=BAD/reward_raises.py", "trainer.total_training_steps=3"],
     ["compute_score", "boom", "sample"]),
    ("unknown kv_cache_dtype", None, ["actor_rollout_ref.rollout.kv_cache_dtype=fp4"], ["kv_cache_dtype", "fp4"]),
    ("unknown quantization", None, ["actor_rollout_ref.rollout.quantization=int4"], ["quantization", "int4"]),
    ("vllm engine kwargs", None, ["+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4"],
     ["engine_kwargs.vllm.swap_space"]),
    ("unknown decode kernel", None, ["+actor_rollout_ref.rollout.engine_kwargs.native.decode_kernel=v9"],
     ["engine_kwargs.native.decode_kernel", "v9"]),
    ("kernel fallback not a boolean", None, ["+actor_rollout_ref.rollout.engine_kwargs.native.prefill_kernel=gather"],
     ["engine_kwargs.native.prefill_kernel", "gather", "True or False"]),
    ("fp8 kv needs native", None, ["actor_rollout_ref.rollout.kv_cache_dtype=fp8"], ["rollout.name=native"]),
    ("reward nan", None, ["custom_reward_function.path=BAD/reward_nan.py", "trainer.total_training_steps=3"],
     ["compute_score", "nan"]),
]


@pytest.mark.parametrize("name,train,extra,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, train, extra, words, workspace, tiny_model_dir, synth_data_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    _bad_files(bad, synth_data_dir)
    model = tiny_model_dir
    if "NO_TEMPLATE" in extra:
        model = tmp_path / "model_no_template"
        shutil.copytree(tiny_model_dir, model)
        (model / "chat_template.jinja").unlink()
        extra = [e for e in extra if e != "NO_TEMPLATE"]
    extra = [e.replace("BAD/", f"{bad}/") for e in extra]
    before = _hash_tree(workspace / "ckpt")
    train_file = bad / train if train else synth_data_dir / "train.parquet"
    code = cli_main(_args(model, train_file, workspace / "ckpt", tmp_path / "run", *extra))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    last = err[-1]
    assert last.startswith("polyrl: error:") and "Traceback" not in "\n".join(err)
    for w in words:
        assert w.lower() in last.lower(), (w, last)
    assert _hash_tree(workspace / "ckpt") == before


@pytest.mark.parametrize("argv", [["train", "--help"], ["sft", "-h"], ["flow", "train", "--help"],
                                  ["flow", "quickstart", "-h"]])  # fmt: skip
def test_help_points_at_the_keys(argv, capsys):
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: polyrl {' '.join(argv[:-1])} ") and "polyrl keys" in out


def test_keys_lists_one_trainer_under_a_prefix(capsys):
    assert cli_main(["keys", "flow", "reward.reward_model.judge."]) == 0
    keys = [line.split("\t")[0] for line in capsys.readouterr().out.strip().splitlines()]
    assert keys == ["reward.reward_model.judge.path", "reward.reward_model.judge.template",
                    "reward.reward_model.judge.parser", "reward.reward_model.judge.default_score"]
    assert cli_main(["keys", "train", "no.such.prefix"]) == 2
    assert "No train key starts with 'no.such.prefix'" in capsys.readouterr().err.strip().splitlines()[-1]
