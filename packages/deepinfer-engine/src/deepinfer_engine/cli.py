"""Command line: `deepinfer-engine generate --model DIR --prompt TEXT ...` (also `python -m deepinfer_engine`).

Prints one line per prompt (`prompt -> completion` with its finish reason), or with `--json` one JSON object per
prompt. Any error — a bad argument, a missing checkpoint, an invalid environment variable — prints one line
`deepinfer-engine: error: ...` to stderr and exits with status 2 (usage) or 1 (everything else).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepinfer_sampling.params import StructuredOutputSpec

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for tests and documentation)."""
    parser = argparse.ArgumentParser(prog="deepinfer-engine", description="DeepInfer offline inference engine")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("--model", default=None, help="checkpoint directory or HF repo id (default: built-in tiny)")
    gen.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1)")
    gen.add_argument("--top-k", type=int, default=-1, help="-1 disables (default)")
    gen.add_argument("--seed", type=int, default=None, help="per-call sampling seed (seq_seed)")
    gen.add_argument("--json-schema", default=None, help="JSON Schema text, or @path to a file holding it")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: detect)")
    gen.add_argument("--precision", choices=("exact", "fp32"), default="exact")
    gen.add_argument(
        "--nextn",
        type=int,
        default=None,
        help="DSpark draft tokens per step (default: DEEPINFER_USE_NEXTN_DECODE, 5; 0 without DSpark blocks)",
    )
    gen.add_argument("--cache-dir", default=None, help="where the built-in tiny checkpoint is written")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar or summary")
    return parser


def _schema(text: str | None) -> StructuredOutputSpec | None:
    if text is None:
        return None
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read --json-schema file {str(path)!r}: {exc.strerror}") from None
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--json-schema is not valid JSON: {exc}") from None
    return StructuredOutputSpec(schema_type="json_schema", schema=text)


def _generate(args: argparse.Namespace) -> int:
    from deepinfer_engine.llm import LLM
    from deepinfer_sampling import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seq_seed=args.seed,
        so_args=_schema(args.json_schema),
    )
    engine_args: dict[str, Any] = {"precision": args.precision}
    if args.max_model_len is not None:
        engine_args["max_model_len"] = args.max_model_len
    if args.device is not None:
        engine_args["device"] = args.device
    if args.cache_dir is not None:
        engine_args["cache_dir"] = args.cache_dir
    if args.nextn is not None:
        engine_args["nextn"] = args.nextn
    llm = LLM(args.model, **engine_args)
    try:
        outputs = llm.generate(args.prompt, params, use_tqdm=not args.no_progress)
    finally:
        llm.close()
    failed = False
    for prompt, output in zip(args.prompt, outputs, strict=True):
        failed |= not output.ok
        if args.json:
            record = {
                "prompt": prompt,
                "text": output.text,
                "token_ids": list(output.token_ids),
                "finish_reason": output.finish_reason.value,
                "error": output.error_message,
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            suffix = f" [{output.finish_reason.value}]"
            if output.error_message:
                suffix += f" error: {output.error_message}"
            print(f"{prompt!r} -> {output.text!r}{suffix}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, TypeError, OSError) as exc:
        message = " ".join(str(exc).split())
        print(f"deepinfer-engine: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
