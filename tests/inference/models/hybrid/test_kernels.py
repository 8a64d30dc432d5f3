"""The CUDA Mamba2 path (mamba-ssm / causal-conv1d kernels) against the torch reference, when both
CUDA and the kernels are there; skipped otherwise (the kernels are an optional extra)."""

from __future__ import annotations

import pytest
import torch

from inference.models.hybrid import kernels as mamba_kernels
from inference.models.hybrid.mamba2 import mamba2_layer

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not mamba_kernels.available(torch.device("cuda")), reason="needs CUDA, mamba-ssm, causal-conv1d")
def test_the_kernel_layer_matches_the_torch_layer():
    from inference import DynamicInferenceEngine, InferenceConfig
    from tests.inference.models.hybrid.tiny import tiny_hybrid

    model = DynamicInferenceEngine.from_pretrained(
        tiny_hybrid("bamba").to("cuda", torch.bfloat16), InferenceConfig(num_blocks=8, dtype=torch.bfloat16,
                                                                         device="cuda")).model
    assert model.kernels is not None
    mixer = next(m for _, ms in model._blocks for m in ms if m.spec.kind.value == "mamba")
    dims = model.spec.mamba
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(14, dims.hidden_size, generator=gen, device="cuda", dtype=torch.bfloat16)
    slots, fresh, bounds = torch.tensor([0, 1, 2], device="cuda"), torch.tensor([False, True, False], device="cuda"), \
        [0, 1, 9, 14]
    outs, states = [], []
    for layer in (model.kernels.layer, mamba2_layer):
        conv = torch.randn(4, *dims.conv_state_shape, generator=torch.Generator(device="cuda").manual_seed(1),
                           device="cuda", dtype=torch.bfloat16)
        ssm = torch.randn(4, *dims.ssm_state_shape, generator=torch.Generator(device="cuda").manual_seed(2),
                          device="cuda")
        outs.append(layer(h, mixer.w, dims, conv, ssm, slots, fresh, bounds, 1, model._proj_scale))
        states.append((conv, ssm))
    torch.testing.assert_close(outs[0], outs[1], rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(states[0][1], states[1][1], rtol=3e-2, atol=3e-2)
