"""Checkpoint loading: HF name mapping, tensor catalogue, safetensors I/O, strict coverage
(docs/design/model.md, "Checkpoint layout", "Tensor names")."""
