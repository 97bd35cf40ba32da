"""Offline batch generation with DeepInfer — the README's main command.

Runs on the built-in tiny DeepSeek-V4.1-Flash checkpoint (random weights in the real checkpoint format, written
deterministically into a cache directory on first use) unless ``--model`` names a local directory or a Hugging Face
repo id.

    pip install uv && uv run --package deepinfer-engine examples/offline_inference.py
"""

from __future__ import annotations

import argparse

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "In a distant galaxy, a small robot",
    "The three laws of thermodynamics are",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local checkpoint dir or HF repo id (default: built-in tiny)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args()

    from deepinfer_engine import LLM, SamplingParams

    llm = LLM(model=args.model)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seq_seed=0)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        print(f"{prompt!r} -> {output.text!r} ({output.finish_reason.value}, {len(output.token_ids)} tokens)")


if __name__ == "__main__":
    main()
