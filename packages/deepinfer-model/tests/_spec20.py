"""A worked tiny configuration with a vision block (the ``tiny`` preset differs: 7 layers and a candidate source),
shared by the config, catalogue and vision-loading tests."""

from __future__ import annotations

import json
from typing import Any

from deepinfer_model.config import preset_json

SPEC20_VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 1024,
    "patch_size": 14,
    "downsample_ratio": 2,
    "max_image_tokens": 1024,
    "min_pixels": 3136,
    "max_wh_ratio": 10,
}


def spec20_dict() -> dict[str, Any]:
    """The worked tiny configuration as a config.json dict."""
    data: dict[str, Any] = json.loads(preset_json("tiny"))
    text = data["text_config"]
    text.update(
        num_hidden_layers=6,
        compress_ratios=[0, 2, 2, 1, 2, 0, 0],
        index_source_layer_ids=[1, 2, 3, 4, 5],
        index_k_source_layer_ids=[1, 3, 4, 5],
        kv_source_layer_ids=[1, 3, 4, 5],
        candidate_source_layer_id=None,
        dspark_target_layer_ids=[1, 4],
    )
    del text["candidate_topk_blocks"], text["candidate_block_size"]
    data["vision_config"] = dict(SPEC20_VISION_CONFIG)
    return data
