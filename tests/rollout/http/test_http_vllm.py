"""vLLM's breadth on the HTTP front, what RL and eval clients send unchanged (TRL, SkyRL, prime-rl,
lm-evaluation-harness, verifiers): `echo` and `prompt_logprobs` (checked against a float64
transformers forward of the same tiny model), the sampled token in every top list, stop strings
past OpenAI's 4, the tokenizer routes, the chat template's fields, several served names, the
sampling extras and `best_of`. A front on an engine in this process (`serve_front`), no server."""

from __future__ import annotations

import httpx
import pytest
import torch

from inference import DynamicInferenceEngine
from tests.rollout.http_util import MAX_LEN, WAIT_S, engine_config, save_tiny_chat_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NAMES = ("tiny-chat", "tiny-alias")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def front_url(model_dir):
    from rollout.client.in_process import InProcessClient
    from rollout.http.launch import serve_front

    torch.set_num_threads(1)
    client = InProcessClient(DynamicInferenceEngine.from_pretrained(model_dir, engine_config()), timeout=WAIT_S)
    front = serve_front(client, model_dir, served_model_name=list(NAMES), max_model_len=MAX_LEN, timeout=WAIT_S,
                        on_stop=client.shutdown)
    try:
        yield front.url
    finally:
        front.stop()


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    """Ids -> [len, vocab] float64 log-probs of the next token at each position (transformers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    return run


@pytest.fixture
def web(front_url):
    with httpx.Client(base_url=front_url, timeout=WAIT_S) as c:
        yield c


def refused(response: httpx.Response, param: str, status: int = 400) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


# ---- echo and prompt log-probs ------------------------------------------------------------------


def test_echo_scores_the_prompt_like_vllm(oai, codec, hf_logprobs):
    """lm-evaluation-harness's log-likelihood request: echo, logprobs, max_tokens 0."""
    text = "The capital of France is Paris"
    ids = codec.encode(text)
    ref = hf_logprobs(ids)
    out = oai.completions.create(model=NAMES[0], prompt=text, echo=True, logprobs=1, max_tokens=0, temperature=0)
    c = out.choices[0]
    assert c.text == text and c.token_ids == [] and out.usage.completion_tokens == 0
    lp = c.logprobs
    assert lp.tokens == codec.token_texts(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    for i in range(1, len(ids)):  # the actual token first, then the most likely one
        top = lp.top_logprobs[i]
        assert list(top)[0] == lp.tokens[i] and 1 <= len(top) <= 2
        best = int(ref[i - 1].argmax())
        assert top[codec.token_texts([best])[0]] == pytest.approx(ref[i - 1, best].item(), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    # echo with generation: the prompt's entries, then the completion's
    gen = oai.completions.create(model=NAMES[0], prompt=text, echo=True, logprobs=0, max_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0]
    assert gen.text == text + codec.decode(gen.token_ids)
    # NOTE: the prompt's log-probs of two fp32 runs batched apart agree to rounding, not bit for bit
    assert len(gen.logprobs.tokens) == len(ids) + 3 and gen.logprobs.token_logprobs[0] is None \
        and gen.logprobs.token_logprobs[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    assert [len(t) for t in gen.logprobs.top_logprobs[1:]] == [1] * (len(ids) + 2)
    streamed = [c for chunk in oai.completions.create(model=NAMES[0], prompt=text, echo=True, logprobs=1,
                                                      max_tokens=0, stream=True) for c in chunk.choices]
    assert "".join(c.text for c in streamed) == text and streamed[0].logprobs.token_logprobs[0] is None
    assert streamed[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    plain = [c for chunk in oai.completions.create(model=NAMES[0], prompt=text, echo=True, max_tokens=2, stream=True,
                                                   temperature=0, extra_body={"ignore_eos": True})
             for c in chunk.choices]
    assert "".join(c.text for c in plain) == text + codec.decode(sum((c.token_ids for c in plain), []))


def test_prompt_logprobs_on_completions_and_chat(web, codec, hf_logprobs):
    """vLLM's `prompt_logprobs`: TRL's get_sequence_logprobs, SkyRL's sample, prime-rl's scorer."""
    ids = codec.encode("Once upon a time there was")
    ref = hf_logprobs(ids)
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}  # no `model`: the first name
    out = web.post("/v1/completions", json=body).json()
    assert out["model"] == NAMES[0]
    entries = out["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        entry = entries[i]
        assert entry[str(ids[i])]["logprob"] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert entry[str(ids[i])]["decoded_token"] == codec.token_texts([ids[i]])[0]
        top2 = torch.topk(ref[i - 1], 2).indices.tolist()
        for rank, t in enumerate(top2, 1):
            assert entry[str(t)]["rank"] == rank
            assert entry[str(t)]["logprob"] == pytest.approx(ref[i - 1, t].item(), abs=1e-4)
        assert len(entry) in (2, 3)
    messages = [{"role": "user", "content": "Hi there"}]
    chat = web.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "prompt_logprobs": 0}).json()
    prompt = chat["prompt_token_ids"]
    assert prompt == codec.chat_ids(messages) and len(chat["prompt_logprobs"]) == len(prompt)
    chat_ref = hf_logprobs(prompt)
    got = [chat["prompt_logprobs"][i][str(prompt[i])]["logprob"] for i in range(1, len(prompt))]
    assert got == pytest.approx([chat_ref[i - 1, prompt[i]].item() for i in range(1, len(prompt))], abs=1e-4)
    streamed = web.post("/v1/completions", json={**body, "stream": True})
    assert "prompt_logprobs" in refused(streamed, "prompt_logprobs")


def test_top_lists_hold_the_sampled_token(oai):
    """`logprobs: 0` answers lists (TRL reads them), and every top list holds the sampled token."""
    for stream in (False, True):
        out = oai.completions.create(model=NAMES[0], prompt=[5, 6, 7], max_tokens=4, logprobs=0, stream=stream,
                                     extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, seed=1)
        choices = [c for chunk in out for c in chunk.choices] if stream else out.choices
        tokens = [t for c in choices for t in c.logprobs.tokens]
        tops = [top for c in choices for top in c.logprobs.top_logprobs]
        assert len(tokens) == 4 and [list(top) for top in tops] == [[t] for t in tokens]
    out = oai.completions.create(model=NAMES[0], prompt=[5, 6, 7], max_tokens=6, logprobs=1, temperature=1.5,
                                 seed=3, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert list(top)[0] == token and top[token] == pytest.approx(token_lp) and len(top) in (1, 2)
    chat = oai.chat.completions.create(model=NAMES[1], messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       logprobs=True, top_logprobs=1, temperature=1.5, seed=3,
                                       extra_body={"ignore_eos": True})
    for pos in chat.choices[0].logprobs.content:
        assert pos.token in [t.token for t in pos.top_logprobs] and len(pos.top_logprobs) in (1, 2)
    assert chat.model == NAMES[1]


# ---- request fields ------------------------------------------------------------------------------


def test_stop_strings_past_four_and_the_bound(web):
    stops = [f"never{i}" for i in range(6)] + [" "]
    out = web.post("/v1/completions", json={"prompt": "a b c d e f", "max_tokens": 8, "stop": stops,
                                            "ignore_eos": True, "temperature": 0})
    assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert "1024" in refused(web.post("/v1/completions", json={"prompt": "a", "stop": ["x"] * 1025}), "stop")


def test_served_names_and_optional_model(oai, web):
    assert [m.id for m in oai.models.list().data] == list(NAMES)
    assert web.post("/v1/completions", json={"model": NAMES[1], "prompt": "a", "max_tokens": 1}).json()["model"] \
        == NAMES[1]
    missing = web.post("/v1/completions", json={"model": "other", "prompt": "a", "max_tokens": 1})
    assert refused(missing, "model", 404).startswith("The model `other` does not exist")


def test_tokenize_detokenize_tokenizer_info_and_render(web, codec):
    text = "Hello world, again"
    out = web.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert out == {"count": len(codec.encode(text)), "max_model_len": MAX_LEN, "tokens": codec.encode(text),
                   "token_strs": codec.tokenizer.convert_ids_to_tokens(codec.encode(text))}
    messages = [{"role": "user", "content": "Hi"}]
    chat = web.post("/tokenize", json={"model": NAMES[1], "messages": messages}).json()
    assert chat["tokens"] == codec.chat_ids(messages) and "token_strs" not in chat
    bare = web.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == codec.encode(codec.render(messages, add_generation_prompt=False),
                                          add_special_tokens=False)
    assert web.post("/detokenize", json={"tokens": out["tokens"]}).json() == {"prompt": text}
    assert refused(web.post("/detokenize", json={"tokens": [10**6]}), "tokens")
    info = web.get("/tokenizer_info").json()
    assert info["tokenizer_class"] and info["eos_token"] == codec.tokenizer.eos_token
    assert info["chat_template"] == codec.tokenizer.chat_template
    rendered = web.post("/v1/chat/completions/render", json={"messages": messages, "temperature": 0,
                                                             "max_tokens": 3, "logprobs": True}).json()
    assert rendered["token_ids"] == codec.chat_ids(messages) and rendered["model"] == NAMES[0]
    assert rendered["sampling_params"] == {"temperature": 0, "max_tokens": 3, "logprobs": 0, "n": 1,
                                           "ignore_eos": False, "min_tokens": 0, "skip_special_tokens": True,
                                           "include_stop_str_in_output": False}
    # vLLM's render-then-generate: the rendered request runs as it is
    generated = web.post("/inference/v1/generate", json=rendered)
    assert generated.status_code == 200, generated.text
    assert len(generated.json()["choices"][0]["token_ids"]) <= 3


def test_chat_template_fields(web, codec):
    """verifiers / TRL: chat_template_kwargs, add_generation_prompt, continue_final_message."""
    partial = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "one two"}]
    body = {"messages": partial, "max_tokens": 1, "add_generation_prompt": False, "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    out = web.post("/v1/chat/completions", json=body).json()
    assert out["prompt_token_ids"] == codec.chat_ids(partial, add_generation_prompt=False,
                                                     continue_final_message=True)
    plain = web.post("/v1/chat/completions", json={**body, "continue_final_message": False}).json()
    assert plain["prompt_token_ids"] == codec.chat_ids(partial, add_generation_prompt=False)
    both = web.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert "Cannot set both" in refused(both, "continue_final_message")
    clash = web.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"tools": []}})
    assert "tools" in refused(clash, "messages")


