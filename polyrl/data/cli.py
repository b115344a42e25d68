"""`polyrl data ...`: write the synthetic tasks as parquet, and convert a local GSM8K jsonl.

  polyrl data synth --task addition --out DIR [--train N --val N --seed S]   -> DIR/train.parquet, DIR/val.parquet
  polyrl data gsm8k --input FILE.jsonl --out DIR [--split train]            -> DIR/<split>.parquet
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from polyrl.data.dataset import write_parquet
from polyrl.data.gsm8k import convert_jsonl
from polyrl.data.synthetic import TASKS, make_rows
from polyrl.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polyrl data", description="Write datasets in verl's parquet schema.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("synth", help="write a built-in synthetic task as train/val parquet files")
    s.add_argument("--task", required=True, choices=sorted(TASKS), help="which task")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--train", type=int, default=2000, help="number of training prompts")
    s.add_argument("--val", type=int, default=200, help="number of held-out prompts (never among the training ones)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed")
    g = sub.add_parser("gsm8k", help="convert a GSM8K-format jsonl (question, answer ending in '#### N')")
    g.add_argument("--input", required=True, help="jsonl file")
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument("--split", default="train", help="split name: output file name and extra_info.split (train/test)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = Path(args.out)
        if args.command == "synth":
            for split, num in (("train", args.train), ("val", args.val)):
                path = write_parquet(make_rows(args.task, num, args.seed, split), out / f"{split}.parquet")
                print(f"wrote {num} {args.task} prompts to {path}")
        else:
            rows = convert_jsonl(args.input, args.split)
            path = write_parquet(rows, out / f"{args.split}.parquet")
            print(f"wrote {len(rows)} GSM8K prompts to {path}")
    except UserError as e:
        if os.environ.get("POLYRL_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
