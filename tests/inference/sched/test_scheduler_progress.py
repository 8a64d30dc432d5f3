"""Progress when requests outgrow the pool together: two prefills that fill it and then both need a
block for their next token. One is paused and evicted, and the blocks it frees resume the other,
which must decode in that same step: were it left out, the step would run nothing and evict it too,
both would be admitted again together, and so on for ever."""

from __future__ import annotations

from inference.config import EvictionPolicy, InferenceConfig
from inference.core.engine_core import EngineCore
from inference.sampling.params import SamplingParams
from tests.inference.sched.test_scheduler_stateful import StandIn, follows


def test_two_requests_that_fill_the_pool_together_both_finish():
    # 8 blocks of 4 tokens: each 17-token prompt fills 4 of them and needs a 5th for its first token
    config = InferenceConfig(block_size=4, num_blocks=8, max_requests=6, max_batch_tokens=8, chunked_prefill_size=4,
                             max_sequence_length=32, enable_prefix_caching=False,
                             eviction_policy=EvictionPolicy.REF_ZERO)
    outputs = []
    core = EngineCore(StandIn(), config, outputs.append, lambda events: None)
    for prompt in ([5] * 17, [6] * 17):
        core.add_checked(*core.check_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)))
    for _ in range(40):  # NOTE: 13 steps: both prefill (5 chunks), one is evicted, each runs alone after
        core.step()
        if not core.has_unfinished_requests():
            break
    assert len(outputs) == 2 and core.scheduler.num_preemptions == 1
    assert all(len(o.generated_token_ids) == 4 and follows(o.prompt_token_ids + o.generated_token_ids, 17)
               for o in outputs)