def test_sampling_extras_map_onto_the_engine_fields(codec):
    from types import SimpleNamespace

    from rollout.http.core.sampling import sampling_params
    from rollout.http.core.schemas import CompletionRequest

    body = CompletionRequest(prompt="x", repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=-0.5,
                             min_tokens=2, logit_bias={"42": 5.0}, bad_words=["hello"], allowed_token_ids=[3, 4],
                             cache_salt="run-7", seed=9)
    params = sampling_params(codec, body, n=1, max_tokens=8, logprobs=None)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty, params.min_tokens,
            params.logit_bias, params.allowed_token_ids, params.cache_salt, params.seed) == \
        (1.3, 0.5, -0.5, 2, {42: 5.0}, [3, 4], "run-7", 9)
    bare, spaced = codec.encode("hello", add_special_tokens=False), codec.encode(" hello", add_special_tokens=False)
    assert params.bad_words_token_ids == ([bare, spaced] if len(bare) == len(spaced) and bare[0] != spaced[0]
                                          else [bare])
    neutral = sampling_params(codec, CompletionRequest(prompt="x", repetition_penalty=1.0), n=1, max_tokens=8,
                              logprobs=None)
    assert neutral.repetition_penalty == 1.0 and neutral.logit_bias is None
    sglang = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=None, stop_token_ids=None,
                             ignore_eos=False, repetition_penalty=1.1, presence_penalty=0.0, frequency_penalty=0.0,
                             min_tokens=3, cache_salt=None, logit_bias=None, bad_words=None, allowed_token_ids=None,
                             logprobs_mode=None)  # as sglang_routes._sampling builds it
    assert sampling_params(codec, sglang, n=1, max_tokens=8, logprobs=None).min_tokens == 3


