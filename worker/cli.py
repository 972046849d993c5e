"""``kvpool worker ...``: commands of the inference worker.

* ``make-tiny-model DIR``: write the deterministic tiny random Llama model and tokenizer
  that tests and the local demo run;
* ``generate --model DIR PROMPT...``: run prompts through the engine and print the text,
  a quick check that a model directory loads and generates.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvpool.cli import configure_logging

from .config import ModelLoadError
from .tiny import ARCHITECTURES


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from .tiny import make_tiny_model

    hf_logging.disable_progress_bar()
    path = make_tiny_model(args.dir, seed=args.seed, architecture=args.architecture)
    print(f"wrote a tiny random {args.architecture} model to {path}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from .engine import EngineConfig, LLMEngine
    from .sequence import SamplingParams

    config = EngineConfig(
        num_blocks=args.num_blocks, device=args.device, dtype=args.dtype, seed=args.seed
    )
    engine = LLMEngine.from_pretrained(args.model, config)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )
    for done in engine.generate(args.prompts, params):
        line = {"text": done.text, "token_ids": done.token_ids, "finish": done.finish_reason}
        print(json.dumps(line, ensure_ascii=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool worker", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write a tiny random Llama model and tokenizer")
    p.add_argument("dir", help="directory to write (created if missing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--architecture", choices=sorted(ARCHITECTURES), default="llama")
    p.set_defaults(func=_cmd_make_tiny_model)

    p = sub.add_parser("generate", help="generate text for prompts with a model directory")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.set_defaults(func=_cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    try:
        return args.func(args)
    except (ModelLoadError, ValueError) as exc:
        parser.exit(2, f"kvpool worker: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
