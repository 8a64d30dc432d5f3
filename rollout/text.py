"""TextCodec: a model directory's HF tokenizer and chat template, for the text front ends.

The engine is token-in, token-out; text lives here, outside it. Three rules keep RL honest:

* a completion's text is decoded from the ids that were sampled, never the other way round: the
  ids are what a trainer trains on, the text is only what a reader sees;
* a chat prompt is the template rendered to text, then encoded without added special tokens (the
  template writes its own), as `apply_chat_template(..., tokenize=True)` does;
* a conversation that goes on (`continuation_ids`) is extended, never re-tokenized: turn k+1's
  prompt is turn k's prompt ids + the ids sampled in turn k + the tokens of only what the
  template adds after them (the closing of the assistant message, the new messages, the
  generation prompt). Re-tokenizing the whole history would turn sampled ids into different ids
  whenever the text they spell tokenizes another way (" hel" + "lo" -> " hello").

A codec may carry a token limit (`max_tokens`, an HTTP front's context length): text that cannot
tokenize to that few tokens is refused before the tokenizer sees it (`PromptTooLongError`), so a
4 MB prompt costs a length check, not seconds of tokenizing and hundreds of MB never returned.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Optional, Union

Message = Mapping[str, Any]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, a bad role, a template error)."""


class PromptTooLongError(ValueError):
    """A text too long to be a prompt of this codec's `max_tokens`, seen before tokenizing it."""


class TokenizerUnavailableError(ValueError):
    """Text asked of a codec without a tokenizer (a front started with `--skip-tokenizer-init`)."""


