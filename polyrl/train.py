"""`python -m polyrl.train KEY=VALUE ...`: the same as `polyrl train` (verl's `python3 -m verl.trainer.main_ppo`)."""

import sys

from polyrl.cli import main
from polyrl.distributed.launch import exit_child

if __name__ == "__main__":
    exit_child(main(["train", *sys.argv[1:]]))
