"""Expert parallelism of the layered model: routed experts sharded over an EP group, tokens moved by
``deepinfer_parallel``'s dispatcher.

``ExpertParallelMoE`` holds what one rank needs: its EP group, the expert placement (logical <-> physical maps of
every backbone MoE layer, replicas included) and the token dispatcher. The model asks it, per backbone layer, which
logical experts to store (``local_experts``) and which ``ExpertDispatch`` to call (``layer_dispatch``).

One layer's dispatch (every EP rank calls it once per forward, also with zero tokens)::

    x [n, H], topk logical ids [n, k], routing weights [n, k]
      │ map_to_physical: one replica per routing choice
      │ dispatcher.dispatch: received rows [m, H], local slot of each choice (-1 = elsewhere), weights
      │ every (row, choice) through this rank's experts: grouped GEMMs over the stored slots in exact mode, one
      │ experts.compute call per held expert in FP32 mode; the weight acts inside the expert, before w2
      ▼
    per-choice outputs [m, k, H] (zeros for choices computed elsewhere)
      │ dispatcher.combine: [n, k, H]; each choice is computed on exactly one rank, so the sum over ranks only adds
      ▼ zeros and is exact
    bias + Σ_j out[:, j] in top-k order, in FP32: the arithmetic of ``local_expert_dispatch``.

Returning each choice's output (k rows per token rather than one weighted partial sum per rank, as
``deepinfer_parallel.expert_parallel_moe`` does) costs k times the combine traffic, but keeps the single-process
FP32 summation order, so the only difference from one process is the expert GEMMs seeing other row batches.

Attention data parallelism needs nothing more: each DP rank runs attention on its own requests and the dispatcher
exchanges whatever token counts the ranks hold. The DSpark blocks (another expert count) take a second instance.
``rebalance`` installs an EPLB placement: the slots' weights move between ranks and the experts learn their new ids.
``record_load`` turns on load statistics: each dispatch then adds the routing choices every local slot received to an
``ExpertLoadWindow`` (one in-place add on the device per layer, no host sync); off by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer_model.deepseek_v41.moe import ExpertDispatch, MoE, RoutedExperts
from deepinfer_model.layers.mode import ComputeMode
from deepinfer_parallel.config import ExpertLayoutConfig
from deepinfer_parallel.eplb.rebalance import apply_placement
from deepinfer_parallel.eplb.stats import ExpertLoadWindow
from deepinfer_parallel.expert_parallel import AllToAllDispatcher, ExpertPlacement, TokenDispatcher, map_to_physical
from deepinfer_parallel.groups import ParallelGroups, RankGroup

__all__ = ["ExpertParallelMoE"]


class ExpertParallelMoE:
    """The routed experts of one EP rank and the dispatch that reaches everyone else's.

    Args:
        group: the EP group (``ParallelGroups.expert_parallel``).
        placement: maps of every backbone MoE layer; ``placement.layout.expert_parallel_size`` must be the group
            size.
        dispatcher: transport over ``group`` with ``placement.layout.num_local_experts`` slots per rank.

    Raises:
        ValueError: the group, placement and dispatcher disagree on sizes.
    """

    def __init__(self, group: RankGroup, placement: ExpertPlacement, dispatcher: TokenDispatcher) -> None:
        layout = placement.layout
        if layout.expert_parallel_size != group.size:
            raise ValueError(
                f"placement is laid out for expert_parallel_size={layout.expert_parallel_size}, the EP group has "
                f"{group.size} ranks; they must be equal"
            )
        if dispatcher.num_local_experts != layout.num_local_experts:
            raise ValueError(
                f"dispatcher has {dispatcher.num_local_experts} local expert slots, the placement "
                f"{layout.num_local_experts} ({layout.num_physical_experts} physical experts over {group.size} ranks)"
            )
        self.group = group
        self.placement = placement
        self.dispatcher = dispatcher
        self._load_window: ExpertLoadWindow | None = None

    @classmethod
    def create(
        cls,
        groups: ParallelGroups,
        num_logical_experts: int,
        num_layers: int,
        num_redundant_experts: int = 0,
        device: torch.device | None = None,
    ) -> ExpertParallelMoE:
        """The start-up placement (``ExpertPlacement.initial``) with an all-to-all dispatcher over the EP group.

        Args:
            groups: this rank's groups.
            num_logical_experts: routed experts per layer (``n_routed_experts``).
            num_layers: backbone MoE layers (``num_hidden_layers``).
            num_redundant_experts: replica slots; logical + redundant must be a multiple of the EP size.
            device: where the placement maps live (the device of the routed tokens); CPU when None.

        Raises:
            ValueError: the physical expert count does not divide over the EP ranks.
        """
        layout = ExpertLayoutConfig(num_logical_experts, num_redundant_experts, groups.config.expert_parallel_size)
        placement = ExpertPlacement.initial(layout, num_layers, device)
        dispatcher = AllToAllDispatcher(groups.expert_parallel, layout.num_local_experts)
        return cls(groups.expert_parallel, placement, dispatcher)

    def check_covers(self, num_layers: int, num_experts: int, what: str) -> None:
        """Raise ``ValueError`` unless the placement covers ``num_layers`` MoE layers of ``num_experts`` experts.

        Args:
            num_layers: MoE layers the model gives this placement.
            num_experts: routed experts of each of those layers.
            what: those layers, for the message (e.g. "backbone layers").
        """
        layout = self.placement.layout
        if layout.num_logical_experts != num_experts or self.placement.num_layers != num_layers:
            raise ValueError(
                f"expert placement covers {self.placement.num_layers} layers of {layout.num_logical_experts} experts, "
                f"the model's {what} are {num_layers} layers of {num_experts} routed experts"
            )

    def local_experts(self, layer: int) -> tuple[int, ...]:
        """Logical expert held by each of this rank's physical slots of backbone layer ``layer``."""
        return tuple(int(e) for e in self.placement.local_logical_experts(layer, self.group.rank).tolist())

    def rebalance(self, moes: Sequence[MoE], new_physical_to_logical: torch.Tensor, num_p2p_groups: int = 1) -> None:
        """Install a new expert placement (EPLB): move this rank's expert weights, then update the maps and every
        layer's local experts (collective over the EP group; every rank passes the same placement).

        Args:
            moes: the backbone MoE of every layer, in layer order (``[block.ffn for block in model.layers]``).
            new_physical_to_logical: [num_layers, num_physical] int64 placement (e.g. from
                ``deepinfer_parallel.eplb.policy``).
            num_p2p_groups: transfer buckets per layer (>= 1).
        """
        if len(moes) != self.placement.num_layers:
            raise ValueError(f"got {len(moes)} MoE layers, the placement covers {self.placement.num_layers}")
        # Byte views: the P2P transfer and row copies then need no FP4/UE8M0 support, and write the parameters
        # (through ``detach``, which shares the version counter that tells kept dequantized weights they are stale).
        layer_weights = [
            [
                tensor.detach().view(torch.uint8)
                for stack in (moe.experts.w13, moe.experts.w2)
                for tensor in stack.parameters()
            ]
            for moe in moes
        ]
        apply_placement(layer_weights, self.placement, new_physical_to_logical, self.group, num_p2p_groups)
        for layer, moe in enumerate(moes):
            moe.experts.set_local_experts(self.local_experts(layer))

    def record_load(self, window: ExpertLoadWindow | None) -> None:
        """Add every later dispatch's received counts per local slot to ``window`` (None stops recording).

        Args:
            window: counters laid out like this placement (same ``ExpertLayoutConfig``), on the routed tokens'
                device; ``window.record(layer, ep_rank, counts)`` is called once per layer dispatch.

        Raises:
            ValueError: the window's layout differs from the placement's.
        """
        if window is not None and window.layout != self.placement.layout:
            raise ValueError(f"load window laid out for {window.layout}, the placement for {self.placement.layout}")
        self._load_window = window

    def layer_dispatch(self, layer: int) -> ExpertDispatch:
        """The ``ExpertDispatch`` of backbone layer ``layer`` (see ``dispatch``)."""
        if not 0 <= layer < self.placement.num_layers:
            raise ValueError(f"layer must be in [0, {self.placement.num_layers}), got {layer}")

        def dispatch(
            x: torch.Tensor,
            topk_ids: torch.Tensor,
            topk_weights: torch.Tensor,
            experts: RoutedExperts,
            bias: torch.Tensor,
        ) -> torch.Tensor:
            return self.dispatch(layer, x, topk_ids, topk_weights, experts, bias)

        return dispatch

    def dispatch(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        experts: RoutedExperts,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """Routed experts of this rank's tokens over the EP group (collective: every EP rank calls it).

        Args:
            layer: backbone MoE layer (index into the placement).
            x: [n, H] expert inputs, activation dtype (n may be 0).
            topk_ids: [n, k] int64 logical expert ids.
            topk_weights: [n, k] fp32 routing weights.
            experts: this rank's experts (stored slots hold the logical ids of ``local_experts(layer)``).
            bias: [n, H] fp32 added first (the shared-expert output, or zeros).

        Returns:
            [n, H] fp32: bias + the routed outputs summed in top-k order.
        """
        rank = self.group.rank
        physical = map_to_physical(topk_ids, self.placement, layer, token_offset=rank)
        received = self.dispatcher.dispatch(x, physical, topk_weights)
        if self._load_window is not None:
            self._load_window.record(layer, rank, received.num_tokens_per_local_expert)
        slots = received.topk_local_ids
        rows_in = received.hidden_states
        if experts.mode is ComputeMode.EXACT:
            # Received slot ids are this rank's stored slots: one grouped GEMM pair over every (row, choice).
            n, k = slots.shape
            weights = received.topk_weights.reshape(-1)
            out = experts.grouped_rows(rows_in, slots.reshape(-1), weights, repeats=k)
            out = out.to(rows_in.dtype).view(n, k, rows_in.shape[1])
        else:
            held = self.placement.local_logical_experts(layer, rank).to(slots.device)
            logical = torch.where(slots >= 0, held[slots.clamp(min=0)], -1)
            out = rows_in.new_zeros((*slots.shape, rows_in.shape[1]))
            # One call per held logical expert over all its received choices, as local_expert_dispatch does.
            for expert in torch.unique(logical[logical >= 0]).tolist():
                rows_e, choice = torch.nonzero(logical == expert, as_tuple=True)
                weights_e = received.topk_weights[rows_e, choice]
                out[rows_e, choice] = experts.compute(int(expert), rows_in[rows_e], weights_e).to(out.dtype)
        combined = self.dispatcher.combine(out, received)
        result = bias
        for rank_in_topk in range(topk_ids.shape[1]):
            result = result + combined[:, rank_in_topk].float()
        return result
