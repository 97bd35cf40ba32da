"""Hand-worked byte examples for UE8M0, e4m3 and e2m1/MXFP4 (expected bytes worked out by hand from the formats).

These go through the public ops, i.e. through whatever backend the session's DEEPINFER_ACCELERATOR selects.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_kernels as dk


def _bytes(t: torch.Tensor) -> list[int]:
    return t.cpu().contiguous().view(torch.uint8).flatten().tolist()


def test_ue8m0_decode_by_hand(op_device: str) -> None:
    raw = torch.tensor([0, 1, 120, 126, 127, 128, 130, 254], dtype=torch.uint8, device=op_device)
    expected = [2.0**-127, 2.0**-126, 2.0**-7, 0.5, 1.0, 2.0, 8.0, 2.0**127]
    assert dk.ue8m0_to_float(raw).cpu().tolist() == expected
    assert dk.ue8m0_to_float(raw.view(torch.float8_e8m0fnu)).cpu().tolist() == expected
    # PyTorch's own float8_e8m0fnu → float32 conversion agrees.
    assert raw.view(torch.float8_e8m0fnu).float().cpu().tolist() == expected


def test_e4m3_encoding_by_hand(op_device: str) -> None:
    # One group with amax exactly 448 → a/448 = 1 → e = 0, scale byte 127, q = e4m3(x) directly.
    values = [
        448.0,  # 0 1111 110 = 0x7E (max)
        1.0,  # 0 0111 000 = 0x38
        -2.0,  # 1 1000 000 = 0xC0
        2.0**-9,  # smallest subnormal 0 0000 001 = 0x01
        7 * 2.0**-9,  # largest subnormal 0x07
        2.0**-6,  # smallest normal 0 0001 000 = 0x08
        1.0625,  # tie between 1.0 (mantissa 000) and 1.125 (001) → even → 0x38
        1.1875,  # tie between 1.125 (001) and 1.25 (010) → even → 0x3A
        -0.0,  # 0x80
        2.0**-10,  # tie between 0 and 2^-9 → even → 0x00
        3 * 2.0**-10,  # tie between 2^-9 (001) and 2^-8 (010) → even → 0x02
        -3.25,  # 1.625·2^1: exponent 8 (1000), mantissa 101 → 1 1000 101 = 0xC5
    ]
    x = torch.zeros(32)
    x[: len(values)] = torch.tensor(values)
    q, scale = dk.quantize_fp8_per_token_group(x[None].to(op_device))
    expected = [0x7E, 0x38, 0xC0, 0x01, 0x07, 0x08, 0x38, 0x3A, 0x80, 0x00, 0x02, 0xC5] + [0] * 20
    assert _bytes(q) == expected
    assert _bytes(scale) == [127]


@pytest.mark.parametrize(
    ("amax", "scale_byte", "amax_code"),
    [
        (1.0, 119, 0x78),  # ⌈log2(1/448)⌉ = ⌈−8.81⌉ = −8; 1·2^8 = 256 = 0 1111 000
        (896.0, 128, 0x7E),  # 896/448 = 2 exactly → e = 1; 896/2 = 448
        (56.0, 124, 0x7E),  # 56/448 = 2^−3 exactly → e = −3; 56·8 = 448
        (0.0, 105, 0x00),  # amax floor 1e−4: ⌈log2(1e−4/448)⌉ = ⌈−22.09⌉ = −22
    ],
)
def test_fp8_scale_rule_by_hand(op_device: str, amax: float, scale_byte: int, amax_code: int) -> None:
    x = torch.zeros(1, 64)
    x[0, 5] = amax
    x[0, 32:] = 1.0  # second group: amax 1 → byte 119
    q, scale = dk.quantize_fp8_per_token_group(x.to(op_device))
    assert _bytes(scale) == [scale_byte, 119]
    assert _bytes(q)[5] == amax_code
    assert _bytes(q)[32] == 0x78


def test_fp8_block_by_hand(op_device: str) -> None:
    w = torch.zeros(40, 33)
    w[0, 0] = 1.0  # block (0, 0): amax 1 → byte 119, code 0x78
    w[35, 32] = -896.0  # block (1, 1): e = 1 → byte 128, −448 → 0xFE
    q, scale = dk.quantize_fp8_block(w.to(op_device))
    assert _bytes(scale) == [119, 105, 105, 128]
    assert _bytes(q[0, 0]) == [0x78]
    assert _bytes(q[35, 32]) == [0xFE]
    back = dk.dequantize_fp8_block(q, scale)
    assert back[0, 0].item() == 1.0 and back[35, 32].item() == -896.0
    # A lone byte: 0x38 (1.0) under scale byte 130 (2^3) is 8.0.
    one = torch.tensor([[0x38]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert (
        dk.dequantize_fp8_block(
            one.to(op_device), torch.tensor([[130]], dtype=torch.uint8).view(torch.float8_e8m0fnu).to(op_device)
        ).item()
        == 8.0
    )


def test_e2m1_mxfp4_by_hand(op_device: str) -> None:
    # amax 6 → a/6 = 1 → e = 0, scale byte 127; codes straight from the e2m1 table.
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -6.0]
    values += [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0]  # ties go to the even code
    expected_codes = [0, 1, 2, 3, 4, 5, 6, 7, 9, 15, 0, 2, 2, 4, 4, 6, 6, 8]
    w = torch.zeros(1, 32)
    w[0, : len(values)] = torch.tensor(values)
    packed, scale = dk.quantize_mxfp4(w.to(op_device))
    codes = expected_codes + [0] * (32 - len(expected_codes))
    expected_bytes = [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]
    assert expected_bytes[:9] == [0x10, 0x32, 0x54, 0x76, 0xF9, 0x20, 0x42, 0x64, 0x86]
    assert _bytes(packed) == expected_bytes
    assert packed.dtype == torch.int8
    assert _bytes(scale) == [127]


def test_mxfp4_decode_by_hand(op_device: str) -> None:
    packed = torch.zeros(1, 16, dtype=torch.uint8)
    packed[0, :3] = torch.tensor([0x10, 0x7F, 0xA9])  # (0, 0.5), (−6, 6)... low nibble first
    scale = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # ×2
    out = dk.dequantize_mxfp4(packed.view(torch.int8).to(op_device), scale.to(op_device))
    # 0x10: low 0 → 0, high 1 → 0.5; 0x7F: low 15 → −6, high 7 → 6; 0xA9: low 9 → −0.5, high 10 → −1.
    assert out[0, :6].cpu().tolist() == [0.0, 1.0, -12.0, 12.0, -1.0, -2.0]
    assert out[0, 6:].abs().sum().item() == 0.0
