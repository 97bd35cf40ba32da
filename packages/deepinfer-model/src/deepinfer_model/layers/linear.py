"""Linear layers over the checkpoint's stored formats, each parameter with its own ``weight_loader``.

- ``Bf16Linear``: BF16 weight; FP32 accumulation; BF16 (or FP32) output.
- ``Fp8BlockLinear``: e4m3 weight with 32×32 UE8M0 block scales (docs/design/numerics.md, "Weight formats"); exact mode
  runs the kernels' ``fp8_block_gemm`` (input quantized per token in groups of 32; BF16 output), FP32 mode a plain
  FP32 GEMM with the dequantized weight. ``shard_sizes`` makes it a merged (row-concatenated) layer such as the shared
  expert's ``[w1; w3]`` (docs/design/model.md, "Tensor names").
- ``Fp8GroupedLinear``: the attention's grouped ``wo_a`` (docs/design/attention.md, "Per-query attention"); exact mode
  on an accelerator runs the kernels' ``fp8_block_grouped_gemm`` (FP32 output), or ``rotated_fp8_block_grouped_gemm``
  where the attention output's de-rotation comes with it.
- ``Mxfp4ExpertStack``: the routed experts' MXFP4 matrices stacked over experts
  (docs/design/numerics.md, "Weight formats"; docs/design/model.md, "Tensor names"); exact mode runs the kernels'
  ``mxfp4_gemm``.

Dequantized weights are kept per layer where that pays (FP32 mode; exact mode on the CPU, where the reference GEMMs
would otherwise dequantize on every call): see ``deepinfer_model.layers.dequantized``.

Weight loaders: every parameter carries ``param.weight_loader(param, tensor, shard_id)`` which checks shape and dtype
exactly (no casting) and copies the tensor into its rows. ``shard_id`` is None for plain parameters, the shard
index for merged layers and ``(expert, shard)`` for expert stacks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from deepinfer_kernels import (
    CodeOrder,
    ExpertRows,
    GroupCodes,
    apply_rope_,
    bf16_gemm,
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantized_gemm,
    dequantized_grouped_gemm,
    fp8_block_gemm,
    fp8_block_gemm_quantized,
    fp8_block_grouped_gemm,
    mxfp4_gemm,
    mxfp4_grouped_code_order,
    mxfp4_grouped_gemm,
    rotated_fp8_block_grouped_gemm,
)
from deepinfer_model.layers.dequantized import DequantizedCache
from deepinfer_model.layers.mode import ComputeMode, fp8_round_trip, round_activation

__all__ = [
    "Bf16Linear",
    "Fp8BlockLinear",
    "Fp8Copy",
    "Fp8GroupedLinear",
    "Mxfp4ExpertStack",
    "WeightLoader",
    "default_weight_loader",
    "make_parameter",
]

FP8_BLOCK = 32
MXFP4_GROUP = 32
WeightLoader = Callable[[nn.Parameter, torch.Tensor, Any], None]
# An activation's per-token-group FP8 copy as its producer computed it: (e4m3 codes, UE8M0 scales), the format of
# ``deepinfer_kernels.quantize_fp8_per_token_group``.
Fp8Copy = tuple[torch.Tensor, torch.Tensor]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_loaded(param: nn.Parameter, target: torch.Tensor, loaded: torch.Tensor) -> None:
    name = getattr(param, "hf_name", "parameter")
    if loaded.dtype != target.dtype:
        raise TypeError(f"{name}: checkpoint dtype {loaded.dtype} does not match the parameter dtype {target.dtype}")
    if tuple(loaded.shape) != tuple(target.shape):
        raise ValueError(
            f"{name}: checkpoint shape {tuple(loaded.shape)} does not match the expected {tuple(target.shape)}"
        )


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole tensor into ``param`` after an exact shape/dtype check.

    Raises:
        ValueError: ``shard_id`` is given, or the shape differs.
        TypeError: the dtype differs.
    """
    if shard_id is not None:
        raise ValueError(f"parameter takes no shard id, got {shard_id!r}")
    _check_loaded(param, param.data, loaded)
    param.data.copy_(loaded)


def make_parameter(
    shape: tuple[int, ...], dtype: torch.dtype, loader: WeightLoader = default_weight_loader
) -> nn.Parameter:
    """An uninitialised, frozen parameter on the current default device with a ``weight_loader`` attribute."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class Bf16Linear(nn.Module):
    """``y = x · Wᵀ`` with a BF16 weight ``[out, in]``, FP32 accumulation.

    Args:
        in_features: input width.
        out_features: output width.
        mode: compute mode.
        fp32_output: keep the FP32 accumulator (router logits, compressor projections) instead of rounding.
    """

    def __init__(self, in_features: int, out_features: int, mode: ComputeMode, fp32_output: bool = False) -> None:
        super().__init__()
        self.mode = mode
        self.fp32_output = fp32_output
        self.weight = make_parameter((out_features, in_features), torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x [..., in] bf16/fp32. Returns: [..., out], fp32 if ``fp32_output`` else the activation dtype."""
        return bf16_gemm(x, self.weight, torch.float32 if self.fp32_output else self.mode.activation_dtype)


