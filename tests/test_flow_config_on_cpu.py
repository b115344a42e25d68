"""FlowGRPO config keys (VeRL-Omni names) and the errors a user sees for bad input."""

import pytest

from polyrl.config import build_config
from polyrl.errors import ConfigError, DataError, UserError
from polyrl.trainer import flow_cli
from polyrl.trainer.flow_config import FlowConfig


def test_verl_omni_keys_parse():
    cfg = build_config(FlowConfig(), [
        "actor_rollout_ref.rollout.algo.sde_type=cps", "actor_rollout_ref.rollout.algo.noise_level=0.8",
        "actor_rollout_ref.rollout.pipeline.true_cfg_scale=4.0", "actor_rollout_ref.actor.diffusion_loss.clip_ratio=0.00001",
        "actor_rollout_ref.model.lora_rank=64", "algorithm.global_std=false", "reward.async_reward=true",
        "actor_rollout_ref.rollout.algo.sde_window_range=[0,5]",
    ])  # fmt: skip
    ro = cfg.actor_rollout_ref.rollout
    assert ro.algo.sde_type == "cps" and ro.pipeline.true_cfg_scale == 4.0 and ro.algo.sde_window_range == [0, 5]
    assert cfg.actor_rollout_ref.actor.diffusion_loss.clip_ratio == 1e-5 and not cfg.algorithm.global_std
    with pytest.raises(ConfigError, match="noise_level"):
        build_config(FlowConfig(), ["actor_rollout_ref.rollout.algo.noise_levl=0.8"])


def test_cli_errors_name_the_culprit(tmp_path):
    with pytest.raises(UserError, match="Unknown flow command"):
        flow_cli.main(["trian"])
    with pytest.raises(DataError, match="does not exist"):
        flow_cli.load_prompts(str(tmp_path / "missing.txt"))
    (tmp_path / "p.txt").write_text('a sign that reads "hi"\n\nsecond\n')
    assert flow_cli.load_prompts(str(tmp_path / "p.txt")) == [('a sign that reads "hi"', {}), ("second", {})]
    with pytest.raises(ConfigError, match="model_index.json"):
        flow_cli.main(["train", f"actor_rollout_ref.model.path={tmp_path}", f"data.train_files={tmp_path / 'p.txt'}",
                  f"trainer.default_local_dir={tmp_path / 'run'}"])  # fmt: skip
    assert flow_cli.main([]) == 2
