"""Structured outputs through the engine: a tiny random Llama over SmolLM2's real tokenizer.

The reference for greedy decoding under a grammar is a float64 loop over the HF model that asks a
fresh llguidance matcher (built here, not through the engine) for its allowed tokens as bytes and
takes the argmax over them: the engine's bitmask unpacking, row mapping, slot binding, preemption
and finishing are all on trial. Sampled completions are checked by `jsonschema` and `re`.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import llguidance as llg
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from inference import DynamicInferenceEngine, FinishReason, InferenceConfig, LogprobsMode, SamplingParams
from inference.sampling.grammar import grammar_text
from inference.sampling.processors import StepProcessors, apply_processors
from inference.sampling.structured import StructuredOutputs
from tests.reference import float64_copy
from tests.rollout.http_util import smollm2_tokenizer_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 49152
EOS = 2
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "ok": {"type": "boolean"},
    "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "ok", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer_dir():
    return smollm2_tokenizer_dir()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def engine(model, tokenizer_dir, **kw):
    cfg = dict(block_size=4, num_blocks=512, max_requests=16, max_batch_tokens=256, max_sequence_length=160,
               tokenizer=str(tokenizer_dir))
    cfg.update(kw)
    return DynamicInferenceEngine.from_pretrained(model, InferenceConfig(**cfg))


def allowed_tokens(matcher: llg.LLMatcher) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return np.flatnonzero(bits[:VOCAB])


@torch.no_grad()
def reference_greedy(reference, tokenizer_dir, prompt: list[int], spec: StructuredOutputs, max_tokens: int
                     ) -> tuple[list[int], str]:
    """Greedy over float64 logits restricted to the grammar's tokens; stops where the grammar does."""
    tok = llg.LLTokenizer(str(tokenizer_dir / "tokenizer.json"), n_vocab=VOCAB, eos_token=[EOS])
    matcher = llg.LLMatcher(tok, grammar_text(spec), log_level=0)
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        logits = reference(torch.tensor([ids])).logits[0, -1]
        allowed = torch.from_numpy(allowed_tokens(matcher))
        token = int(allowed[logits[allowed].argmax()])
        out.append(token)
        ids.append(token)
        assert matcher.consume_token(token)
        if token == EOS or matcher.is_stopped():
            return out, "stop"
    return out, "length"


SPECS = [
    StructuredOutputs(json=json.dumps(SCHEMA), disable_any_whitespace=True),
    StructuredOutputs(regex=r"[0-9]{2,4}-(ab|cd)+x"),
    StructuredOutputs(choice=("alpha", "beta", "gamma delta")),
    StructuredOutputs(grammar='start: "(" item ("," item)* ")"\nitem: /[a-c]{1,3}/'),
    StructuredOutputs(json_object=True, disable_any_whitespace=True),
]


def test_greedy_under_each_grammar_matches_the_float64_masked_reference(model, tokenizer_dir):
    """Every kind in one batch beside an unconstrained request (which must be plain greedy)."""
    prompts = [[1, 100 + 7 * i, 200 + i, 300] for i in range(len(SPECS) + 1)]
    eng = engine(model, tokenizer_dir)
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=spec) for spec in SPECS]
    params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    outs = eng.generate(prompts, params)
    reference = float64_copy(model)
    for out, prompt, spec in zip(outs, prompts, SPECS):
        want, reason = reference_greedy(reference, tokenizer_dir, prompt, spec, 48)
        assert out.generated_token_ids == want, spec.kind
        assert out.finish_reason.value == reason, spec.kind
    plain = model.generate(torch.tensor([prompts[-1]]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompts[-1]):].tolist()
    assert outs[-1].generated_token_ids == plain


