"""A field the server does not serve is judged by its value (``hypic/server/fields.py``): a neutral value (null,
false, "", [], {}, the documented default) asks for nothing and is accepted; a value that asks for
behaviour is a 400 whose message names the field. Representative fields, mostly the ones real
clients send with every request (SGLang's bench_serving, bench_multiturn and cache-hit kit:
``lora_path`` null or "", ``return_routed_experts`` false, ``stream_options``; OpenAI-style
wrappers: ``tools`` [], ``tool_choice`` "none", ``reasoning_effort`` null, ``user``)."""
from typing import Any

import pytest

from .conftest import Wire, refused, text

PROMPT = text(400, 30)


def _generate(**fields: Any) -> dict[str, Any]:
    return {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, **fields}


def _chat(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "temperature": 0,
            **fields}


def _completion(model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **fields}


GENERATE_NEUTRAL = [
    {"lora_path": None}, {"lora_path": ""}, {"return_hidden_states": False}, {"return_routed_experts": False},
    {"stream_options": {"include_usage": True}}, {"image_data": None}, {"custom_logit_processor": None},
    {"session_params": None}, {"bootstrap_host": None}, {"data_parallel_rank": None}, {"priority": 0},
    {"return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0},
]
GENERATE_REFUSED = [
    ("lora_path", "my-adapter"), ("return_hidden_states", True), ("return_routed_experts", True),
    ("image_data", ["data:image/png;base64,AAAA"]), ("session_params", {"id": "s1"}),
    ("frobnicate", 3),  # a field named nowhere, with a value
]


@pytest.mark.parametrize("fields", GENERATE_NEUTRAL, ids=lambda f: ",".join(f"{k}={v!r}" for k, v in f.items()))
def test_generate_accepts_neutral_values(wire: Wire, fields: dict[str, Any]) -> None:
    response = wire.post("/generate", _generate(**fields))
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] <= 2


def test_generate_neutral_fields_change_nothing(wire: Wire) -> None:
    """bench_serving's whole body against the bare request: the same greedy tokens."""
    bare = wire.post("/generate", _generate())
    full = wire.post("/generate", _generate(lora_path=None, return_logprob=False, return_routed_experts=False,
                                            logprob_start_len=-1, frobnicate=None))
    assert bare.status_code == full.status_code == 200, full.text
    assert full.json()["output_ids"] == bare.json()["output_ids"]


@pytest.mark.parametrize("field,value", GENERATE_REFUSED, ids=lambda v: repr(v))
def test_generate_refuses_values_that_ask_for_behaviour(wire: Wire, field: str, value: Any) -> None:
    response = wire.post("/generate", _generate(**{field: value}))
    assert refused(response, field), (response.status_code, response.text)


@pytest.mark.parametrize("fields,refused_field", [
    ({"spaces_between_special_tokens": True, "custom_params": None, "regex": None, "json_schema": None}, None),
    ({"custom_params": {"k": 1}}, "custom_params"),
    ({"stop_regex": "[0-9]+"}, "stop_regex"),
])
def test_sampling_params_are_judged_alike(wire: Wire, fields: dict[str, Any], refused_field: str | None) -> None:
    body = _generate()
    body["sampling_params"] = {**body["sampling_params"], **fields}
    response = wire.post("/generate", body)
    if refused_field is None:
        assert response.status_code == 200, response.text
    else:
        assert refused(response, refused_field), (response.status_code, response.text)


CHAT_NEUTRAL = [
    {"tools": []}, {"tool_choice": "none"}, {"reasoning_effort": None}, {"user": "abc"}, {"tools": None},
    {"parallel_tool_calls": True}, {"chat_template_kwargs": {}}, {"lora_path": None}, {"metadata": {}},
    {"service_tier": "auto"}, {"logprobs": False}, {"stream_options": None},
]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
CHAT_REFUSED = [
    ("tools", [TOOL]), ("tool_choice", "required"), ("reasoning_effort", "high"), ("lora_path", "my-adapter"),
]


@pytest.mark.parametrize("fields", CHAT_NEUTRAL, ids=lambda f: ",".join(f"{k}={v!r}" for k, v in f.items()))
def test_chat_accepts_neutral_values(wire: Wire, fields: dict[str, Any]) -> None:
    response = wire.post("/v1/chat/completions", _chat(wire.model_id(), **fields))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("field,value", CHAT_REFUSED, ids=lambda v: repr(v)[:30])
def test_chat_refuses_values_that_ask_for_behaviour(wire: Wire, field: str, value: Any) -> None:
    response = wire.post("/v1/chat/completions", _chat(wire.model_id(), **{field: value}))
    assert refused(response, field), (response.status_code, response.text)


def test_chat_message_fields_are_judged_alike(wire: Wire) -> None:
    model = wire.model_id()
    neutral = {"role": "assistant", "content": "ok", "tool_calls": [], "refusal": None}
    accepted = wire.post("/v1/chat/completions", {**_chat(model), "messages": [
        {"role": "user", "content": PROMPT}, neutral, {"role": "user", "content": "and?"}]})
    assert accepted.status_code == 200, accepted.text
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    asking = wire.post("/v1/chat/completions", {**_chat(model), "messages": [
        {"role": "user", "content": PROMPT}, {**neutral, "tool_calls": [call]}]})
    assert refused(asking, "tool_calls"), (asking.status_code, asking.text)


@pytest.mark.parametrize("fields,refused_field", [
    ({"suffix": None, "echo": False, "user": "abc", "lora_path": ""}, None),
    ({"suffix": "}"}, "suffix"),
    ({"lora_path": "my-adapter"}, "lora_path"),
])
def test_completions_fields(wire: Wire, fields: dict[str, Any], refused_field: str | None) -> None:
    response = wire.post("/v1/completions", _completion(wire.model_id(), **fields))
    if refused_field is None:
        assert response.status_code == 200, response.text
    else:
        assert refused(response, refused_field), (response.status_code, response.text)


def test_a_refusal_keeps_the_server_serving(wire: Wire) -> None:
    assert wire.post("/generate", _generate(lora_path="my-adapter")).status_code == 400
    assert wire.post("/generate", _generate()).status_code == 200
