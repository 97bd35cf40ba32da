"""On CUDA (gpu-marked): the engine's greedy output with the fast NVIDIA kernels (Triton GEMMs, paged sparse
attention, streaming indexer, fused cache stores) equals its output with the PyTorch reference of every op on the
same GPU, on the tiny preset, in FP32 precision.

Exact (BF16/FP8) precision is not compared token for token: there any other FP32 summation order flips a BF16 or FP8
rounding somewhere, and the random-weight tiny model amplifies every flip (on an H200 both backends stay at a mean
logit cosine of 0.9945 against the CPU reference over a 100-token prompt, first row below 0.999 at row 28, while
their greedy tokens part within the first few). The model's `test_parity_gpu.py` bounds the exact-mode distance.

The backend is chosen once per process (``DEEPINFER_ACCELERATOR``), so each side runs in its own interpreter. The
reference side runs eagerly: its cache store synchronizes with the host and cannot be captured in a graph.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from llm_support import random_prompts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_GENERATE = """
import json, sys
from llm_support import make_llm
from deepinfer_engine import SamplingParams
root, eager, precision, prompts = sys.argv[1], sys.argv[2] == "1", sys.argv[3], json.loads(sys.argv[4])
llm = make_llm(root, device="cuda", max_num_seqs=16, enforce_eager=eager, precision=precision)
params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
print(json.dumps([list(o.token_ids) for o in outputs]))
"""


def _greedy_tokens(
    root: Path, accelerator: str, eager: bool, precision: str, prompts: list[list[int]]
) -> list[list[int]]:
    env = {**os.environ, "DEEPINFER_ACCELERATOR": accelerator}
    env.pop("TRITON_INTERPRET", None)
    tests_dir = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join([tests_dir, env.get("PYTHONPATH", "")])
    args = [sys.executable, "-c", _GENERATE, str(root), "1" if eager else "0", precision, json.dumps(prompts)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{accelerator} engine failed:\n{done.stderr[-4000:]}"
    tokens: list[list[int]] = json.loads(done.stdout.strip().splitlines()[-1])
    return tokens


@pytest.mark.gpu
@needs_cuda
def test_fast_kernels_greedy_output_equals_reference_kernels(tmp_path: Path) -> None:
    # Prompt lengths span the tiny preset's window (64) and several compressed-row blocks, so the window ring,
    # the C1/C2 compressed rows, the indexer's top-k and the candidate blocks all take part.
    prompts = random_prompts(12, 2, 300, seed=7)
    fast = _greedy_tokens(tmp_path, "nvidia", eager=False, precision="fp32", prompts=prompts)
    reference = _greedy_tokens(tmp_path, "cpu", eager=True, precision="fp32", prompts=prompts)
    agree = sum(a == b for a, b in zip(fast, reference, strict=True))
    assert fast == reference, f"{agree} of {len(prompts)} prompts agree"
