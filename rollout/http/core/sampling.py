"""A completions or chat body's sampling fields as the engine's `SamplingParams`.

OpenAI's and vLLM's names map one to one onto the engine's, with these translations:

* `logit_bias`: OpenAI's keys are token ids as strings; each must name a token of the vocabulary.
* `bad_words`: strings, each tokenized twice as vLLM does: as written (its leading spaces cut),
  and after one space, the second kept only when that space makes a different first token and the
  same number of tokens (a word inside text, not at its start); each becomes one banned sequence
  of `bad_words_token_ids`.
* `structured`: the body's output constraint, built by `rollout.http.core.structured`.
* `logprobs` / `prompt_logprobs` above the server's `max_logprobs` are refused in vLLM's words;
  `logprobs_mode` unset takes the server's (`--logprobs-mode`).
* A field at its neutral value is not passed on, so an engine without that field still serves
  a request that does not use it; a non-neutral one the engine does not know is a 400 naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from inference import LogprobsMode, SamplingParams, StructuredOutputs
from rollout.http.core.errors import APIError, engine_param
from rollout.http.core.schemas import MAX_TOP_LOGPROBS
from rollout.text import TextCodec

# body field -> (the engine's field, its neutral value)
EXTRAS = {"repetition_penalty": ("repetition_penalty", 1.0), "presence_penalty": ("presence_penalty", 0.0),
          "frequency_penalty": ("frequency_penalty", 0.0), "min_tokens": ("min_tokens", 0),
          "cache_salt": ("cache_salt", None), "prefix_cache_policy": ("prefix_cache_policy", None)}


# the fields a model's generation_config.json gives defaults for (vLLM's `--generation-config auto`)
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# generation_config.json's name -> the request field it is the default of
RENAMED = {"max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: Any) -> dict[str, float]:
    """`DEFAULTABLE`'s values in `model_dir`'s generation_config.json (none without the file), and its
    `max_new_tokens` as `max_tokens`: the defaults of requests that leave those fields unset, as vLLM
    applies them (`max_tokens`: `HttpFront.completion_budget`)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    out = {name: config[name] for name in DEFAULTABLE if isinstance(config.get(name), (int, float))}
    for name, field in RENAMED.items():
        if isinstance(config.get(name), int) and config[name] > 0:
            out[field] = config[name]
    return out


def check_logprobs(logprobs: Optional[int], prompt_logprobs: Optional[int], max_logprobs: int) -> None:
    """vLLM's refusal of a top-n count above the server's `--max-logprobs`."""
    for what, count, param in (("sample", logprobs, "logprobs"), ("prompt", prompt_logprobs, "prompt_logprobs")):
        if count is not None and count > max_logprobs:
            raise APIError(400, f"Requested {what} logprobs of {count}, which is greater than max allowed: "
                                f"{max_logprobs}", param=param)


# a body's (and the server's) `logprobs_mode`: vLLM's names, its `*_logprobs` spellings too
LOGPROBS_MODES = {"raw": LogprobsMode.RAW, "raw_logprobs": LogprobsMode.RAW,
                  "processed": LogprobsMode.PROCESSED, "processed_logprobs": LogprobsMode.PROCESSED}


def sampling_params(codec: TextCodec, body: Any, *, n: int, max_tokens: int, logprobs: Optional[int],
                    prompt_logprobs: Optional[int] = None, structured: Optional[StructuredOutputs] = None,
                    defaults: Optional[dict[str, float]] = None, max_logprobs: int = MAX_TOP_LOGPROBS,
                    logprobs_mode: LogprobsMode = LogprobsMode.RAW) -> SamplingParams:
    """`defaults`: values for `DEFAULTABLE` fields the body leaves unset (`generation_defaults`);
    `max_logprobs`: the largest top-n count served; `logprobs_mode`: the mode of a body that names
    none (raw or processed)."""
    check_logprobs(logprobs, prompt_logprobs, max_logprobs)
    unset = defaults or {}

    def field(name: str, neutral: Any) -> Any:
        value = getattr(body, name, None)
        return value if value is not None else unset.get(name, neutral)

    fields: dict[str, Any] = dict(
        n=n, max_tokens=max_tokens, temperature=field("temperature", 1.0), top_p=field("top_p", 1.0),
        top_k=field("top_k", 0) or 0, min_p=field("min_p", 0.0), seed=body.seed,
        stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos, logprobs=logprobs or None,
        prompt_logprobs=prompt_logprobs)
    for name, (engine_name, neutral) in EXTRAS.items():
        value = getattr(body, name, None)  # NOTE: a body without the field (SGLang's, vLLM's) leaves it neutral
        value = unset.get(name) if value is None else value
        if value is not None and value != neutral:
            fields[engine_name] = value
    mode = logprobs_mode if getattr(body, "logprobs_mode", None) is None else LOGPROBS_MODES[body.logprobs_mode]
    if mode is not LogprobsMode.RAW:
        fields["logprobs_mode"] = mode
    if body.logit_bias:
        fields["logit_bias"] = logit_bias(codec, body.logit_bias)
    if body.bad_words:
        fields["bad_words_token_ids"] = bad_words_token_ids(codec, body.bad_words)
    if body.allowed_token_ids is not None:
        bad = next((t for t in body.allowed_token_ids if t >= codec.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"allowed_token_ids holds token id {bad}, out of vocabulary (size "
                                f"{codec.vocab_size}).", param="allowed_token_ids")
        fields["allowed_token_ids"] = list(body.allowed_token_ids)
    if structured is not None:
        fields["structured_outputs"] = structured
    try:
        return SamplingParams(**fields)
    except TypeError as exc:  # NOTE: an engine without one of the extra fields
        unknown = next((f for f in fields if f in str(exc)), None)
        raise APIError(400, f"{unknown} is not supported by this engine", param=unknown) from exc
    except ValueError as exc:  # the engine's messages start with the field's name
        raise APIError(400, str(exc), param=engine_param(str(exc))) from exc


def logit_bias(codec: TextCodec, bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias") from None
        if not 0 <= token < codec.vocab_size:
            raise APIError(400, f"logit_bias names token id {token}, out of vocabulary (size {codec.vocab_size}).",
                           param="logit_bias")
        out[token] = float(value)
    return out


def bad_words_token_ids(codec: TextCodec, words: list[str]) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        bare = codec.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise APIError(400, f"bad_words holds {word!r}, which tokenizes to nothing.", param="bad_words")
        out.append(bare)
        spaced = codec.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out
