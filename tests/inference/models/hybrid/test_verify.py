"""A Mamba2 layer's speculative verify rows against plain decode steps: each verify row is the
decode of its token after the rows before it, the verify leaves the state rows as they were, and
the rollback (`advance_layer`) leaves exactly the state a plain decode of the kept tokens leaves."""

from __future__ import annotations

import pytest
import torch

from inference.models.hybrid.mamba2 import Mamba2Dims, Mamba2Weights, mamba2_layer
from inference.models.hybrid.verify import advance_layer, verify_layer
from tests.inference.models.hybrid.tiny import tiny_hybrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENS = [3, 1, 5, 4]  # rows per request: its last token and its proposals
SLOTS = [2, 0, 4, 1]  # their state rows (row 3 belongs to no request)


@pytest.fixture(scope="module", params=["bamba", "falcon_h1"])
def layer(request):
    from inference import DynamicInferenceEngine, InferenceConfig

    model = DynamicInferenceEngine.from_pretrained(tiny_hybrid(request.param), InferenceConfig(num_blocks=8)).model
    mixer = next(m for _, ms in model._blocks for m in ms if m.spec.kind.value == "mamba")
    return mixer.w, model.spec.mamba, model._proj_scale


def random_pools(dims: Mamba2Dims, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pools of 5 rows holding random states, as after some prefill."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(5, *dims.conv_state_shape, generator=gen),
            torch.randn(5, *dims.ssm_state_shape, generator=gen) * 0.3)


def plain_decode(h, w: Mamba2Weights, dims: Mamba2Dims, scale, conv, ssm, lens, upto):
    """Rows of the requests' first `upto[b]` tokens, one decode step per token and request (state
    rows updated in place), in the verify's flat-row order."""
    starts = [sum(lens[:b]) for b in range(len(lens))]
    rows = {}
    for b, (slot, n) in enumerate(zip(SLOTS, upto)):
        for j in range(n):
            r = starts[b] + j
            rows[r] = mamba2_layer(h[r : r + 1], w, dims, conv, ssm, torch.tensor([slot]), torch.tensor([False]),
                                   [0, 1], 1, scale)[0]
    return rows


def test_verify_rows_are_decode_steps_and_leave_the_state_rows_alone(layer):
    w, dims, scale = layer
    h = torch.randn(sum(LENS), dims.hidden_size, generator=torch.Generator().manual_seed(3))
    conv, ssm = random_pools(dims, seed=4)
    before = conv.clone(), ssm.clone()
    out, record = verify_layer(h, w, dims, 0, conv, ssm, torch.tensor(SLOTS), LENS, scale)
    assert torch.equal(conv, before[0]) and torch.equal(ssm, before[1])
    assert record.xbc.shape[0] == record.conv_out.shape[0] == record.dt.shape[0] == sum(LENS)
    want = plain_decode(h, w, dims, scale, conv.clone(), ssm.clone(), LENS, LENS)
    # NOTE: the same fp32 ops row by row; only in_proj / out_proj see another number of rows, which
    # may regroup their sums: default fp32 tolerance (rtol 1.3e-6)
    torch.testing.assert_close(out, torch.stack([want[r] for r in range(sum(LENS))]))


@pytest.mark.parametrize("kept", [[1, 1, 1, 1], [3, 1, 2, 4], [2, 1, 5, 1]], ids=["none", "mixed", "all-or-one"])
def test_rollback_leaves_the_state_of_a_plain_decode_of_the_kept_tokens(layer, kept):
    w, dims, scale = layer
    h = torch.randn(sum(LENS), dims.hidden_size, generator=torch.Generator().manual_seed(5))
    conv, ssm = random_pools(dims, seed=6)
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    _, record = verify_layer(h, w, dims, 0, conv, ssm, torch.tensor(SLOTS), LENS, scale)
    advance_layer(record, w, dims, conv, ssm, torch.tensor(SLOTS), LENS, kept)
    plain_decode(h, w, dims, scale, ref_conv, ref_ssm, LENS, kept)
    # the conv window is the kept inputs moved, bit for bit; the SSM state the same fp32 recurrence
    # on inputs computed from in_proj over another number of rows (see above)
    torch.testing.assert_close(conv, ref_conv)
    torch.testing.assert_close(ssm, ref_ssm)
    assert torch.equal(ssm[3], random_pools(dims, seed=6)[1][3])  # a row no request holds is untouched


def test_kept_counts_out_of_range_are_refused(layer):
    w, dims, scale = layer
    conv, ssm = random_pools(dims, seed=9)
    h = torch.randn(sum(LENS), dims.hidden_size)
    _, record = verify_layer(h, w, dims, 0, conv, ssm, torch.tensor(SLOTS), LENS, scale)
    for kept in ([0, 1, 1, 1], [4, 1, 1, 1]):
        with pytest.raises(ValueError, match="kept"):
            advance_layer(record, w, dims, conv, ssm, torch.tensor(SLOTS), LENS, kept)
