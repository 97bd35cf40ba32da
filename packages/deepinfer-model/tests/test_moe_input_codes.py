"""The routed experts on the FFN norm's codes (docs/design/kernels.md, "Codes into the grouped GEMM"): the norm's
second, de-interleaved copy handed to the routed ``w13`` as ``GroupCodes`` gives the bits of the MoE reading the
norm's output, in the order the grouped GEMM reads and in the other; on the CPU there are no codes."""

from __future__ import annotations

import pytest
import torch
from _layered_model_support import layer0_moe, layer0_weights, tiny_config

from deepinfer_model.deepseek_v41.moe import MoE
from deepinfer_model.deepseek_v41.weight_loading import load_named_weights
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_model.layers.norm import RMSNorm


def _moe_and_norm(device: str) -> tuple[MoE, RMSNorm]:
    root = layer0_moe(tuple(range(tiny_config().text.n_routed_experts)))
    load_named_weights(root, layer0_weights().items())
    norm = RMSNorm(tiny_config().text.hidden_size, 1e-6, ComputeMode.EXACT)
    norm.weight.data.copy_(torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(3)))
    return root.layers[0].ffn.to(device), norm.to(device)


def test_no_codes_on_the_cpu() -> None:
    moe, norm = _moe_and_norm("cpu")
    x = torch.randn(4, norm.weight.shape[0], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert moe.input_code_order(4) is None
    y, copy, codes = norm.with_fp8_codes(x, "deinterleaved")
    assert copy is None and codes is None and torch.equal(y, norm(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_codes_give_the_bits_of_the_values_on_cuda(tokens: int) -> None:
    moe, norm = _moe_and_norm("cuda")
    x = torch.randn(tokens, norm.weight.shape[0], generator=torch.Generator().manual_seed(tokens)).to("cuda")
    y, copy = norm.with_fp8_copy(x.to(torch.bfloat16))
    with torch.no_grad():
        expected = moe(y, copy)
        for order in (moe.input_code_order(tokens), "columns", "deinterleaved"):
            y_again, copy_again, codes = norm.with_fp8_codes(x.to(torch.bfloat16), order)
            assert torch.equal(y_again, y) and (codes is None) == (order is None), order
            assert torch.equal(moe(y_again, copy_again, codes), expected), order
