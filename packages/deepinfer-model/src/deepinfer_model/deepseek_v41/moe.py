"""Mixture of experts of every block (docs/design/model.md, "Mixture of experts"): ``sqrtsoftplus`` router with
``noaux_tc`` selection, MXFP4 routed experts with clamped SwiGLU, optional FP8 shared expert.

Expert dispatch goes through the ``ExpertDispatch`` seam: a callable that receives the quantized tokens, their
routing and a per-expert compute function and returns the FP32 sum of the routed outputs. ``local_expert_dispatch``
runs every expert on this rank; ``deepseek_v41.expert_parallel`` plugs in the dispatch/combine version over
``deepinfer_parallel``.

With the local dispatch in exact mode the MoE does not loop over experts: ``RoutedExperts.grouped_rows_of_tokens``
runs every (token, top-k choice) row through one grouped MXFP4 GEMM per matrix (``Mxfp4ExpertStack.grouped``), which
on CUDA has static shapes and no host synchronization (CUDA graphs), with the same arithmetic as the per-expert loop;
``moe_combine`` sums the rows onto the shared expert's output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from deepinfer_kernels import (
    CodeOrder,
    ExpertRows,
    GroupCodes,
    bf16_gemm,
    moe_combine,
    router_topk,
    swiglu_clamped,
    swiglu_clamped_fp8,
)
from deepinfer_kernels.branch_streams import fork
from deepinfer_model.layers.linear import Fp8BlockLinear, Fp8Copy, Mxfp4ExpertStack, make_parameter
from deepinfer_model.layers.mode import ComputeMode, round_activation

__all__ = ["ExpertDispatch", "MoE", "RoutedExperts", "Router", "local_expert_dispatch"]

# (inputs [n, H], topk_ids [n, k], topk_weights [n, k], experts, bias [n, H] fp32) -> bias + routed sum [n, H] fp32
ExpertDispatch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "RoutedExperts", torch.Tensor], torch.Tensor]


def local_expert_dispatch(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: RoutedExperts, bias: torch.Tensor
) -> torch.Tensor:
    """Run every selected expert locally; add the outputs to ``bias`` in FP32, in top-k rank order
    (docs/design/model.md, "MoE combine").

    Args:
        x: [n, H] expert inputs (the ``ffn_norm`` output, activation dtype).
        topk_ids: [n, k] int64 logical expert ids.
        topk_weights: [n, k] fp32 routing weights.
        experts: the routed experts (all held here); one ``experts.compute`` call per selected expert.
        bias: [n, H] fp32 added first (the shared-expert output, or zeros).

    Returns:
        [n, H] fp32.
    """
    routed = torch.zeros((*topk_ids.shape, x.shape[1]), dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        tokens, rank = torch.nonzero(topk_ids == expert, as_tuple=True)
        routed[tokens, rank] = experts.compute(int(expert), x[tokens], topk_weights[tokens, rank]).float()
    out = bias
    for slot in range(topk_ids.shape[1]):
        out = out + routed[:, slot]
    return out


class Router(nn.Module):
    """``ffn.gate``: BF16 logits → ``sqrt(softplus)`` scores → biased top-k → normalized unbiased weights × ρ."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, scaling: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.scaling = scaling
        self.weight = make_parameter((num_experts, hidden), torch.bfloat16)
        self.bias = make_parameter((num_experts,), torch.float32)
        self.bias_vl = make_parameter((num_experts,), torch.float32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: x [n, H] (text tokens). Returns: ``(topk_ids [n, k] int64, topk_weights [n, k] fp32)``."""
        # FP32 logits, never rounded (docs/design/model.md, "Router").
        logits = bf16_gemm(x, self.weight)
        # Scores, the stable biased top-k (ties to the lower expert index) and the weights in one kernels op.
        return router_topk(logits, self.bias, self.top_k, self.scaling)


class RoutedExperts(nn.Module):
    """MXFP4 experts: ``w13`` = ``[w1; w3]`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` (logical shapes).

    ``local_experts`` (logical ids, one per stored slot) keeps only an expert-parallel rank's experts; ``compute``
    then accepts only those ids. None keeps all ``num_experts``. ``holds_every_expert`` says that slot ``e`` holds
    expert ``e`` for every ``e``.
    """

    expert_slot: torch.Tensor

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        limit: float | None,
        mode: ComputeMode,
        local_experts: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.mode = mode
        self.limit = limit
        self.w13 = Mxfp4ExpertStack(
            num_experts, hidden, 2 * intermediate, (intermediate, intermediate), mode, local_experts
        )
        self.w2 = Mxfp4ExpertStack(num_experts, intermediate, hidden, (hidden,), mode, local_experts)
        # Device lookup logical expert -> stored slot (-1: not held here), so grouped dispatch needs no host map.
        self.register_buffer("expert_slot", self._slot_table(), persistent=False)
        self.holds_every_expert = self._identity_slots()

    def _slot_table(self) -> torch.Tensor:
        table = [-1] * self.w13.num_experts
        for slot, expert in reversed(list(enumerate(self.w13.local_experts))):
            table[expert] = slot  # the first slot of a replicated expert, as ``Mxfp4ExpertStack`` picks
        return torch.tensor(table, dtype=torch.int64)

    def set_local_experts(self, local_experts: Sequence[int]) -> None:
        """Logical expert of each stored slot after the slots' weights were rewritten (see ``Mxfp4ExpertStack``)."""
        self.w13.set_local_experts(local_experts)
        self.w2.set_local_experts(local_experts)
        self.expert_slot.copy_(self._slot_table())
        self.holds_every_expert = self._identity_slots()

    def _identity_slots(self) -> bool:
        # Slot e holds logical expert e for every expert: the router's ids are the slots, all local (no lookup, no
        # zero rows).
        return self.w13.local_experts == tuple(range(self.w13.num_experts))

    def grouped_rows_of_tokens(
        self, x: torch.Tensor | GroupCodes, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Every (token, top-k choice) row through grouped MXFP4 GEMMs (exact mode; the arithmetic of ``compute``,
        without host synchronization). ``moe_combine`` of the result onto a bias is ``local_expert_dispatch``'s sum.

        Args:
            x: [n, H] expert inputs (activation dtype), or their codes in ``w13``'s order
                (:meth:`input_code_order`).
            topk_ids: [n, k] int64 logical expert ids (experts not held here give zero rows).
            topk_weights: [n, k] fp32 routing weights.

        Returns:
            [n, k, H] activation dtype.
        """
        n, k = topk_ids.shape
        ids = topk_ids.reshape(-1)
        identity = self.holds_every_expert
        slots = ids if identity else self.expert_slot[ids]
        # Row i of the product is token i // k's choice i % k: w13 reads the tokens themselves (no copy per choice).
        return self.grouped_rows(x, slots, topk_weights.reshape(-1), repeats=k, all_local=identity).unflatten(0, (n, k))

    def input_code_order(self, tokens: int, top_k: int) -> CodeOrder | None:
        """The order of the input codes that :meth:`grouped_rows_of_tokens` of ``tokens`` tokens takes as they are
        (``w13``'s; None where it takes the values)."""
        return self.w13.grouped_code_order(tokens * top_k)

    def grouped_rows(
        self,
        rows: torch.Tensor | GroupCodes,
        slots: torch.Tensor,
        weights: torch.Tensor,
        repeats: int = 1,
        all_local: bool = False,
    ) -> torch.Tensor:
        """``compute`` of every row with its own stored expert slot, through two grouped MXFP4 GEMMs (exact mode; no
        host synchronization).

        Args:
            rows: [m / repeats, H] expert inputs (activation dtype) or their codes; row i of the product reads
                ``rows[i // repeats]``.
            slots: [m] int64 stored slot of each row, -1 for a row no expert here takes (its output is zero).
            weights: [m] fp32 routing weight of each row.
            repeats: product rows per input row (a token's top-k choices, in rank order).
            all_local: no slot is -1 (``deepinfer_kernels.ExpertRows.all_local``: no zero rows to write).

        Returns:
            [m, H] activation dtype.
        """
        shared = ExpertRows(slots, all_local)  # w13 and w2 multiply the same rows: one set of tile tables
        gate_up = self.w13.grouped(rows, shared, repeats)
        order = self.w2.grouped_code_order(slots.shape[0])
        act: torch.Tensor | GroupCodes
        if order is None:
            act = swiglu_clamped(gate_up, self.limit, weights)
        else:
            # w2 reads codes it would quantize itself: the SwiGLU writes them in its order, in the same launch
            # (docs/design/kernels.md, "Codes into the grouped GEMM"); the same values, one launch fewer.
            q, scale = swiglu_clamped_fp8(gate_up, self.limit, weights, deinterleave=order == "deinterleaved")
            act = GroupCodes(q, scale, order)
        return round_activation(self.w2.grouped(act, shared), self.mode)

    def compute(self, expert: int, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One expert (docs/design/model.md, "Routed experts"): the routing weight multiplies the SwiGLU output before
        ``w2`` and its FP8 cast.

        Args: x [n_e, H] activation dtype; weights [n_e] fp32. Returns: [n_e, H] activation dtype.
        """
        act = swiglu_clamped(self.w13(x, expert), self.limit, weights)
        return round_activation(self.w2(act, expert), self.mode)


class SharedExperts(nn.Module):
    """FP8 shared expert block of width ``S·I`` (docs/design/model.md, "Routed experts")."""

    def __init__(self, hidden: int, intermediate: int, limit: float | None, mode: ComputeMode) -> None:
        super().__init__()
        self.mode = mode
        self.limit = limit
        self.w13 = Fp8BlockLinear(hidden, 2 * intermediate, mode, shard_sizes=(intermediate, intermediate))
        self.w2 = Fp8BlockLinear(intermediate, hidden, mode)

    def forward(self, x: torch.Tensor, x_fp8: Fp8Copy | None = None) -> torch.Tensor:
        """Args: x [n, H] activation dtype; x_fp8 its FP8 copy or None (``Fp8BlockLinear.forward``). Returns: [n, H]
        activation dtype."""
        gate_up = self.w13(x, fp8_copy=x_fp8)
        if self.w2.runs_on_fp8_copy():
            # SwiGLU and w2's activation quantization in one kernel (docs/design/kernels.md, "swiglu_clamped_fp8").
            return self.w2.forward_fp8(swiglu_clamped_fp8(gate_up, self.limit))
        return self.w2(swiglu_clamped(gate_up, self.limit))


class MoE(nn.Module):
    """Router + routed experts + optional shared expert; ``MoE(x) = Σ_e y_e + y_s`` rounded once.

    Under expert parallelism ``dispatch`` moves tokens to the ranks holding their experts and ``local_experts``
    (logical ids per stored slot) keeps only this rank's routed experts; router and shared expert stay whole.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        num_shared: int,
        scaling: float,
        limit: float | None,
        mode: ComputeMode,
        dispatch: ExpertDispatch = local_expert_dispatch,
        local_experts: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.mode = mode
        self.dispatch = dispatch
        self.gate = Router(num_experts, hidden, top_k, scaling)
        self.experts = RoutedExperts(num_experts, hidden, intermediate, limit, mode, local_experts)
        self.shared_experts = SharedExperts(hidden, num_shared * intermediate, limit, mode) if num_shared > 0 else None

    def input_code_order(self, tokens: int) -> CodeOrder | None:
        """The order of ``ffn_norm``'s codes that :meth:`forward` of ``tokens`` tokens hands the routed experts as
        they are (``x_codes``); None where they take the values (another dispatch, FP32 mode, the CPU)."""
        if self.dispatch is not local_expert_dispatch or self.mode is not ComputeMode.EXACT:
            return None
        return self.experts.input_code_order(tokens, self.gate.top_k)

    def forward(self, x: torch.Tensor, x_fp8: Fp8Copy | None = None, x_codes: GroupCodes | None = None) -> torch.Tensor:
        """Args: x [n, H] ``ffn_norm`` output (activation dtype); x_fp8 its FP8 copy from a fused norm, or None (read
        by the shared expert's ``w13``); x_codes the same codes in :meth:`input_code_order`'s order, or None (read
        by the routed experts' ``w13``). Returns: [n, H] activation dtype."""
        if self.dispatch is local_expert_dispatch and self.mode is ComputeMode.EXACT:
            # The shared expert runs beside the router and the routed experts (a side stream under branch streams;
            # docs/design/kernels.md, "Branch streams"); the combine widens its output, adds and rounds in one kernel.
            forked = None if self.shared_experts is None else fork(x.device, self.shared_experts, x, x_fp8)
            topk_ids, topk_weights = self.gate(x)
            routed = self.experts.grouped_rows_of_tokens(x if x_codes is None else x_codes, topk_ids, topk_weights)
            return moe_combine(routed, None if forked is None else forked.result(), self.mode.activation_dtype)
        topk_ids, topk_weights = self.gate(x)
        shared = None if self.shared_experts is None else self.shared_experts(x, x_fp8)
        bias = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if shared is None else shared.float()
        return round_activation(self.dispatch(x, topk_ids, topk_weights, self.experts, bias), self.mode)
