"""Hybrid attention + Mamba2 decoders (Bamba, Nemotron-H, Falcon-H1): spec, loading, Mamba2 maths, kernels."""
