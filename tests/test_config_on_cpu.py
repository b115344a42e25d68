"""The config machinery: YAML then CLI overrides, verl's syntax, and one-sentence errors."""

import pytest

from polyrl.config import build_config, save_config
from polyrl.errors import ConfigError
from polyrl.trainer.config import PPOConfig


def test_yaml_then_cli_overrides_with_verl_syntax(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("data:\n  train_batch_size: 64\n  max_prompt_length: 256\nactor_rollout_ref:\n  actor:\n"
                 "    optim:\n      lr: 3.0e-6\n")
    cfg = build_config(PPOConfig(), ["--config", str(y), "data.train_batch_size=32", "+trainer.logger=[console,file]",
                                     "trainer.logger=[\"console\",\"tensorboard\"]", "actor_rollout_ref.actor.optim.lr=1e-6",
                                     "trainer.experiment_name=7", "trainer.total_training_steps=null"])
    assert cfg.data.train_batch_size == 32 and cfg.data.max_prompt_length == 256  # CLI wins, YAML kept otherwise
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6  # "1e-6" is a float even though YAML 1.1 reads a string
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.trainer.experiment_name == "7" and cfg.trainer.total_training_steps is None
    save_config(cfg, tmp_path / "saved.yaml")
    again = build_config(PPOConfig(), ["--config", str(tmp_path / "saved.yaml")])
    assert again == cfg  # the saved config reproduces the run


@pytest.mark.parametrize("arg,words", [
    (["actor_rollout_ref.actor.ppo_mini_batchsize=4"], ["did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'"]),
    (["actor.clip_ratio=0.2"], ["did you mean 'actor_rollout_ref.actor.clip_ratio'"]),
    (["data.train_batch_size=abc"], ["data.train_batch_size", "integer"]),
    (["actor_rollout_ref.actor.use_kl_loss=maybe"], ["use_kl_loss", "true or false"]),
    (["data.truncation=sideways"], ["data.truncation", "'left'"]),
    (["trainer.total_epochs"], ["KEY=VALUE"]),
    (["--config", "/nonexistent.yaml"], ["/nonexistent.yaml"]),
])
def test_errors_name_the_key_and_the_fix(arg, words):
    with pytest.raises(ConfigError) as e:
        build_config(PPOConfig(), arg)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_bad_yaml_names_the_file(tmp_path):
    y = tmp_path / "bad.yaml"
    y.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        build_config(PPOConfig(), ["--config", str(y)])
