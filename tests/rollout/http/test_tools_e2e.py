"""Tool calls end to end: a real `rollout serve --http --tool-call-parser hermes` process driven by
the official `openai` client.

The tiny Llama (SmolLM2's tokenizer) gets a Qwen2.5-style chat template (tools in the system
prompt, `<tool_call>` blocks, `tool` messages as `<tool_response>`), and is trained here for a few
hundred steps (CPU, fixed seed, ~3 s) to answer the weather question with one known call, then EOS:
greedy decoding reproduces it, so nothing is mocked.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from rollout.text import TextCodec
from tests.rollout.http_util import MODEL, WAIT_S, http_server_process, save_tiny_chat_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TRAIN_STEPS = 200  # 120 already reproduce the call; the loss check below says if not

QWEN_STYLE_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
{{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' }}
{{- '\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role in ['user', 'system'] or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.content %}{{- message.content + '\n' }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}
{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""".strip()


def write_template(directory: Path) -> None:
    (directory / "chat_template.jinja").write_text(QWEN_STYLE_TEMPLATE)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)  # NOTE: chat_template.jinja is the one template
    config_path.write_text(json.dumps(config, indent=2))


def train_to_call(directory: Path, steps: int = TRAIN_STEPS) -> None:
    """Teach the model to answer QUESTION (with TOOLS) by CALL then EOS; loss on those tokens only,
    logits only where the loss is (the 49,152-way head is the cost)."""
    import torch
    from transformers import LlamaForCausalLM

    codec = TextCodec.load(directory)
    prompt = codec.chat_ids(QUESTION, tools=TOOLS)
    target = codec.encode(CALL, add_special_tokens=False) + sorted(codec.eos_token_ids)
    ids = torch.tensor([prompt + target[:-1]])
    labels = torch.tensor(target)
    where = slice(len(prompt) - 1, None)
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        hidden = model.model(input_ids=ids).last_hidden_state[0, where]
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05, f"the tiny model did not learn the call (loss {loss.item():.3f})"
    model.eval().save_pretrained(directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-tools"))
    write_template(directory)
    train_to_call(directory)
    return directory


@pytest.fixture(scope="module")
def http_server(model_dir):
    with http_server_process(model_dir, "--tool-call-parser", "hermes") as proc:
        yield proc


@pytest.fixture
def oai(http_server):
    with openai.OpenAI(base_url=f"{http_server.http_url}/v1", api_key="unused", timeout=WAIT_S,
                       max_retries=0) as c:
        yield c


def ask(oai, **kwargs):
    return oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=48,
                                       **kwargs)


def test_auto_parses_the_call(oai):
    reply = ask(oai)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert ask(oai, tool_choice="auto").choices[0].message.tool_calls[0].function == call.function


def test_streamed_call_matches(oai):
    whole = ask(oai).choices[0]
    with oai.chat.completions.stream(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0,
                                     max_tokens=48) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert not final.message.content
    assert [(c.function.name, c.function.arguments, c.type) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments, c.type) for c in whole.message.tool_calls]


def test_streamed_chunks_shape(http_server):
    """OpenAI's streaming shape on the wire: content never shows the tag; the call's delta carries
    index, id, type, name and arguments; the last chunk says `tool_calls`."""
    body = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "temperature": 0, "max_tokens": 48,
            "stream": True}
    with httpx.Client(timeout=WAIT_S) as web:
        lines = web.post(f"{http_server.http_url}/v1/chat/completions", json=body).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    [call] = [t for d in deltas for t in d.get("tool_calls", [])]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"


def test_tool_choice_none_is_text(oai):
    choice = ask(oai, tool_choice="none").choices[0]
    assert choice.message.content == CALL  # the tools were in the prompt (as vLLM renders them): same reply
    assert not choice.message.tool_calls
    assert choice.finish_reason == "stop"


FORCED_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now."}}]
ARGUMENTS = {name: t["function"].get("parameters", {"type": "object", "properties": {}})
             for name, t in ((t["function"]["name"], t) for t in FORCED_TOOLS)}


