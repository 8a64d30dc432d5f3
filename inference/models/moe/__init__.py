"""Sparse MoE decoders: the routed-experts maths, local dispatch, spec, names, loading and routing replay."""
