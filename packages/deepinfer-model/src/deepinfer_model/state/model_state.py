"""``ModelState``: the incremental attention state of every layer, stored as byte pools per cache group.

Pools follow the model's ``CacheSpec`` (``deepinfer_model.cache_spec``); per layer kind the content is exactly this
(docs/design/cache.md, "Cache groups"):

    group "swa"            SLIDING_WINDOW  [num_state_slots, W + BT, bytes]   SWA KV of the last W + BT positions
    group "compressed_c*"  PAGED           [num_blocks, block_size / c, bytes] compressed rows (kv sources)
    group "index_k_c*"     PAGED           [num_blocks, block_size / c, bytes] index-K rows (index-K sources)
    group "compressor_c2"  STATE           [num_state_slots, 2 + BT − 1, bytes] C2 (score, latent) FP32 entries
    group "dspark_swa"     SLIDING_WINDOW  drafter rings (context keys and draft keys)

Consumer layers own no pools: they read their source's pool (docs/design/cache.md, "Cache groups"). Rollback needs no
action: rows are addressed by position, so re-fed positions overwrite their old rows (docs/design/cache.md, "Rollback")
as long as at most ``BT`` positions are rolled back.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deepinfer_kernels import store_rows
from deepinfer_model.cache_spec import CacheGroupKind, CacheGroupSpec, CacheSpec
from deepinfer_model.state.codecs import RowCodec

__all__ = ["ModelState"]


class ModelState:
    """Cache pools of one model instance.

    Args:
        spec: the model's cache groups.
        codecs: row codec of every group (by name).
        block_size: raw tokens per page of every PAGED group.
        pools: group name → layer id → uint8 pool (PAGED ``[num_blocks, rows_per_block, bytes]``, per-request
            ``[num_state_slots, rows_per_request, bytes]``).
    """

    def __init__(
        self,
        spec: CacheSpec,
        codecs: Mapping[str, RowCodec],
        block_size: int,
        pools: Mapping[str, Mapping[int, torch.Tensor]],
    ) -> None:
        self.spec = spec
        self.block_size = block_size
        self._codecs = dict(codecs)
        self._pools = {name: dict(layers) for name, layers in pools.items()}
        for group in spec.groups:
            codec = self._codecs.get(group.name)
            if codec is None or codec.bytes_per_row != group.bytes_per_row:
                raise ValueError(f"cache group {group.name!r} needs a codec with {group.bytes_per_row} bytes per row")
            for layer in group.layer_ids:
                pool = self._pools.get(group.name, {}).get(layer)
                if pool is None or pool.dim() != 3 or pool.shape[-1] != group.bytes_per_row:
                    raise ValueError(f"cache group {group.name!r} layer {layer}: missing or malformed pool")
                rows = (
                    group.rows_per_block(block_size) if group.kind is CacheGroupKind.PAGED else group.rows_per_request()
                )
                if pool.shape[1] != rows:
                    raise ValueError(
                        f"cache group {group.name!r} layer {layer}: pool has {pool.shape[1]} rows per page/slot, "
                        f"expected {rows}"
                    )

    @classmethod
    def allocate(
        cls,
        spec: CacheSpec,
        codecs: Mapping[str, RowCodec],
        block_size: int,
        num_blocks: int,
        num_state_slots: int,
        device: torch.device | str = "cpu",
    ) -> ModelState:
        """Allocate zeroed pools for ``num_blocks`` pages and ``num_state_slots`` running requests."""
        pools: dict[str, dict[int, torch.Tensor]] = {}
        for group in spec.groups:
            if group.kind is CacheGroupKind.PAGED:
                shape = (num_blocks, group.rows_per_block(block_size), group.bytes_per_row)
            else:
                shape = (num_state_slots, group.rows_per_request(), group.bytes_per_row)
            pools[group.name] = {
                layer: torch.zeros(shape, dtype=torch.uint8, device=device) for layer in group.layer_ids
            }
        return cls(spec, codecs, block_size, pools)

    def group(self, name: str) -> CacheGroupSpec:
        return self.spec.group(name)

    def codec(self, name: str) -> RowCodec:
        return self._codecs[name]

    def ring_size(self, name: str) -> int:
        """Rows per request of a SLIDING_WINDOW / STATE group."""
        return self.spec.group(name).rows_per_request()

    def rows_per_block(self, name: str) -> int:
        """Rows per page of a PAGED group."""
        return self.spec.group(name).rows_per_block(self.block_size)

    @property
    def max_backtracking_tokens(self) -> int | None:
        """Most positions that may be rolled back (None when no ring limits it)."""
        return self.spec.max_backtracking_tokens

    def _flat(self, name: str, layer: int) -> torch.Tensor:
        try:
            pool = self._pools[name][layer]
        except KeyError:
            raise KeyError(f"layer {layer} owns no pool in cache group {name!r}") from None
        return pool.view(-1, pool.shape[-1])

    def pool(self, name: str, layer: int) -> torch.Tensor:
        """The pool of ``layer`` in group ``name`` as flat rows ``[rows, bytes_per_row]`` uint8 (a view)."""
        return self._flat(name, layer)

    def read(self, name: str, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Decode rows. Args: rows [...] int64 flat row indices (clamped ≥ 0). Returns: [..., width] fp32."""
        flat = self._flat(name, layer)
        return self._codecs[name].decode(flat[rows.clamp(min=0)])

    def write(self, name: str, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Encode and store in one op.

        Args: rows [N] int64 flat rows (a repeated row must carry equal values); values [N, width] bf16/fp32.
        """
        store_rows(self._flat(name, layer), rows, values, self._codecs[name].row_format)

    def write_encoded(self, name: str, layer: int, rows: torch.Tensor, encoded: torch.Tensor) -> None:
        """Store already encoded rows. Args: rows [N] int64 distinct flat rows; encoded [N, bytes_per_row] uint8."""
        if rows.numel() == 0:
            return
        self._flat(name, layer)[rows] = encoded
