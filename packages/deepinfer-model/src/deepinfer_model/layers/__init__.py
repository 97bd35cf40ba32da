"""Model-independent layers: linear layers over stored formats, embedding and LM head, RMSNorm, RoPE
(the MoE's SwiGLU is the kernels' ``swiglu_clamped``).

Every layer takes a ``ComputeMode``: ``EXACT`` follows the spec's BF16 rounding points and FP8 activation
quantization; ``FP32`` dequantizes weights and runs every step in FP32 without activation quantization (parity mode).
Parameters hold the checkpoint's stored formats and carry a ``weight_loader`` (see ``linear.py``).
"""

from deepinfer_model.layers.mode import ComputeMode

__all__ = ["ComputeMode"]
