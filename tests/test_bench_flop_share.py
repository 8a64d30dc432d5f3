"""bench/throughput/flop_share.py's matmul probe: the machine's rate is the fastest GEMM form at the fastest
batch size it tries, and the engine's own dispatch is one of the forms (no timing is asserted
beyond a form made a thousand times slower on purpose)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from bench.throughput.flop_share import MatmulProbe, gemm_shapes  # noqa: E402

CONFIG = SimpleNamespace(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=128)


def test_the_probe_has_torch_and_the_engine_forms():
    probe = MatmulProbe(CONFIG, [4, 2, 4], torch.float32)
    assert probe.batches == [2, 4]
    assert set(probe.forms) == {"F.linear", "engine"}
    rate = probe.rate(repeats=1)
    assert rate.form in probe.forms and rate.batch in (2, 4) and rate.flops_per_s > 0


def test_the_rate_is_the_fastest_form_and_its_flops_count_every_gemm():
    def slow(x, w):  # NOTE: ~1 ms a call against microseconds: never the fastest
        time.sleep(1e-3)
        return F.linear(x, w)

    probe = MatmulProbe(CONFIG, [2, 8], torch.float32)
    probe.forms = {"slow": (slow, slow), "F.linear": (F.linear, F.linear)}
    rate = probe.rate(repeats=1)
    assert rate.form == "F.linear"
    assert probe.step_flops == 2 * sum(o * i for o, i in gemm_shapes(CONFIG))
    assert len(gemm_shapes(CONFIG)) == 7 * CONFIG.num_hidden_layers + 1
