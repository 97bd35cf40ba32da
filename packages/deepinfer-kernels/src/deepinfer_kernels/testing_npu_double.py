"""A CPU test double of the parts of the ``torch_npu`` API that ``deepinfer_kernels.ascend`` calls.

Not a mock: each function checks its arguments (names by signature, then shapes, dtypes and attribute
values) against the documented torch_npu signature and computes the documented result with plain PyTorch,
so the Ascend implementations' call sites run end to end on a machine without an NPU. Configurations the
double does not model raise ValueError naming the argument instead of guessing.

Signatures and semantics follow the op-plugin documentation and schema
(``op_plugin/config/op_plugin_functions.yaml``, ``docs/zh/custom_APIs/torch_npu/*.md``):

- ``npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)``
- ``npu_rotary_mul(self, r1, r2, rotary_mode='half', rotate=None) -> Tensor``
- ``npu_dynamic_mx_quant(input, *, axis=-1, round_mode="rint", dst_type=296, block_size=32, scale_alg=0,
  dst_type_max=0.0, max_low_bound=0.0) -> (y, mxscale)``; modelled: ``dst_type=292`` (float8_e4m3fn),
  ``scale_alg=1`` (``S = amax / 448``, scale ``2^⌈log2 S⌉``), ``axis=-1``, ``round_mode="rint"``.
  ``mxscale`` is uint8 shaped ``[..., ⌈⌈K/block_size⌉/2⌉, 2]`` (scale pairs; an odd count is zero-padded).
  For an all-zero group the documentation gives no scale; the double writes byte 0.
- ``npu_anti_mx_quant(x, mxscale, *, axis=-1, dst_type=15, src_type=292) -> Tensor``; modelled:
  ``src_type=292`` (x float8_e4m3fn) and ``296`` (x uint8, two e2m1 codes per byte, low nibble first),
  ``dst_type`` 15 (bfloat16) or 5 (float16), one scale per 32 elements of the last axis.

Use :func:`install_npu_double` (a context manager) to place it in ``sys.modules["torch_npu"]``. Every package's
``tests/conftest.py`` wraps its session in :func:`accelerator_test_session`, which does so when
``DEEPINFER_ACCELERATOR=ascend`` and no real torch_npu is importable.
"""

from __future__ import annotations

import importlib
import math
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from deepinfer_kernels.platform import Accelerator, requested_accelerator

__all__ = ["NpuDouble", "accelerator_test_session", "install_npu_double", "real_torch_npu_available"]

# torch_npu dtype codes used by the MX ops (op-plugin's TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP).
_FLOAT8_E4M3FN = 292
_FLOAT4_E2M1 = 296
_DST_DTYPES = {15: torch.bfloat16, 5: torch.float16}
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MX_BLOCK = 32


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"torch_npu test double: {message}")


def _pair_count(num_blocks: int) -> int:
    return (num_blocks + 1) // 2


class _NpuDeviceNamespace:
    """Stands in for ``torch_npu.npu``: the double has no devices."""

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 0


