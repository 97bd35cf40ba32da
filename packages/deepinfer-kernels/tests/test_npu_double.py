"""The torch_npu test double rejects calls that break the documented signatures and computes documented results."""

from __future__ import annotations

import pytest
import torch

from deepinfer_kernels.testing_npu_double import NpuDouble


def test_rms_norm_signature_and_result(npu_double: NpuDouble) -> None:
    x = torch.tensor([[3.0, 4.0]])
    y, rstd = npu_double.npu_rms_norm(x, torch.ones(2), epsilon=0.0)
    assert torch.allclose(y, x / (12.5**0.5)) and rstd.shape == (1, 1)
    with pytest.raises(TypeError):
        npu_double.npu_rms_norm(x, torch.ones(2), eps=1e-6)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="gamma dtype"):
        npu_double.npu_rms_norm(x, torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="trailing dims"):
        npu_double.npu_rms_norm(x, torch.ones(3))
    assert npu_double.calls == ["npu_rms_norm"] * 3  # every call that got past Python's argument binding


def test_rotary_mul_modes(npu_double: NpuDouble) -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 4)
    ones, zeros = torch.ones(1, 1, 4), torch.zeros(1, 1, 4)
    assert npu_double.npu_rotary_mul(x, zeros, ones, rotary_mode="interleave").flatten().tolist() == [-2, 1, -4, 3]
    assert npu_double.npu_rotary_mul(x, zeros, ones).flatten().tolist() == [-3, -4, 1, 2]
    with pytest.raises(ValueError, match="rotary_mode"):
        npu_double.npu_rotary_mul(x, ones, ones, rotary_mode="spiral")
    with pytest.raises(ValueError, match="3-D or 4-D"):
        npu_double.npu_rotary_mul(x.view(4), ones.view(4), ones.view(4))
    with pytest.raises(ValueError, match="interleave TND"):
        npu_double.npu_rotary_mul(
            x.expand(1, 2, 4), ones.expand(1, 2, 4), ones.expand(1, 2, 4), rotary_mode="interleave"
        )


def test_dynamic_mx_quant_layout(npu_double: NpuDouble) -> None:
    x = torch.zeros(2, 96)
    x[:, 0] = 1.0
    y, mxscale = npu_double.npu_dynamic_mx_quant(x, dst_type=292, scale_alg=1)
    assert y.dtype == torch.float8_e4m3fn and mxscale.dtype == torch.uint8
    assert mxscale.shape == (2, 2, 2)  # three blocks of 32 → two pairs, the last padded
    assert mxscale[0].flatten().tolist() == [119, 0, 0, 0]
    with pytest.raises(ValueError, match="scale_alg=0 is not modelled"):
        npu_double.npu_dynamic_mx_quant(x, dst_type=292)
    with pytest.raises(ValueError, match="block_size"):
        npu_double.npu_dynamic_mx_quant(x, dst_type=292, scale_alg=1, block_size=48)
    with pytest.raises(TypeError):
        npu_double.npu_dynamic_mx_quant(x, 292)  # type: ignore[misc]


def test_anti_mx_quant_checks(npu_double: NpuDouble) -> None:
    q = torch.ones(1, 64).to(torch.float8_e4m3fn)
    scale = torch.tensor([[[128, 127]]], dtype=torch.uint8)
    out = npu_double.npu_anti_mx_quant(q, scale, dst_type=15, src_type=292)
    assert out.dtype == torch.bfloat16
    assert out[0, :32].tolist() == [2.0] * 32 and out[0, 32:].tolist() == [1.0] * 32
    with pytest.raises(ValueError, match="mxscale shape"):
        npu_double.npu_anti_mx_quant(q, scale.view(1, 2), dst_type=15, src_type=292)
    with pytest.raises(ValueError, match="needs uint8"):
        npu_double.npu_anti_mx_quant(q, scale, dst_type=15, src_type=296)
    with pytest.raises(ValueError, match="dst_type=6"):
        npu_double.npu_anti_mx_quant(q, scale, dst_type=6, src_type=292)