def forced(oai, tool_choice, **kwargs):
    return oai.chat.completions.create(model=MODEL, messages=QUESTION, tools=FORCED_TOOLS, tool_choice=tool_choice,
                                       temperature=0, max_tokens=48, **kwargs)


def test_named_tool_choice_forces_that_call(oai):
    """vLLM's answer: the grammar writes the function's arguments; content "", finish "stop"."""
    import jsonschema

    choice = forced(oai, {"type": "function", "function": {"name": "get_weather"}}).choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), ARGUMENTS["get_weather"])
    assert choice.message.content == "" and choice.finish_reason == "stop"
    time_call = forced(oai, {"type": "function", "function": {"name": "get_time"}}).choices[0].message.tool_calls
    assert [c.function.name for c in time_call] == ["get_time"] and json.loads(time_call[0].function.arguments) == {}


def test_required_tool_choice_forces_some_call(oai):
    """One call (`parallel_tool_calls` false) of one of the tools; without the bound this model
    repeats its call until `max_tokens`, and a reply cut short among several tools names no call:
    a 400 with the cause, as vLLM's (never text, never a half-parsed call)."""
    import jsonschema

    choice = forced(oai, "required", parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    [call] = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), ARGUMENTS[call.function.name])
    try:
        free = forced(oai, "required").choices[0]
    except openai.BadRequestError as err:
        assert "names no call" in err.message and err.body["param"] == "tool_choice"
    else:
        assert free.finish_reason == "tool_calls"
        for call in free.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), ARGUMENTS[call.function.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_stream_as_whole_calls(oai, tool_choice):
    whole = forced(oai, tool_choice, parallel_tool_calls=False).choices[0]
    assert whole.message.tool_calls
    with oai.chat.completions.stream(model=MODEL, messages=QUESTION, tools=FORCED_TOOLS, tool_choice=tool_choice,
                                     temperature=0, max_tokens=48, parallel_tool_calls=False) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_forcing_a_call_and_a_response_format_is_refused(oai):
    with pytest.raises(openai.BadRequestError) as err:
        forced(oai, "required", response_format={"type": "json_object"})
    assert err.value.body["param"] == "tool_choice"


def test_follow_up_turn_renders(oai, model_dir):
    """The assistant's calls and the tool's answer go back through the template (OpenAI's shapes)."""
    call = ask(oai).choices[0].message.tool_calls[0]
    turn = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "temp_c": 21})}]
    reply = oai.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, temperature=0, max_tokens=4)
    prompt = TextCodec.load(model_dir).decode(reply.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.endswith(f"<|im_start|>assistant\n{CALL}<|im_end|>\n<|im_start|>user\n<tool_response>\n"
                           '{"city": "Paris", "temp_c": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n')


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_continues_through_a_tool_call(oai, http_server, stream):
    """Agentic RL's loop: the call goes back with the tool's answer in the same session, and the
    next prompt is the first prompt + the ids sampled for the call, verbatim + the template's rest
    (the template renders the call exactly as the model wrote it: nothing re-tokenized)."""
    session = {"X-Session-ID": f"agent-{stream}"}
    first = ask(oai, extra_headers=session)
    if stream:  # the same reply, streamed: the session must remember it just the same
        with oai.chat.completions.stream(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0,
                                         max_tokens=48, extra_headers=session) as s:
            for _ in s:
                pass
            assert s.get_final_completion().choices[0].message.tool_calls
    call = first.choices[0].message.tool_calls[0]
    turn = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "temp_c": 21})}]
    with httpx.Client(timeout=WAIT_S) as web:
        before = web.get(f"{http_server.http_url}/get_server_info").json()["sessions"]
        second = oai.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, temperature=0, max_tokens=4,
                                             extra_headers=session)
        after = web.get(f"{http_server.http_url}/get_server_info").json()["sessions"]
    assert after["continued"] == before["continued"] + 1 and after["restarted"] == before["restarted"]
    head = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    assert second.model_extra["prompt_token_ids"][:len(head)] == head
