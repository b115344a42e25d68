"""Build everything the reward-model docs' examples need, on a CPU, in about a minute (no downloads).

    python examples/reward_models/tiny_reward_models.py /tmp/rm_demo

writes to that folder:
  policy/            a random tiny Llama policy with the character tokenizer
  data/              the synthetic `reverse` task as verl-schema parquet (train, val)
  digit_rm/          a tiny LlamaForSequenceClassification trained to score a response's digit fraction
  digit_judge/       a tiny causal LM judge trained to answer 1 (the response holds a digit) or 0
  digit_judge_judge.py  the judge's prompt template and score parser (reward_model.judge.path)
and prints the `polyrl train` command lines of docs/reward_models.md.
"""

import sys
from pathlib import Path

import torch

from polyrl.data.dataset import write_parquet
from polyrl.data.synthetic import make_rows
from polyrl.models.tiny import build_tiny_model
from polyrl.models.tiny_reward import train_digit_classifier, train_digit_judge


def main(out: Path) -> None:
    torch.set_num_threads(1)  # tiny models: a second thread only adds spin-waits
    policy = build_tiny_model(out / "policy", hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate=64,
                              max_position_embeddings=128)
    write_parquet(make_rows("reverse", 64, seed=1, split="train"), out / "data" / "train.parquet")
    write_parquet(make_rows("reverse", 16, seed=1, split="val"), out / "data" / "val.parquet")
    rm = train_digit_classifier(out / "digit_rm")
    judge, judge_file = train_digit_judge(out / "digit_judge")
    common = (f"data.train_files={out}/data/train.parquet data.val_files={out}/data/val.parquet "
              f"data.train_batch_size=16 data.max_prompt_length=32 data.max_response_length=6 "
              f"actor_rollout_ref.model.path={policy} actor_rollout_ref.actor.optim.lr=2e-2 "
              f"actor_rollout_ref.actor.ppo_mini_batch_size=16 actor_rollout_ref.rollout.n=8 "
              f"trainer.total_training_steps=8 trainer.device=cpu trainer.logger=[console]")
    print(f"\n# a discriminative reward model (legacy keys)\npolyrl train {common} \\\n"
          f"  reward_model.enable=True reward_model.model.path={rm}")
    print(f"\n# the same in verl 0.9's layout\npolyrl train {common} \\\n"
          f"  reward.reward_model.enable=True reward.reward_model.model_path={rm}")
    print(f"\n# a generative judge on the native engine\npolyrl train {common} \\\n"
          f"  reward_model.enable=True reward_model.model.path={judge} reward_model.judge.path={judge_file} \\\n"
          f"  reward_model.rollout.do_sample=False reward_model.rollout.response_length=2 "
          f"reward_model.rollout.prompt_length=96")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "rm_demo").resolve())