class TextCodec:
    """Encode, decode and render chat for one model. Thread-safe for reads (HF fast tokenizers)."""

    has_text = True  # a tokenizer behind it (see TokenOnlyCodec)

    def __init__(self, tokenizer: Any, name: str = "", max_tokens: Optional[int] = None) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.max_tokens = max_tokens
        eos = tokenizer.eos_token_id
        self.eos_token_ids = frozenset([] if eos is None else [int(eos)])
        self.eos_text = tokenizer.eos_token or ""
        self.vocab_size = len(tokenizer)

    @classmethod
    def load(cls, source: Union[str, os.PathLike, TextCodec, Any]) -> TextCodec:
        """A codec from a model directory, a codec (returned as is), or an HF tokenizer object."""
        if isinstance(source, TextCodec):
            return source
        if isinstance(source, (str, os.PathLike)):
            from transformers import AutoTokenizer

            path = Path(source)
            if not has_tokenizer(path):
                raise FileNotFoundError(f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
            return cls(AutoTokenizer.from_pretrained(path), name=path.name)
        if hasattr(source, "encode") and hasattr(source, "decode"):
            return cls(source, name=getattr(source, "name_or_path", ""))
        raise TypeError(f"a tokenizer source is a model directory, a TextCodec or an HF tokenizer, "
                        f"got {type(source).__name__}")

    # ---- text ----------------------------------------------------------------------------------

    @cached_property
    def longest_token_chars(self) -> int:
        """The most characters of text one token can stand for: a vocabulary entry's length (a
        byte-level entry spells one byte per character, a text character is at least one byte;
        a sentencepiece entry spells its text, byte-fallback entries spell more than their byte)."""
        return max((len(entry) for entry in self.tokenizer.get_vocab()), default=1)

    def check_length(self, text: str) -> None:
        """Refuse text that cannot fit `max_tokens` tokens, without tokenizing it. NOTE: twice the
        bound, for a normalizer that drops characters before the tokens are cut."""
        if self.max_tokens is not None and len(text) > 2 * self.max_tokens * self.longest_token_chars:
            raise PromptTooLongError(f"a prompt of {len(text):,} characters is longer than the model's context of "
                                     f"{self.max_tokens} tokens can hold (no token here spells more than "
                                     f"{self.longest_token_chars} characters)")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.check_length(text)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (special tokens included), as OpenAI's log-probs show them."""
        return [self.tokenizer.decode([int(t)], skip_special_tokens=False) for t in ids]

    # ---- chat ----------------------------------------------------------------------------------

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
               tools: Optional[list[dict]] = None, continue_final_message: bool = False,
               template_kwargs: Optional[Mapping[str, Any]] = None) -> str:
        """The chat template's text; `continue_final_message`: the last message left open (its
        end-of-turn cut) for the model to go on; `template_kwargs`: extra template variables."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError(f"the tokenizer of {self.name or 'this model'} has no chat template")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
        extra = dict(template_kwargs or {})
        clash = sorted(set(extra) & {"conversation", "tools", "tokenize", "add_generation_prompt",
                                     "continue_final_message", "messages"})
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(clash)}")
        try:
            return self.tokenizer.apply_chat_template([dict(m) for m in messages], tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, **extra)
        except Exception as exc:  # noqa: BLE001 (jinja raises anything: the messages are at fault)
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from exc

    def chat_ids(self, messages: Sequence[Message], *, tools: Optional[list[dict]] = None,
                 add_generation_prompt: bool = True, continue_final_message: bool = False,
                 template_kwargs: Optional[Mapping[str, Any]] = None) -> list[int]:
        """The prompt ids of a conversation, ending with the generation prompt (by default)."""
        text = self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, template_kwargs=template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def continuation_ids(self, history: Sequence[Message], prompt_ids: Sequence[int], sampled_ids: Sequence[int],
                         reply: Message, new: Sequence[Message], *, tools: Optional[list[dict]] = None,
                         template_kwargs: Optional[Mapping[str, Any]] = None,
                         reply_text: Optional[str] = None) -> Optional[list[int]]:
        """Turn k+1's prompt: `prompt_ids` (turn k's, for `history`) + `sampled_ids` (the reply's
        ids, verbatim) + the tokens of the template's text after the reply. None when the
        template is not incremental (rendering the longer conversation changes earlier text),
        or does not render `reply` as `reply_text` (the text of `sampled_ids`; default the
        message's content: a reply with tool calls is rendered from them), so the caller must
        start over from `chat_ids`.
        """
        kw = {"tools": tools, "template_kwargs": template_kwargs}
        before = self.render(history, **kw)
        with_reply = self.render([*history, reply], add_generation_prompt=False, **kw)
        full = self.render([*history, reply, *new], **kw)
        content = message_text(reply) if reply_text is None else reply_text
        if not with_reply.startswith(before + content) or not full.startswith(with_reply):
            return None
        closing = with_reply[len(before) + len(content):]
        # NOTE: a reply that ended on EOS already holds the template's end-of-turn token
        if sampled_ids and int(sampled_ids[-1]) in self.eos_token_ids and self.eos_text \
                and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]
        suffix = closing + full[len(with_reply):]
        return [*map(int, prompt_ids), *map(int, sampled_ids), *self.encode(suffix, add_special_tokens=False)]


class TokenOnlyCodec(TextCodec):
    """What a front knows of a model without its tokenizer, as vLLM's `--skip-tokenizer-init`
    serves: token ids in and out. The vocabulary size and EOS come from the model's config.json;
    a completion's text is empty (nothing decodes it), a log-prob's token is `token_id:N`, and
    anything that needs text in (a text or chat prompt, stop strings, bad words, tokenize) is
    refused with `TokenizerUnavailableError`, a 400 over HTTP."""

    has_text = False

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = (), name: str = "",
                 max_tokens: Optional[int] = None) -> None:
        if vocab_size < 1:
            raise ValueError(f"TokenOnlyCodec.vocab_size must be >= 1, got {vocab_size}")
        self.tokenizer = None
        self.name, self.max_tokens, self.vocab_size = name, max_tokens, int(vocab_size)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.eos_text = ""

    @classmethod
    def from_config(cls, model_dir: Union[str, os.PathLike]) -> TokenOnlyCodec:
        """From `model_dir/config.json` (`vocab_size`; `eos_token_id`, one id or a list)."""
        import json

        path = Path(model_dir)
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise FileNotFoundError(f"{path}: no readable config.json for a token-only front ({exc})") from None
        if not isinstance(config.get("vocab_size"), int):
            raise ValueError(f"{path / 'config.json'}: no integer vocab_size")
        eos = config.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(config["vocab_size"], eos, name=path.name)

    def refuse(self, what: str) -> TokenizerUnavailableError:
        return TokenizerUnavailableError(f"{what} needs a tokenizer, and this server was started without one "
                                         "(--skip-tokenizer-init): send token ids")

    @cached_property
    def longest_token_chars(self) -> int:
        raise self.refuse("text")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise self.refuse("a text prompt")

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return ""

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return [f"token_id:{int(t)}" for t in ids]

    def render(self, messages: Sequence[Message], **_: Any) -> str:
        raise self.refuse("a chat prompt")


def has_tokenizer(path: Union[str, os.PathLike]) -> bool:
    path = Path(path)
    return path.is_dir() and any((path / f).is_file() for f in TOKENIZER_FILES)


def message_text(message: Message) -> str:
    """A message's content as one string (OpenAI allows a list of text parts, or None)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and len(prompt) > 0 \
        and all(isinstance(m, Mapping) for m in prompt)


def prompt_ids(prompt: Any, codec: Optional[TextCodec]) -> list[int]:
    """One prompt as token ids: ids as given, a string encoded, a chat rendered and encoded."""
    if isinstance(prompt, str) or is_chat(prompt):
        if codec is None:
            raise ValueError("a text or chat prompt needs a tokenizer (pass tokenizer=... : a model directory "
                             "or an HF tokenizer)")
        return codec.encode(prompt) if isinstance(prompt, str) else codec.chat_ids(prompt)
    return list(prompt)


def needs_codec(prompts: Any) -> bool:
    """Whether any of `prompts` is text or chat (a sequence of prompts is checked, not its type)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a sequence of prompts (token ids, strings or chat message lists), "
                         f"got {type(prompts).__name__}")
    return any(isinstance(p, str) or is_chat(p) for p in prompts)


def token_prompts(prompts: Any, codec: Optional[TextCodec]) -> Any:
    """`prompts` as token-id prompts (returned as they are when none is text or chat)."""
    if not needs_codec(prompts):
        return prompts
    return [prompt_ids(p, codec) for p in prompts]


def add_text(rollouts: Sequence[Any], codec: Optional[TextCodec]) -> None:
    """Set each rollout's `text` from its completion ids (nothing without a codec)."""
    if codec is not None:
        for r in rollouts:
            r.text = codec.decode(r.completion_ids)
