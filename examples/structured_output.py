"""Structured output with DeepInfer: every completion is constrained by a JSON Schema (or a regex).

The grammar is compiled in the background (xgrammar) when the request arrives; each step the allowed tokens are
computed on the CPU while the forward runs and applied to the logits before sampling. The built-in tiny checkpoint
has learned to write JSON records from prompts like ``json name=Ann age=31:`` (docs/builtin-checkpoint.md), so the
records it writes under the schema carry the prompt's values; a completion cut by ``max_tokens`` would be a valid
prefix, so the script prints whether each one parsed.

    uv run --package deepinfer-engine examples/structured_output.py
"""

from __future__ import annotations

import argparse
import json

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPTS = ["json name=Ann age=31:", "json name=Bob age=7 city=Lima:", "json name=Zoe age=64:", "json name=Kai age=19:"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local checkpoint dir or HF repo id (default: built-in tiny)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from deepinfer_engine import LLM, SamplingParams

    llm = LLM(model=args.model)
    so_args = {"schema_type": "json_schema", "schema": json.dumps(SCHEMA)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, so_args=so_args)
    for output in llm.generate(PROMPTS, params):
        try:
            value = json.loads(output.text)
        except json.JSONDecodeError:
            print(f"[{output.finish_reason.value}] not complete JSON yet: {output.text!r}")
        else:
            print(f"[{output.finish_reason.value}] {json.dumps(value)}")
    llm.close()


if __name__ == "__main__":
    main()
