"""Offline batch generation with DeepInfer — the README's main command.

Runs on the built-in tiny DeepSeek-V4.1-Flash checkpoint (shipped with deepinfer-engine, trained on synthetic
tasks by ``tools/train_tiny.py``; see ``docs/builtin-checkpoint.md``) unless ``--model`` names a local directory or a
Hugging Face repo id. The prompts are ones a person can check: a sum, a date, a JSON record and a capital city; each
answer ends at the first newline (``--stop ""`` lets generation run on to ``--max-tokens``).

    pip install uv && uv run --package deepinfer-engine examples/offline_inference.py
"""

from __future__ import annotations

import argparse
import sys

PROMPTS = [
    "12+7=",
    "day after 2024-02-28:",
    "json name=Ann age=31:",
    "The capital of France is",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local checkpoint dir or HF repo id (default: built-in tiny)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--stop", default="\n", help='stop string (default: newline; "" for none)')
    args = parser.parse_args()

    from deepinfer_engine import LLM, SamplingParams

    try:
        llm = LLM(model=args.model)
    except (ValueError, TypeError, OSError) as exc:  # a bad setting or checkpoint: its message says what is allowed
        sys.exit(f"error: {exc}")
    stop = (args.stop,) if args.stop else ()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seq_seed=0, stop=stop)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        print(f"{prompt!r} -> {output.text!r} ({output.finish_reason.value}, {len(output.token_ids)} tokens)")


if __name__ == "__main__":
    main()
