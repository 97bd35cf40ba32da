"""Expert-parallel load balancing (EPLB): load statistics, placement policy, and applying a placement.

`policy` decides (pure math on CPU tensors, never communicates), `stats` counts, `rebalance` moves weights and
installs maps (never decides).
"""
