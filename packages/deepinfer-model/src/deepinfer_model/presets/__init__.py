"""Shipped model configurations, stored as real ``config.json`` files (package data).

``tiny.json`` is a small synthetic model covering every layer kind and sharing role (docs/model.md); ``v41-flash.json``
is the released DeepSeek-V4.1-Flash ``config.json``; ``v41-flash-scaled.json`` keeps every width of the released
config (hidden size, heads, LoRA ranks, indexer, 384 routed experts top-6, vocabulary) on 8 backbone layers and one
DSpark block that still cover every layer role, with Engram tables shrunk in rows (docs/model.md), for multi-GPU
runs at real sizes (a 65 GB checkpoint). Load them with ``deepinfer_model.config.load_preset``.
"""