def test_sampled_completions_match_their_constraint(model, tokenizer_dir):
    """n = 6 seeded samples per constraint: every finished one parses and validates."""
    from transformers import AutoTokenizer

    text_of = AutoTokenizer.from_pretrained(tokenizer_dir)
    eng = engine(model, tokenizer_dir)
    cases = [(SPECS[0], lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
             (SPECS[1], lambda t: re.fullmatch(r"[0-9]{2,4}-(ab|cd)+x", t) or pytest.fail(t)),
             (SPECS[2], lambda t: t in {"alpha", "beta", "gamma delta"} or pytest.fail(t))]
    params = [SamplingParams(n=6, temperature=1.0, seed=7, max_tokens=64, structured_outputs=spec)
              for spec, _ in cases]
    outs = eng.generate([[1, 50, 60]] * len(cases), params)
    for i, (spec, check) in enumerate(cases):
        group = outs[6 * i: 6 * i + 6]
        assert all(o.finish_reason is FinishReason.STOP for o in group), spec.kind
        texts = [text_of.decode(o.generated_token_ids, skip_special_tokens=True) for o in group]
        for text in texts:
            check(text)
        assert len(set(texts)) > 1, f"{spec.kind}: seeded samples should differ"


def test_a_preempted_request_resumes_its_grammar_where_it_was(model, tokenizer_dir):
    """A pool too small for all: requests are evicted mid-grammar and recomputed; each matcher is
    rebuilt from the tokens it had, so the result is the unpreempted one."""
    spec = SPECS[3]
    prompts = [[1, 40 + i, 41, 42, 43, 44] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    roomy = engine(model, tokenizer_dir).generate(prompts, params)
    tight = engine(model, tokenizer_dir, num_blocks=24, max_requests=4).generate(prompts, params)
    assert sum(o.num_preemptions for o in tight) > 0, "the pool must be small enough to preempt"
    assert [o.generated_token_ids for o in tight] == [o.generated_token_ids for o in roomy]


def test_processed_logprobs_see_the_mask_raw_do_not(model, tokenizer_dir):
    spec = SPECS[1]
    prompt = [1, 77, 78]
    eng = engine(model, tokenizer_dir)
    raw, processed = eng.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=6, structured_outputs=spec, logprobs=0),
        SamplingParams(temperature=0, max_tokens=6, structured_outputs=spec, logprobs=0,
                       logprobs_mode=LogprobsMode.PROCESSED)])
    assert raw.generated_token_ids == processed.generated_token_ids
    reference = float64_copy(model)
    tok = llg.LLTokenizer(str(tokenizer_dir / "tokenizer.json"), n_vocab=VOCAB, eos_token=[EOS])
    matcher = llg.LLMatcher(tok, grammar_text(spec), log_level=0)
    ids = list(prompt)
    with torch.no_grad():
        for token, lp_raw, lp_proc in zip(raw.generated_token_ids, raw.logprobs, processed.logprobs):
            logits = reference(torch.tensor([ids])).logits[0, -1]
            masked = torch.full_like(logits, -math.inf)
            allowed = torch.from_numpy(allowed_tokens(matcher))
            masked[allowed] = logits[allowed]
            assert lp_raw == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-4)
            assert lp_proc == pytest.approx(float(torch.log_softmax(masked, -1)[token]), abs=1e-4)
            assert matcher.consume_token(token)
            ids.append(token)


