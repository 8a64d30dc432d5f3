"""The model runner: persistent step inputs, batch-shape buckets, the forward and the sampler."""
