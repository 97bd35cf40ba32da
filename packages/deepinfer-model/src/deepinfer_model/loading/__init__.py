"""Checkpoint loading: HF name mapping, tensor catalogue, safetensors I/O, strict coverage (model-core §1, §4, §6)."""
