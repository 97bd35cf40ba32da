"""Fused sampler kernels (Triton), selected by `SamplerConfig(backend="triton")`; imported only when used."""
