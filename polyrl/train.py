"""`python -m polyrl.train KEY=VALUE ...`: the same as `polyrl train` (verl's `python3 -m verl.trainer.main_ppo`)."""

import sys

from polyrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
