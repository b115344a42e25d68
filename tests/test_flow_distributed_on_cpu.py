"""Data-parallel FlowGRPO on CPU (gloo): 2 processes give the 1-process steps, and their checkpoint resumes in 1.

The 2-process job is this file under torchrun (`__main__` at the bottom); it runs LoRA and full fine-tuning of the
tiny quickstart transformer (random init) for 2 steps each, with a KL term, validation and a checkpoint. Each
sample's noise is seeded by (seed, step, global sample index), so both process counts roll out the same samples and
any difference comes from the distributed code (prompt sharding, FSDP2, reward gather, normalisers, padding passes).
One prompt's reward is constant, so its group has zero std, is skipped, and the rank holding it runs padding passes.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl.distributed.launch import torchrun_command
from polyrl.errors import ConfigError
from polyrl.trainer import flow_quickstart
from polyrl.models.diffusion import tiny
from polyrl.trainer.flow_config import FlowConfig
from polyrl.trainer.flow_grpo import FlowGRPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")  # the 2-process job runs beside these tests (conftest.one_thread)

TOL = dict(rtol=1e-4, atol=1e-6)  # float summation order (reduce-scatter vs local accumulation) and nothing else
WEIGHT_TOL = dict(rtol=0.0, atol=2e-6)  # measured: 1.2e-7; one Adam step at lr 1e-3 moves a weight ~1e-3


class Recorder:
    """A tracker that keeps the logged rows."""

    def __init__(self):
        self.rows = []

    def log(self, metrics, step):
        self.rows.append({"step": step, **metrics})

    def log_images(self, *args, **kwargs):
        pass

    def close(self):
        pass


def reward(images, prompts, metadata):
    """Mean brightness; digit 0 always scores 0.5 (a zero-std group)."""
    score = images.float().mean(dim=(1, 2, 3))
    return torch.where(torch.tensor([m["digit"] == 0 for m in metadata]), torch.full_like(score, 0.5), score)


def make_trainer(lora: bool, run_dir: Path, steps: int, tracker=None) -> FlowGRPOTrainer:
    cfg = FlowConfig()
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    ro.n, ro.pipeline.num_inference_steps = 2, 4
    ro.algo.sde_window_size, ro.algo.sde_window_range = 2, [0, 3]
    ro.val_kwargs.num_inference_steps = 3
    cfg.data.train_batch_size, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = 4, 2, 2
    actor.optim.lr, actor.diffusion_loss.clip_ratio = 1e-3, 0.5
    actor.use_kl_loss, actor.kl_loss_coef = True, 0.05
    m = cfg.actor_rollout_ref.model
    m.lora_rank, m.lora_alpha = (4, 8) if lora else (0, m.lora_alpha)
    t = cfg.trainer
    t.total_training_steps, t.test_freq, t.save_freq, t.val_before_train = steps, 2, 2, False
    t.run_dir, t.default_local_dir, t.progress_bar = str(run_dir), str(run_dir / "checkpoints"), False
    torch.manual_seed(0)
    policy = flow_quickstart.make_policy(cfg, tiny.build_transformer(seed=0), tiny.CharPromptEncoder(seed=0))
    prompts = [(tiny.prompt_for(d), {"digit": d}) for d in range(4)]
    return FlowGRPOTrainer(cfg, policy, reward, prompts, prompts[:3], tracker=tracker)  # 3 val prompts: uneven


def run(lora: bool, run_dir: Path, steps: int) -> list[dict]:
    rec = Recorder()
    make_trainer(lora, run_dir, steps, rec).fit()
    return rec.rows


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The trained weights of a checkpoint: one process's model.safetensors, or several processes' DCP shards."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = run_dir / "checkpoints" / f"global_step_{step}"
    if not (folder / "dcp").is_dir():
        return load_file(str(folder / "model.safetensors"))
    dcp_to_torch_save(folder / "dcp", run_dir / f"full_{step}.pt")
    return torch.load(run_dir / f"full_{step}.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def two_process_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("flow_dp")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path.cwd())}
    job = subprocess.Popen(torchrun_command(2, [__file__, str(out)]), env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    yield job, out
    if job.poll() is None:  # a test failed before waiting for it
        job.kill()
        job.communicate()


def _finished(job, out: Path) -> Path:
    if job.returncode is None:
        log, _ = job.communicate(timeout=240)
        job.log = log
    assert job.returncode == 0, job.log[-3000:]
    return out


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_two_processes_match_one_and_resume_in_one(two_process_job, tmp_path, lora):
    job, out = two_process_job
    one = tmp_path / "one"
    rows1 = run(lora, one, 3)  # meanwhile: the same run, 3 steps, in this process
    two = _finished(job, out) / ("lora" if lora else "full")
    rows2 = json.loads((two / "rows.json").read_text())
    assert [r["step"] for r in rows2] == [1, 2]  # rank 0 alone logs
    for a, b in zip(rows1[:2], rows2):
        assert a["critic/rewards/zero_std_ratio"] == b["critic/rewards/zero_std_ratio"] == 0.25
        for key in ("critic/rewards/mean", "critic/advantages/max", "actor/pg_loss", "actor/kl_loss",
                    "actor/grad_norm", "actor/ratio_mean", "actor/num_trained_samples"):  # fmt: skip
            assert b[key] == pytest.approx(a[key], rel=TOL["rtol"], abs=TOL["atol"]), (key, a[key], b[key])
    val = "val-core/digits/reward/mean@1"
    assert rows2[1][val] == pytest.approx(rows1[1][val], rel=1e-6)  # validation gathered over both ranks
    w1, w2 = weights(one, 2), weights(two, 2)  # the checkpoints: one file set, and the 2 ranks' DCP shards
    assert set(w2) == set(w1) and all(("lora" in k) == lora for k in w1)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], **WEIGHT_TOL)

    # the 2-process checkpoint, resumed in ONE process for step 3, lands on the 1-process run's weights
    resumed = tmp_path / "resumed"
    shutil.copytree(two / "checkpoints", resumed / "checkpoints")  # the same checkpoint code as the LLM trainer's
    rows3 = run(lora, resumed, 3)
    assert [r["step"] for r in rows3] == [3]
    assert rows3[0]["actor/pg_loss"] == pytest.approx(rows1[2]["actor/pg_loss"], rel=TOL["rtol"], abs=TOL["atol"])
    w3, w1_3 = weights(resumed, 3), weights(one, 3)
    assert max(float((w3[k] - w2[k]).abs().max()) for k in w1) > 1e-4  # step 3 moved them: matching means something
    for k in w1:  # the AdamW moments came back too, or step 3 would differ
        torch.testing.assert_close(w3[k], w1_3[k], **WEIGHT_TOL)


def test_blocks_of_a_diffusers_transformer_are_found():
    from polyrl.distributed.parallelize import transformer_blocks

    model = tiny.build_transformer()
    assert transformer_blocks(model) == list(model.transformer_blocks)


def test_cli_checks_once_then_relaunches_under_torchrun(monkeypatch, tmp_path):
    from polyrl.trainer import flow_cli

    calls = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    argv = [f"actor_rollout_ref.model.path={tmp_path}", "trainer.n_gpus_per_node=2"]
    with pytest.raises(ConfigError, match="ppo_mini_batch_size=5 prompts cannot be split over 2"):
        flow_cli.main(["train", *argv])
    assert not calls
    argv += ["actor_rollout_ref.actor.ppo_mini_batch_size=2"]
    assert flow_cli.main(["train", *argv]) == 0
    assert calls[0][1:] == ["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m", "polyrl",
                            "flow", "train", *argv]  # fmt: skip


if __name__ == "__main__":  # the 2-process job: both fine-tuning modes, results written by rank 0
    out = Path(sys.argv[1])
    for lora in (True, False):
        name = "lora" if lora else "full"
        rows = run(lora, out / name, 2)
        if torch.distributed.get_rank() == 0:
            (out / name / "rows.json").write_text(json.dumps(rows))
    torch.distributed.destroy_process_group()