class Fp8BlockLinear(nn.Module):
    """FP8 e4m3 weight ``[out, in]`` with UE8M0 scales ``[⌈out/32⌉, ⌈in/32⌉]``.

    Args:
        in_features: input width.
        out_features: output width (sum of ``shard_sizes`` for a merged layer).
        mode: compute mode.
        shard_sizes: row counts of the checkpoint tensors concatenated into this weight (each a multiple of 32), or
            None for a plain layer.
    """

    def __init__(
        self, in_features: int, out_features: int, mode: ComputeMode, shard_sizes: tuple[int, ...] | None = None
    ) -> None:
        super().__init__()
        if shard_sizes is not None and (
            sum(shard_sizes) != out_features or any(size % FP8_BLOCK for size in shard_sizes)
        ):
            raise ValueError(
                f"shard_sizes {shard_sizes} must be multiples of {FP8_BLOCK} summing to out_features {out_features}"
            )
        self.mode = mode
        self.in_features = in_features
        self.out_features = out_features
        self.shard_sizes = shard_sizes
        self.weight = make_parameter((out_features, in_features), torch.float8_e4m3fn, self._load_rows)
        self.scale = make_parameter(
            (_cdiv(out_features, FP8_BLOCK), _cdiv(in_features, FP8_BLOCK)), torch.float8_e8m0fnu, self._load_rows
        )
        self._cache = DequantizedCache(mode)

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        self._cache.clear()
        if self.shard_sizes is None:
            default_weight_loader(param, loaded, shard_id)
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.shard_sizes):
            raise ValueError(f"shard id must be an int in [0, {len(self.shard_sizes)}), got {shard_id!r}")
        divisor = 1 if param is self.weight else FP8_BLOCK
        start = sum(self.shard_sizes[:shard_id]) // divisor
        rows = self.shard_sizes[shard_id] // divisor
        target = param.data[start : start + rows]
        _check_loaded(param, target, loaded)
        target.copy_(loaded)

    def dequantized_weight(self) -> torch.Tensor:
        """The exact FP32 weight ``[out, in]``."""
        return self._cache.get(0, (self.weight, self.scale), lambda: dequantize_fp8_block(self.weight, self.scale))

    def forward(self, x: torch.Tensor, prequantized: bool = False, fp8_copy: Fp8Copy | None = None) -> torch.Tensor:
        """Apply the layer.

        Args:
            x: [..., in] bf16/fp32.
            prequantized: ``x`` already holds FP8-dequantized values (Engram rows); skip activation quantization.
            fp8_copy: ``quantize_fp8_per_token_group(x)`` as the producer of ``x`` computed it (a fused norm); exact
                mode on an accelerator then runs the GEMM on it and launches no quantizer (same result).

        Returns:
            [..., out] in the activation dtype (BF16 exact / FP32).
        """
        if self.mode is ComputeMode.EXACT and not prequantized:
            if self._cache.keeps(self.weight.device):
                return dequantized_gemm(x, self.dequantized_weight())
            if fp8_copy is not None:
                return self.forward_fp8(fp8_copy)
            return fp8_block_gemm(x, self.weight, self.scale)
        return round_activation(x.float() @ self.dequantized_weight().t(), self.mode)

    def runs_on_fp8_copy(self) -> bool:
        """Whether the layer can read an activation's FP8 copy instead of quantizing it (exact mode where dequantized
        weights are not kept, i.e. on an accelerator; input width a multiple of 32); then :meth:`forward_fp8` may
        replace :meth:`forward`."""
        exact = self.mode is ComputeMode.EXACT and self.in_features % FP8_BLOCK == 0
        return exact and not self._cache.keeps(self.weight.device)

    def forward_fp8(self, fp8_copy: Fp8Copy) -> torch.Tensor:
        """The exact-mode result for an activation given only as its FP8 copy (codes [..., in], scales [..., in/32]):
        ``deepinfer_kernels.fp8_block_gemm_quantized``. Returns: [..., out] bf16."""
        return fp8_block_gemm_quantized(*fp8_copy, self.weight, self.scale)


