"""TextCodec (SmolLM2's tokenizer and chat template), drift-free chat continuation, the session
store, and text / chat prompts on the in-process engine."""

from __future__ import annotations

import pytest

from inference import SamplingParams
from rollout.http.core.sessions import Reply, SessionStore
from rollout.text import ChatTemplateError, PromptTooLongError, TextCodec, is_chat, token_prompts
from tests.rollout.http_util import engine_config, save_tiny_chat_model, smollm2_tokenizer_dir

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def codec():
    return TextCodec.load(smollm2_tokenizer_dir())


def test_chat_ids_are_the_template_encoded_without_added_specials(codec):
    want = codec.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    want = want if isinstance(want, list) else want["input_ids"]
    assert codec.chat_ids(CHAT) == list(want)
    assert codec.decode(codec.chat_ids(CHAT), skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    with pytest.raises(ChatTemplateError):
        TextCodec(type("NoTemplate", (), {"eos_token_id": 2, "eos_token": "<|im_end|>", "chat_template": None,
                                          "__len__": lambda self: 10})()).render(CHAT)


@pytest.mark.parametrize("ends_on_eos", [True, False])
def test_continuation_keeps_sampled_ids_and_adds_only_the_new_text(codec, ends_on_eos):
    prompt = codec.chat_ids(CHAT)
    # " hel" + "lo" spells " hello", which tokenizes as one other id: re-tokenizing would drift
    sampled = codec.encode(" hel", add_special_tokens=False) + codec.encode("lo", add_special_tokens=False)
    assert codec.encode(" hello", add_special_tokens=False) != sampled
    if ends_on_eos:
        sampled = sampled + [codec.tokenizer.eos_token_id]
    reply = {"role": "assistant", "content": codec.decode(sampled)}
    new = [{"role": "tool", "content": '{"temp_c": 21}'}, {"role": "user", "content": "And tomorrow?"}]
    ids = codec.continuation_ids(CHAT, prompt, sampled, reply, new)
    assert ids[:len(prompt) + len(sampled)] == prompt + sampled
    rendered = codec.render([*CHAT, reply, *new])
    # the text is the template's, all but the tokenization of the reply
    assert codec.decode(ids, skip_special_tokens=False) == rendered
    assert codec.chat_ids([*CHAT, reply, *new]) != ids


def test_session_store_continues_restarts_and_forgets(codec):
    store = SessionStore(max_sessions=2, ttl_s=60)
    prompt, continued = store.prompt_ids(codec, "a", CHAT, None)
    assert not continued and prompt == codec.chat_ids(CHAT)
    sampled = codec.encode(" Sunny", add_special_tokens=False)
    store.record("a", CHAT, None, prompt, [Reply("other", [5]), Reply(" Sunny", sampled)])
    turn2 = [*CHAT, {"role": "assistant", "content": " Sunny"}, {"role": "user", "content": "Thanks"}]
    ids, continued = store.prompt_ids(codec, "a", turn2, None)
    assert continued and ids[:len(prompt) + len(sampled)] == prompt + sampled
    edited = [*CHAT[:1], {"role": "user", "content": "edited"}, *turn2[2:]]
    assert store.prompt_ids(codec, "a", edited, None) == (codec.chat_ids(edited), False)  # history changed
    unknown_reply = [*CHAT, {"role": "assistant", "content": "never sampled"}, turn2[-1]]
    assert store.prompt_ids(codec, "a", unknown_reply, None)[1] is False
    assert store.restarts == 2 and store.continued == 1
    store.record("b", CHAT, None, prompt, [])
    store.record("c", CHAT, None, prompt, [])
    assert store.get("a") is None and len(store) == 2  # least recently used dropped first


def test_token_prompts_detects_text_and_chat(codec):
    ids = [[1, 2, 3]]
    assert token_prompts(ids, None) is ids
    assert is_chat(CHAT) and not is_chat("text") and not is_chat([1, 2])
    assert token_prompts(["hi there", CHAT, [7, 8]], codec) == [codec.encode("hi there"), codec.chat_ids(CHAT), [7, 8]]
    with pytest.raises(ValueError, match="tokenizer"):
        token_prompts(["hi"], None)


def test_engine_takes_text_and_chat_prompts(tmp_path, codec, one_torch_thread):
    from rollout import RolloutEngine

    model = save_tiny_chat_model(tmp_path / "m")
    engine = RolloutEngine(str(model), engine_config())
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    by_text = engine.generate(["The sky is", CHAT], n=1, sampling=greedy)
    by_ids = engine.generate([codec.encode("The sky is"), codec.chat_ids(CHAT)], n=1, sampling=greedy)
    assert [r.completion_ids for r in by_text] == [r.completion_ids for r in by_ids]
    assert [r.prompt_ids for r in by_text] == [r.prompt_ids for r in by_ids]
    assert [r.text for r in by_text] == [codec.decode(r.completion_ids) for r in by_text]
    streamed = sorted((r for r in engine.stream(["The sky is"], sampling=greedy) if hasattr(r, "text")),
                      key=lambda r: r.sample_index)
    assert streamed[0].text == by_text[0].text
    engine.close()


def test_text_past_the_context_is_refused_before_the_tokenizer_sees_it(codec):
    bounded = TextCodec(CountingTokenizer(codec.tokenizer), max_tokens=512)
    fits = "The sky is blue. " * 100  # ~500 tokens: under any bound that is right
    assert bounded.encode(fits) == codec.encode(fits) and bounded.tokenizer.calls == 1
    with pytest.raises(PromptTooLongError, match="longer than the model's context of 512 tokens"):
        bounded.encode("a " * 2_000_000)
    with pytest.raises(PromptTooLongError):
        bounded.chat_ids([{"role": "user", "content": "b" * 2_000_000}])
    assert bounded.tokenizer.calls == 1  # neither reached the tokenizer
    too_long = "x" * (2 * 512 * bounded.longest_token_chars + 1)
    assert len(codec.encode(too_long)) > 512  # the bound never refuses what would fit
    assert TextCodec(codec.tokenizer).encode("a " * 100_000)  # no bound: the tokenizer decides


class CountingTokenizer:
    """The real tokenizer, counting how often it is asked to tokenize."""

    def __init__(self, tokenizer) -> None:
        self.inner, self.calls = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_render_fields_generation_prompt_continue_and_template_kwargs(codec):
    partial = [*CHAT, {"role": "assistant", "content": "It is"}]
    assert not codec.render(CHAT, add_generation_prompt=False).endswith("<|im_start|>assistant\n")
    continued = codec.render(partial, add_generation_prompt=False, continue_final_message=True)
    assert continued.endswith("<|im_start|>assistant\nIt is")  # the reply left open, no end of turn
    with pytest.raises(ChatTemplateError, match="both"):
        codec.render(partial, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="tools"):
        codec.render(CHAT, template_kwargs={"tools": []})
    import copy

    flavoured = TextCodec(copy.deepcopy(codec.tokenizer))
    flavoured.tokenizer.chat_template = "{{ flavour }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert flavoured.render(CHAT, template_kwargs={"flavour": "salty:"}) == "salty:You are terse.Weather in Paris?"


def test_sessions_continue_only_with_their_template_kwargs_and_skip_other_renders(codec):
    from rollout.http.core.sessions import Render

    store = SessionStore()
    kwargs = Render(template_kwargs={"enable_thinking": False})
    prompt, _ = store.prompt_ids(codec, "s", CHAT, None, kwargs)
    sampled = codec.encode(" Sunny", add_special_tokens=False)
    store.record("s", CHAT, None, prompt, [Reply(" Sunny", sampled)], kwargs)
    turn2 = [*CHAT, {"role": "assistant", "content": " Sunny"}, {"role": "user", "content": "Thanks"}]
    assert store.prompt_ids(codec, "s", turn2, None, kwargs)[1] is True
    assert store.prompt_ids(codec, "s", turn2, None)[1] is False  # other kwargs: started over
    open_reply = [*CHAT, {"role": "assistant", "content": "It is"}]
    left_open = Render(add_generation_prompt=False, continue_final_message=True)
    ids, continued = store.prompt_ids(codec, "s", open_reply, None, left_open)
    assert not continued and codec.decode(ids, skip_special_tokens=False).endswith("assistant\nIt is")
    store.record("s", open_reply, None, ids, [Reply(" sunny", [5])], left_open)  # not recorded: no next turn here
    assert store.get("s").messages == CHAT
