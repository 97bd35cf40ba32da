"""Structured output with DeepInfer: every completion is constrained by a JSON Schema (or a regex).

The grammar is compiled in the background (xgrammar) when the request arrives; each step the allowed tokens are
computed on the CPU while the forward runs and applied to the logits before sampling. On the built-in tiny checkpoint
(random weights) the text is meaningless but always matches the grammar; a completion cut by ``max_tokens`` is a
valid prefix, so the script prints whether each one parsed.

    uv run --package deepinfer-engine examples/structured_output.py
"""

from __future__ import annotations

import argparse
import json

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "population_millions": {"type": "integer"},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population_millions", "capital"],
    "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local checkpoint dir or HF repo id (default: built-in tiny)")
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()

    from deepinfer_engine import LLM, SamplingParams

    llm = LLM(model=args.model)
    so_args = {"schema_type": "json_schema", "schema": json.dumps(SCHEMA)}
    prompts = ["Describe a city as JSON:"] * 4
    params = [
        SamplingParams(temperature=0.7, max_tokens=args.max_tokens, seq_seed=i, so_args=so_args) for i in range(4)
    ]
    for output in llm.generate(prompts, params):
        try:
            value = json.loads(output.text)
        except json.JSONDecodeError:
            print(f"[{output.finish_reason.value}] not complete JSON yet: {output.text!r}")
        else:
            print(f"[{output.finish_reason.value}] {json.dumps(value)}")
    llm.close()


if __name__ == "__main__":
    main()