class Fp8GroupedLinear(nn.Module):
    """Grouped FP8 projection: group ``g`` maps input slice ``g`` (width ``in_per_group``) with rows
    ``g·out_per_group … (g+1)·out_per_group − 1`` of the stored ``[groups·out_per_group, in_per_group]`` weight.

    Its output stays FP32: the next FP8 GEMM quantizes it directly
    (docs/design/numerics.md, "Attention output rounding").
    """

    def __init__(self, groups: int, in_per_group: int, out_per_group: int, mode: ComputeMode) -> None:
        super().__init__()
        self.mode = mode
        self.groups = groups
        self.in_per_group = in_per_group
        self.out_per_group = out_per_group
        out_features = groups * out_per_group
        self._cache = DequantizedCache(mode)
        self.weight = make_parameter((out_features, in_per_group), torch.float8_e4m3fn, self._load)
        self.scale = make_parameter(
            (_cdiv(out_features, FP8_BLOCK), _cdiv(in_per_group, FP8_BLOCK)), torch.float8_e8m0fnu, self._load
        )

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        self._cache.clear()
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x [n, groups·in_per_group] bf16/fp32. Returns: [n, groups·out_per_group] fp32.

        Exact mode on an accelerator runs the kernels' grouped FP8 GEMM on the stored weight; where dequantized
        weights are kept (CPU, FP32 mode) an FP32 einsum over the kept weight.
        """
        if self.mode is ComputeMode.EXACT and not self._cache.keeps(self.weight.device):
            return fp8_block_grouped_gemm(x, self.weight, self.scale, self.groups)
        x_hat = fp8_round_trip(x, self.mode).view(-1, self.groups, self.in_per_group)
        weight = self._cache.get(0, (self.weight, self.scale), lambda: dequantize_fp8_block(self.weight, self.scale))
        weight = weight.view(self.groups, self.out_per_group, -1)
        return torch.einsum("ngi,goi->ngo", x_hat, weight).reshape(x.shape[0], -1)

    def forward_rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` of x's heads with each head's last ``2 · cos.shape[1]`` columns rotated first, in FP32 (the
        attention output's de-rotation; the rotated values are not rounded to x's dtype).

        Args: x [n, heads, head_dim] bf16/fp32 (an FP32 x is rotated in place where the dequantized weight is kept);
        cos, sin [n, r/2] fp32. Returns: [n, groups·out_per_group] fp32.

        Exact mode on an accelerator runs the kernels' ``rotated_fp8_block_grouped_gemm``, which rotates inside the
        activation's quantization; elsewhere the rotation (``apply_rope_``) precedes :meth:`forward`.
        """
        if self.mode is ComputeMode.EXACT and not self._cache.keeps(self.weight.device):
            return rotated_fp8_block_grouped_gemm(x, cos, sin, self.weight, self.scale, self.groups)
        rotated = x.float()
        apply_rope_(rotated[..., rotated.shape[2] - 2 * cos.shape[1] :], cos, sin)
        return self(rotated.reshape(x.shape[0], -1))