class NpuDouble(types.ModuleType):
    """Module object installed as ``torch_npu``; ``calls`` records the name of every op called, in order."""

    def __init__(self) -> None:
        super().__init__("torch_npu", "CPU test double of torch_npu (deepinfer_kernels.testing_npu_double)")
        self.calls: list[str] = []
        self.npu = _NpuDeviceNamespace()

    def npu_rms_norm(
        self_module, self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``y = x · rstd · gamma`` over the trailing ``gamma.dim()`` axes; ``rstd`` FP32 with those axes kept as 1."""
        self_module.calls.append("npu_rms_norm")
        x = self
        allowed = (torch.float16, torch.bfloat16, torch.float32)
        _require(x.dtype in allowed, f"npu_rms_norm self dtype {x.dtype} not in {allowed}")
        _require(gamma.dtype == x.dtype, f"npu_rms_norm gamma dtype {gamma.dtype} must equal self dtype {x.dtype}")
        _require(1 <= x.dim() <= 8, f"npu_rms_norm self must have 1-8 dims, got {x.dim()}")
        k = gamma.dim()
        _require(
            1 <= k <= x.dim() and tuple(gamma.shape) == tuple(x.shape[x.dim() - k :]),
            f"npu_rms_norm gamma shape {tuple(gamma.shape)} must equal the trailing dims of self {tuple(x.shape)}",
        )
        _require(isinstance(epsilon, float), f"npu_rms_norm epsilon must be a float, got {epsilon!r}")
        dims = tuple(range(x.dim() - k, x.dim()))
        xf = x.float()
        rstd = torch.rsqrt((xf * xf).mean(dim=dims, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    def npu_rotary_mul(
        self_module,
        self: torch.Tensor,
        r1: torch.Tensor,
        r2: torch.Tensor,
        rotary_mode: str = "half",
        rotate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out = x · r1 + rotate(x) · r2``; interleave mode rotates pairs ``(x[2i], x[2i+1]) → (−x[2i+1], x[2i])``."""
        self_module.calls.append("npu_rotary_mul")
        x = self
        allowed = (torch.float16, torch.bfloat16, torch.float32)
        _require(x.dtype in allowed, f"npu_rotary_mul input dtype {x.dtype} not in {allowed}")
        _require(r1.dtype == x.dtype and r2.dtype == x.dtype, "npu_rotary_mul r1/r2 dtype must equal input dtype")
        _require(x.dim() in (3, 4), f"npu_rotary_mul input must be 3-D or 4-D, got {x.dim()}")
        _require(r1.dim() == x.dim() and r1.shape == r2.shape, "npu_rotary_mul r1 and r2 must match input's rank")
        _require(rotary_mode in ("half", "interleave"), f"npu_rotary_mul rotary_mode {rotary_mode!r} unknown")
        _require(rotate is None, "npu_rotary_mul with a rotate matrix is not modelled")
        d = x.shape[-1]
        _require(d % 2 == 0 and d < 896, f"npu_rotary_mul D={d} must be even and < 896")
        _require(r1.shape[-1] == d, f"npu_rotary_mul r1 last dim {r1.shape[-1]} must equal D={d}")
        if rotary_mode == "interleave" and x.dim() == 3:
            # TND layout: the coefficients must be T1D.
            _require(
                tuple(r1.shape) == (x.shape[0], 1, d),
                f"npu_rotary_mul interleave TND needs r1 of shape {(x.shape[0], 1, d)}, got {tuple(r1.shape)}",
            )
        _require(torch.broadcast_shapes(r1.shape, x.shape) == x.shape, "npu_rotary_mul r1 must broadcast to input")
        if rotary_mode == "interleave":
            pairs = x.unflatten(-1, (d // 2, 2))
            rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        else:
            first, second = x.chunk(2, dim=-1)
            rotated = torch.cat((-second, first), dim=-1)
        return x * r1 + rotated * r2

    def npu_dynamic_mx_quant(
        self_module,
        input: torch.Tensor,
        *,
        axis: int = -1,
        round_mode: str = "rint",
        dst_type: int = 296,
        block_size: int = 32,
        scale_alg: int | None = 0,
        dst_type_max: float = 0.0,
        max_low_bound: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MX quantization along the last axis (modelled: e4m3 output, ``scale_alg=1``)."""
        self_module.calls.append("npu_dynamic_mx_quant")
        x = input
        allowed = (torch.float16, torch.bfloat16, torch.float32)
        _require(x.dtype in allowed, f"npu_dynamic_mx_quant input dtype {x.dtype} not in {allowed}")
        _require(1 <= x.dim() <= 7, f"npu_dynamic_mx_quant input must have 1-7 dims, got {x.dim()}")
        _require(axis in (-1, x.dim() - 1), f"npu_dynamic_mx_quant axis={axis} is not modelled (only the last axis)")
        _require(round_mode == "rint", f"npu_dynamic_mx_quant round_mode={round_mode!r} is not modelled")
        _require(dst_type == _FLOAT8_E4M3FN, f"npu_dynamic_mx_quant dst_type={dst_type} is not modelled (only 292)")
        _require(
            block_size > 0 and block_size % 32 == 0 and block_size <= 1024,
            f"npu_dynamic_mx_quant block_size={block_size} must be a positive multiple of 32 and <= 1024",
        )
        _require(scale_alg == 1, f"npu_dynamic_mx_quant scale_alg={scale_alg} is not modelled (only 1)")
        _require(dst_type_max in (0.0, 448.0), f"npu_dynamic_mx_quant dst_type_max={dst_type_max} not modelled")
        _require(max_low_bound == 0.0, f"npu_dynamic_mx_quant max_low_bound={max_low_bound} not modelled")
        k = x.shape[-1]
        num_blocks = math.ceil(k / block_size)
        padded = torch.nn.functional.pad(x.float(), (0, num_blocks * block_size - k))
        blocks = padded.unflatten(-1, (num_blocks, block_size))
        ratio = blocks.abs().amax(dim=-1) / 448.0
        mantissa, exponent = torch.frexp(ratio)
        # ratio = m·2^k with m in [0.5, 1): the power-of-two ceiling is 2^(k−1) when m == 0.5, else 2^k.
        ceil_exp = torch.where(mantissa == 0.5, exponent - 1, exponent)
        ceil_exp = torch.where(ratio == 0, torch.full_like(ceil_exp, -127), ceil_exp).clamp(-127, 127)
        multiplier = torch.ldexp(torch.ones_like(ratio), -ceil_exp)
        y = (blocks * multiplier[..., None]).flatten(-2)[..., :k].to(torch.float8_e4m3fn)
        scale_bytes = (ceil_exp + 127).to(torch.uint8)
        scale_bytes = torch.nn.functional.pad(scale_bytes, (0, 2 * _pair_count(num_blocks) - num_blocks))
        return y, scale_bytes.unflatten(-1, (_pair_count(num_blocks), 2))

    def npu_anti_mx_quant(
        self_module,
        x: torch.Tensor,
        mxscale: torch.Tensor,
        *,
        axis: int | None = -1,
        dst_type: int | None = 15,
        src_type: int | None = 292,
    ) -> torch.Tensor:
        """MX dequantization along the last axis: ``value · 2^(scale − 127)`` with one scale per 32 elements."""
        self_module.calls.append("npu_anti_mx_quant")
        _require(1 <= x.dim() <= 7, f"npu_anti_mx_quant x must have 1-7 dims, got {x.dim()}")
        _require(axis in (-1, x.dim() - 1), f"npu_anti_mx_quant axis={axis} is not modelled (only the last axis)")
        if dst_type is None or dst_type not in _DST_DTYPES:
            raise ValueError(
                f"torch_npu test double: npu_anti_mx_quant dst_type={dst_type} not in {sorted(_DST_DTYPES)}"
            )
        out_dtype = _DST_DTYPES[dst_type]
        if src_type == _FLOAT8_E4M3FN:
            _require(
                x.dtype == torch.float8_e4m3fn, f"npu_anti_mx_quant src_type=292 needs float8_e4m3fn, got {x.dtype}"
            )
            values = x.float()
        elif src_type == _FLOAT4_E2M1:
            _require(x.dtype == torch.uint8, f"npu_anti_mx_quant src_type=296 needs uint8 x, got {x.dtype}")
            codes = torch.stack((x & 0x0F, x >> 4), dim=-1).flatten(-2).long()
            table = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32)
            magnitude = table[codes & 7]
            values = torch.where((codes & 8) != 0, -magnitude, magnitude)
        else:
            raise ValueError(f"torch_npu test double: npu_anti_mx_quant src_type={src_type} is not modelled")
        _require(
            mxscale.dtype in (torch.uint8, torch.float8_e8m0fnu),
            f"npu_anti_mx_quant mxscale dtype {mxscale.dtype} must be uint8 or float8_e8m0fnu",
        )
        k = values.shape[-1]
        num_blocks = math.ceil(k / _MX_BLOCK)
        expected = (*values.shape[:-1], _pair_count(num_blocks), 2)
        _require(
            tuple(mxscale.shape) == expected,
            f"npu_anti_mx_quant mxscale shape {tuple(mxscale.shape)} != {expected} for x {tuple(x.shape)}",
        )
        exponents = mxscale.view(torch.uint8).flatten(-2)[..., :num_blocks].to(torch.int32) - 127
        factor = torch.ldexp(torch.ones(exponents.shape), exponents).repeat_interleave(_MX_BLOCK, dim=-1)[..., :k]
        return (values * factor).to(out_dtype)


def real_torch_npu_available() -> bool:
    """True when a real ``torch_npu`` imports (the double, if installed, does not count)."""
    current = sys.modules.get("torch_npu")
    if isinstance(current, NpuDouble):
        return False
    try:
        importlib.import_module("torch_npu")
    except (ImportError, OSError):
        return False
    return True


@contextmanager
def install_npu_double() -> Iterator[NpuDouble]:
    """Install a fresh :class:`NpuDouble` as ``sys.modules["torch_npu"]`` for the ``with`` block, then restore."""
    missing = object()
    previous = sys.modules.get("torch_npu", missing)
    double = NpuDouble()
    sys.modules["torch_npu"] = double
    try:
        yield double
    finally:
        if previous is missing:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = previous  # type: ignore[assignment]


@contextmanager
def accelerator_test_session() -> Iterator[None]:
    """A package test session under the requested target: the double stands in for torch_npu when the ascend
    target is requested on a machine without a real one; otherwise nothing changes."""
    if requested_accelerator() is Accelerator.ASCEND and not real_torch_npu_available():
        with install_npu_double():
            yield
    else:
        yield
