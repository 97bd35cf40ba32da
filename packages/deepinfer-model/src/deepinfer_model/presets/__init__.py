"""Shipped model configurations, stored as real ``config.json`` files (package data).

``tiny.json`` is a small synthetic model covering every layer kind and sharing role (docs/model.md); ``v41-flash.json``
is the released DeepSeek-V4.1-Flash ``config.json``. Load them with ``deepinfer_model.config.load_preset``.
"""