class Mxfp4ExpertStack(nn.Module):
    """MXFP4 matrices of ``num_experts`` experts: packed ``[E, out, in/2]`` int8 and UE8M0 ``[E, out, in/32]``.

    Args:
        num_experts: number of experts stored.
        in_features: logical input width (multiple of 32).
        out_features: output width (sum of ``shard_sizes``).
        shard_sizes: row counts of the per-expert checkpoint tensors merged along the rows (``(I, I)`` for
            ``[w1; w3]``, ``(H,)`` for ``w2``).
        mode: compute mode.
        local_experts: logical expert held by each stored slot (an expert-parallel rank holds only its own; a
            logical expert may fill several slots when it has replicas). None stores all ``num_experts`` in order.
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        shard_sizes: tuple[int, ...],
        mode: ComputeMode,
        local_experts: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if in_features % MXFP4_GROUP or sum(shard_sizes) != out_features:
            raise ValueError(
                f"MXFP4 expert stack needs in_features % {MXFP4_GROUP} == 0 (got {in_features}) and shard_sizes "
                f"{shard_sizes} summing to out_features {out_features}"
            )
        held = tuple(range(num_experts)) if local_experts is None else tuple(local_experts)
        self.mode = mode
        self.num_experts = num_experts
        self.shard_sizes = shard_sizes
        self._cache = DequantizedCache(mode)
        self.local_experts: tuple[int, ...] = ()
        self._slots: dict[int, list[int]] = {}
        self.set_local_experts(held, len(held))
        self.weight = make_parameter((len(held), out_features, in_features // 2), torch.int8, self._load_expert)
        self.scale = make_parameter(
            (len(held), out_features, in_features // MXFP4_GROUP), torch.float8_e8m0fnu, self._load_expert
        )

    def set_local_experts(self, local_experts: Sequence[int], num_slots: int | None = None) -> None:
        """Say which logical expert each stored slot holds (after expert-parallel load balancing moved the weights).

        Args:
            local_experts: logical id per slot, in ``[0, num_experts)``; as many as the stack has slots.
            num_slots: slot count to check against (the stored count when None).
        """
        held = tuple(int(e) for e in local_experts)
        slots = self.weight.shape[0] if num_slots is None else num_slots
        if not held or len(held) != slots or any(not 0 <= e < self.num_experts for e in held):
            raise ValueError(
                f"local_experts must list {slots} (>= 1) ids in [0, {self.num_experts}), one per slot, got {held}"
            )
        self.local_experts = held
        self._slots = {}
        for slot, expert in enumerate(held):
            self._slots.setdefault(expert, []).append(slot)
        self._cache.clear()

    def holds(self, expert: int) -> bool:
        """Whether logical expert ``expert`` is stored in this stack."""
        return expert in self._slots

    def _slot(self, expert: int) -> int:
        slots = self._slots.get(expert)
        if slots is None:
            raise ValueError(f"expert {expert} is not held by this stack (it holds {sorted(self._slots)})")
        return slots[0]

    def _load_expert(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2):
            raise ValueError(f"expert parameters need shard id (expert, shard), got {shard_id!r}")
        expert, shard = shard_id
        self._cache.clear()
        if not 0 <= expert < self.num_experts or not 0 <= shard < len(self.shard_sizes):
            raise ValueError(
                f"shard id {shard_id!r} out of range: experts 0..{self.num_experts - 1}, "
                f"shards 0..{len(self.shard_sizes) - 1}"
            )
        start = sum(self.shard_sizes[:shard])
        # Every replica slot of the expert gets the same weights.
        self._slot(expert)  # raises for an expert this stack does not hold
        for slot in self._slots[expert]:
            target = param.data[slot, start : start + self.shard_sizes[shard]]
            _check_loaded(param, target, loaded)
            target.copy_(loaded)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Apply expert ``expert``'s matrix.

        Args:
            x: [n, in] bf16/fp32.
            expert: expert index.

        Returns:
            [n, out]: exact mode BF16 ``bf16(x̂ · Ŵᵀ)`` with FP8 activations
            (docs/design/numerics.md, "GEMM accumulation"); FP32 mode FP32.
        """
        if self.mode is ComputeMode.FP32:
            return x.float() @ self.dequantized_weight(expert).t()
        if self._cache.keeps(self.weight.device):
            return dequantized_gemm(x, self.dequantized_weight(expert))
        slot = self._slot(expert)
        return mxfp4_gemm(x, self.weight[slot], self.scale[slot])

    def grouped_code_order(self, rows: int) -> CodeOrder | None:
        """The order of the activation codes that :meth:`grouped` over ``rows`` product rows takes as they are
        (``deepinfer_kernels.mxfp4_grouped_code_order``); None where it takes the values (the dequantized weights)."""
        if self._cache.keeps(self.weight.device):
            return None
        return mxfp4_grouped_code_order(rows, self.weight, self.scale)

    def grouped(self, x: torch.Tensor | GroupCodes, slots: ExpertRows, repeats: int = 1) -> torch.Tensor:
        """Exact mode: every row through its own stored slot's matrix (``deepinfer_kernels.mxfp4_grouped_gemm``; no
        host synchronization on CUDA).

        Args:
            x: [m / repeats, in] bf16/fp32, or its codes (in :meth:`grouped_code_order`'s order): row i of the
                product reads row ``i // repeats``.
            slots: ids [m] int64: the stored slot of each row, -1 for a row no expert here takes (its output is
                zero); shared by the stacks that multiply the same rows, which then share the tile tables.
            repeats: product rows per row of x (a token's top-k rows, in rank order).

        Returns:
            [m, out] bf16.
        """
        if self._cache.keeps(self.weight.device):
            values = x.values() if isinstance(x, GroupCodes) else x
            rows = values.repeat_interleave(repeats, dim=0) if repeats > 1 else values
            return dequantized_grouped_gemm(rows, slots.ids, self.dequantized_slots())
        return mxfp4_grouped_gemm(x, slots, self.weight, self.scale, repeats)

    def dequantized_slots(self) -> torch.Tensor:
        """The exact FP32 weights of every stored slot, ``[slots, out, in]``."""
        return self._cache.get(0, (self.weight, self.scale), self._dequantize_slots)

    def _dequantize_slots(self) -> torch.Tensor:
        slots, rows = self.weight.shape[:2]
        flat = dequantize_mxfp4(self.weight.view(slots * rows, -1), self.scale.view(slots * rows, -1))
        return flat.view(slots, rows, -1)

    def dequantized_weight(self, expert: int) -> torch.Tensor:
        """The exact FP32 weight ``[out, in]`` of one (logical) expert."""
        return self.dequantized_slots()[self._slot(expert)]