def test_bad_constraints_are_refused_naming_the_field_and_the_engine_serves_on(model, tokenizer_dir):
    eng = engine(model, tokenizer_dir)
    with pytest.raises(ValueError, match=r"(?s)^structured_outputs\.regex: .*unclosed group"):
        eng.generate([[1, 5]], SamplingParams(structured_outputs={"regex": "a("}))
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: "):
        eng.generate([[1, 5]], SamplingParams(structured_outputs={"json": '{"type": "no-such-type"}'}))
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: "):
        eng.generate([[1, 5]], SamplingParams(structured_outputs={"json": "{not json"}))
    with pytest.raises(ValueError, match=r"^structured_outputs: exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match=r"^structured_outputs: exactly one of"):
        SamplingParams(structured_outputs={})
    with pytest.raises(ValueError, match=r"^structured_outputs: .*unexpected keyword"):
        SamplingParams(structured_outputs={"guided_json": "{}"})
    with pytest.raises(ValueError, match=r"^structured_outputs\.structural_tag: "):
        eng.generate([[1, 5]], SamplingParams(structured_outputs={"structural_tag": '{"structures": []}'}))
    out = eng.generate([[1, 5]], SamplingParams(temperature=0, max_tokens=4, structured_outputs={"choice": ["ok"]}))
    assert out[0].finish_reason is FinishReason.STOP


def test_an_engine_without_a_tokenizer_refuses_structured_outputs(model):
    eng = DynamicInferenceEngine.from_pretrained(model, InferenceConfig(block_size=4, num_blocks=64, max_requests=2))
    with pytest.raises(ValueError, match=r"^structured_outputs: this engine has no tokenizer"):
        eng.generate([[1, 5]], SamplingParams(structured_outputs={"choice": ["a"]}))
    assert eng.generate([[1, 5]], SamplingParams(temperature=0, max_tokens=2))[0].generated_token_ids


def test_options_follow_vllm(tokenizer_dir):
    """disable_additional_properties closes every object; whitespace off forbids it between tokens,
    a pattern replaces the bounded default."""
    tok = llg.LLTokenizer(str(tokenizer_dir / "tokenizer.json"), n_vocab=VOCAB, eos_token=[EOS])
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def accepts(spec: StructuredOutputs, text: str) -> bool:
        m = llg.LLMatcher(tok, grammar_text(spec), log_level=0)
        return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()

    closed = StructuredOutputs(json=json.dumps(loose), disable_additional_properties=True)
    assert accepts(StructuredOutputs(json=json.dumps(loose)), '{"a": 1, "b": 2}')
    assert not accepts(closed, '{"a": 1, "b": 2}')
    assert accepts(closed, '{"a": 1}')
    assert not accepts(StructuredOutputs(json=json.dumps(loose), disable_any_whitespace=True), '{"a": 1}')
    assert accepts(StructuredOutputs(json=json.dumps(loose), disable_any_whitespace=True), '{"a":1}')
    assert accepts(StructuredOutputs(json_object=True), '{"x": [1, {"y": null}]}')
    # whitespace is bounded by default (one newline, an indent of up to 20): pretty-printing fits
    assert accepts(StructuredOutputs(json=json.dumps(loose)), '{\n    "a": 1\n}')
    assert not accepts(StructuredOutputs(json=json.dumps(loose)), '{\n\n"a": 1}')
    assert accepts(StructuredOutputs(json=json.dumps(loose), whitespace_pattern=r"\s*"), '{\n\n"a": 1}')
    assert not accepts(StructuredOutputs(json_object=True), '[1]')
    tag = {"structures": [{"begin": "<f=a>", "schema": loose, "end": "</f>"}], "triggers": ["<f="]}
    assert accepts(StructuredOutputs(structural_tag=json.dumps(tag)), 'free text <f=a>{"a": 3}</f> more')
    assert accepts(StructuredOutputs(grammar='root ::= "x" [0-9]+'), "x42")  # GBNF, as llama.cpp writes it


def test_the_mask_unpacks_bit_t_of_word_t_over_32_for_any_rows():
    """`apply_processors`' grammar step against numpy's own bit unpacking: a vocabulary not a multiple
    of 32, a subset of the rows and then all of them; SmolLM2's vocabulary over 30 rows, which the
    step unpacks in chunks of rows."""
    rng = np.random.default_rng(0)
    for vocab, total, subsets in [(70, 4, (np.array([1, 3]), np.arange(4))),
                                  (VOCAB, 30, (np.sort(rng.choice(30, 24, replace=False)), np.arange(30)))]:
        words = (vocab + 31) // 32
        for rows in subsets:
            mask = rng.integers(-2**31, 2**31, size=(rows.size, words), dtype=np.int64).astype(np.int32)
            mask[0] = -1  # a row with every token allowed, and one with none
            mask[-1] = 0
            x = torch.randn(total, vocab)
            got = apply_processors(x.clone(), StepProcessors(grammar_rows=torch.from_numpy(rows),
                                                             grammar_mask=torch.from_numpy(mask)))
            want = x.clone()
            for i, r in enumerate(rows):
                bits = np.unpackbits(mask[i].view(np.uint8), bitorder="little")[:vocab].astype(bool)
                want[r, torch.from_numpy(~bits)] = -math.inf
            assert torch.equal(got, want), (vocab, rows.size)


def test_grammars_compile_off_the_loop_on_the_compile_thread(model, tokenizer_dir, monkeypatch):
    """With the step loop in its own thread, a new constraint is built (LLMatcher) on the compile
    thread (its large stack: `grammar_limits`) while the submitting thread waits; the loop's own
    check finds it cached."""
    import threading

    import inference.sampling.grammar as grammar

    built_on = []
    real = grammar.llg.LLMatcher

    def recording(*args, **kwargs):
        built_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    eng = engine(model, tokenizer_dir)
    eng.start()
    try:
        monkeypatch.setattr(grammar.llg, "LLMatcher", recording)
        stream = eng.submit([1, 5, 6], SamplingParams(temperature=0, max_tokens=8,
                                                      structured_outputs={"regex": "[a-d]{3}"}))
        [out] = stream.result(timeout=30)
    finally:
        eng.stop()
    assert out.finish_reason is FinishReason.STOP
    assert len(built_on) == 1 and built_on[0].startswith("grammar-compile")