def test_sampling_extras_over_http(web):
    """TRL sends repetition_penalty 1.0 on every request; bad values are 400s naming their field."""
    neutral = {"prompt": "a", "max_tokens": 2, "repetition_penalty": 1.0, "presence_penalty": 0.0,
               "frequency_penalty": 0.0, "min_tokens": 0, "logit_bias": {}, "seed": 3}
    assert web.post("/v1/completions", json=neutral).status_code == 200
    chat = {k: v for k, v in neutral.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "a"}]}
    assert web.post("/v1/chat/completions", json=chat).status_code == 200
    assert refused(web.post("/v1/completions", json={**neutral, "min_tokens": 5}), "min_tokens")  # > max_tokens
    assert refused(web.post("/v1/completions", json={**neutral, "logit_bias": {"x": 1}}), "logit_bias")
    assert refused(web.post("/v1/completions", json={**neutral, "logit_bias": {"99999999": 1}}), "logit_bias")
    assert refused(web.post("/v1/completions", json={**neutral, "allowed_token_ids": [10**7]}), "allowed_token_ids")
    assert refused(web.post("/v1/completions", json={**neutral, "presence_penalty": 3}), "presence_penalty")
    for field, value in {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                         "min_tokens": 1, "logit_bias": {"42": 3}, "bad_words": ["hello"], "allowed_token_ids": [5, 6],
                         "cache_salt": "run-7"}.items():  # honoured, or (an engine without it) refused naming it
        answer = web.post("/v1/completions", json={**neutral, field: value})
        assert answer.status_code == 200 or refused(answer, field)
    sglang = web.post("/generate", json={"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 2, "repetition_penalty": 1.0, "min_new_tokens": 0}})
    assert sglang.status_code == 200


def test_logprobs_mode_is_chosen_per_request(web):
    """raw: the model's distribution (what a trainer recomputes); processed: the one sampled from.
    With top_k 1 the processed distribution puts all its mass on the sampled token."""
    body = {"prompt": "The sky is", "max_tokens": 4, "temperature": 1.0, "top_k": 1, "logprobs": 0, "seed": 1}
    raw = web.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
    processed = web.post("/v1/completions", json={**body, "logprobs_mode": "processed"}).json()
    kept = processed["choices"][0]["logprobs"]["token_logprobs"]
    assert all(lp < 0 for lp in raw) and kept == [0.0] * 4
    vllm_name = web.post("/v1/completions", json={**body, "logprobs_mode": "processed_logprobs"}).json()
    assert vllm_name["choices"][0]["logprobs"]["token_logprobs"] == [0.0] * 4
    assert refused(web.post("/v1/completions", json={**body, "logprobs_mode": "logits"}), "logprobs_mode")


def test_best_of_returns_the_top_n_by_cumulative_logprob(web):
    body = {"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 1.0, "seed": 11, "ignore_eos": True,
            "logprobs": 0}
    pool = web.post("/v1/completions", json={**body, "n": 4}).json()["choices"]
    best = web.post("/v1/completions", json={**body, "n": 2, "best_of": 4}).json()["choices"]
    ranked = sorted(pool, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))[:2]
    assert [c["token_ids"] for c in best] == [c["token_ids"] for c in ranked] and [c["index"] for c in best] == [0, 1]
    assert "best_of" in refused(web.post("/v1/completions", json={**body, "n": 3, "best_of": 2}), "best_of")
    assert refused(web.post("/v1/completions", json={**body, "best_of": 2, "stream": True}), "best_of")


def test_served_model_name_takes_several_names_on_the_command_line():
    import argparse

    from rollout.server.serve import add_http_arguments, add_serve_arguments

    for add in (add_serve_arguments, add_http_arguments):
        parser = argparse.ArgumentParser()
        add(parser)
        required = ["--connect", "tcp://127.0.0.1:1"] if add is add_http_arguments else []
        args = parser.parse_args(["--model", "m", *required, "--served-model-name", "a", "b"])
        assert args.served_model_name == ["a", "b"]


def test_sampling_extras_are_honoured_end_to_end(web):
    """With the engine's processors (branch h25a): each field changes what is sampled as it says."""
    base = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert web.post("/v1/completions", json={**base, "logit_bias": {"42": 100}}).json()["choices"][0]["token_ids"] \
        == [42] * 4
    assert set(web.post("/v1/completions", json={**base, "temperature": 1.0, "seed": 2,
                                                  "allowed_token_ids": [8, 9]}).json()["choices"][0]["token_ids"]) \
        <= {8, 9}
    greedy = web.post("/v1/completions", json=base).json()["choices"][0]["token_ids"]
    banned = web.post("/v1/completions", json={**base, "logit_bias": {str(greedy[0]): -100}}).json()
    assert banned["choices"][0]["token_ids"][0] != greedy[0]
    repeated = web.post("/v1/completions", json={**base, "max_tokens": 8, "logit_bias": {"42": 8.0},
                                                 "repetition_penalty": 50.0}).json()["choices"][0]["token_ids"]
    assert repeated.count(42) == 1  # biased in once, then penalised out


def test_continuous_usage_stats_count_every_chunk(oai):
    """vLLM's `continuous_usage_stats`: each chunk's usage is the tokens so far (chat and completions)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = oai.chat.completions.create(model=NAMES[0], messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       temperature=0, stream=True, stream_options=options,
                                       extra_body={"ignore_eos": True})
    text = oai.completions.create(model=NAMES[0], prompt=[5, 6, 7], max_tokens=6, temperature=0, stream=True,
                                  stream_options=options, extra_body={"ignore_eos": True})
    for stream in (chat, text):
        seen, counts = 0, []
        for chunk in stream:
            assert chunk.usage is not None
            seen += sum(len(c.model_extra["token_ids"]) for c in chunk.choices)
            counts.append(chunk.usage.completion_tokens)
            assert chunk.usage.completion_tokens == seen and chunk.usage.prompt_tokens > 0
        assert counts[-1] == 6 and len(counts) > 2
