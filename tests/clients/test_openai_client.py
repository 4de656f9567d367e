"""The real ``openai`` Python client against the server: completions and chat, streamed or not,
``n``, logprobs, ``response_format``, usage, and the explicit ``None`` parameters that wrappers
around it pass through (the client sends a parameter given as ``None`` as JSON ``null``; it sends
nothing it was not given, with ``Authorization: Bearer <key>`` and its ``x-stainless-*`` headers).
"""
import json

import openai
import pytest

from .conftest import Wire, text

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def client(wire: Wire) -> openai.OpenAI:
    return openai.OpenAI(base_url=wire.url + "/v1", api_key="EMPTY", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    listed = client.models.list()
    assert len(listed.data) == 1
    assert client.models.retrieve(listed.data[0].id).id == listed.data[0].id
    return listed.data[0].id


def test_completions_streamed_equals_not_streamed_and_counts_tokens(client: openai.OpenAI, model: str,
                                                                     wire: Wire) -> None:
    prompt = text(300, 80)
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.object == "text_completion" and whole.model == model
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].index == 0
    assert whole.usage.prompt_tokens == wire.count(prompt) and whole.usage.completion_tokens == MAX_TOKENS
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + MAX_TOKENS
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_logprobs_are_the_greedy_choice(client: openai.OpenAI, model: str) -> None:
    done = client.completions.create(model=model, prompt=text(301, 60), max_tokens=MAX_TOKENS, temperature=0,
                                     logprobs=3, extra_body={"ignore_eos": True})
    logprobs = done.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == MAX_TOKENS
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        # keyed by token text: tokens sharing a text share an entry, the sampled token is always there
        assert 1 <= len(top) <= 4 and token in top and logprob <= 0
        assert logprob >= max(top.values()) - 1e-5  # greedy: the sampled token is the most likely


def test_chat_n_logprobs_and_stream(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text(302, 50)}]
    sampled = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, n=2,
                                             temperature=0.9, seed=4, logprobs=True, top_logprobs=2)
    assert sampled.object == "chat.completion" and [c.index for c in sampled.choices] == [0, 1]
    for choice in sampled.choices:
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        entries = choice.logprobs.content
        assert 1 <= len(entries) <= MAX_TOKENS and all(len(e.top_logprobs) == 2 for e in entries)
        assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries)
    assert sampled.usage.completion_tokens == sum(len(c.logprobs.content) for c in sampled.choices)
    greedy = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=True, top_logprobs=2)
    for entry in greedy.choices[0].logprobs.content:
        assert entry.logprob >= entry.top_logprobs[0].logprob - 1e-5
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == greedy.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == greedy.choices[0].finish_reason


def test_response_format(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "answer in json"}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           response_format={"type": "text"})
    free = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert plain.choices[0].message.content == free.choices[0].message.content  # "text" is the default
    shaped = client.chat.completions.create(model=model, messages=messages, max_tokens=80, seed=2,
                                            response_format={"type": "json_object"})
    if shaped.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(shaped.choices[0].message.content), dict)


def test_parameters_given_as_none_are_sent_as_null_and_accepted(client: openai.OpenAI, model: str) -> None:
    """Wrappers pass every optional parameter, unset ones as None; the client sends them as null."""
    messages = [{"role": "user", "content": text(303, 40)}]
    bare = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    nulls = client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, top_p=None, n=None, stop=None,
        seed=None, user=None, tools=None, tool_choice=None, parallel_tool_calls=None, reasoning_effort=None,
        logit_bias=None, logprobs=None, top_logprobs=None, presence_penalty=None, frequency_penalty=None,
        response_format=None, metadata=None, store=None, service_tier=None, stream_options=None)
    assert nulls.choices[0].message.content == bare.choices[0].message.content
    prompt = text(304, 40)
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    completed = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          suffix=None, echo=False, best_of=1, user="abc", logprobs=None, stop=None)
    assert completed.choices[0].text == plain.choices[0].text
    assert completed.usage.prompt_tokens == plain.usage.prompt_tokens
