"""Request and response messages of the HTTP surface, validated into typed dataclasses.

Every check raises ``InvalidRequest`` with a message naming the field, which the app turns into
a 400; nothing here touches the engine.
"""
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequest
from ..sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One validated generation: a text prompt (separators mark PIC segments) or token ids."""

    prompt: str | list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    return_logprob: bool = False


@dataclass
class Completion:
    """What a finished request reports; the app shapes it for each API."""

    rid: str
    text: str
    output_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: int | str | None
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    prefix_hit_tokens: int
    segments_hit: int
    segments_missed: int
    combine_tokens: int
    ttft_s: float
    e2e_s: float
    mode: str
    output_logprobs: list[float] = field(default_factory=list)


def _typed(body: dict, name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise InvalidRequest(f"'{name}' must be {what}, got {value!r}")
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) and s for s in value):
        return tuple(value)
    raise InvalidRequest(f"'stop' must be a non-empty string or a list of them, got {value!r}")


def _token_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequest(f"'{name}' must be a list of integers, got {value!r}")
    return value


def sampling_params(body: dict, max_tokens_field: str, default_max_tokens: int) -> SamplingParams:
    """SamplingParams from the fields of ``body`` (SGLang's sampling_params or an OpenAI body)."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"sampling parameters must be a JSON object, got {body!r}")
    seed = _typed(body, "seed", (int,), None, "an integer")
    return SamplingParams(
        max_new_tokens=_typed(body, max_tokens_field, (int,), default_max_tokens, "an integer >= 0"),
        temperature=_typed(body, "temperature", (int, float), 1.0, "a number >= 0"),
        top_p=_typed(body, "top_p", (int, float), 1.0, "a number in (0, 1]"),
        top_k=_typed(body, "top_k", (int,), -1, "an integer"),
        stop_token_ids=tuple(_token_list(body.get("stop_token_ids") or [], "stop_token_ids")),
        ignore_eos=_typed(body, "ignore_eos", (bool,), False, "a boolean"),
        seed=seed,
    )


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_generate(body: Any) -> GenerationRequest:
    """SGLang-native ``/generate``: exactly one of ``text`` and ``input_ids``."""
    body = _object(body)
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise InvalidRequest("give exactly one of 'text' and 'input_ids'" if has_text else "missing prompt: give 'text' or 'input_ids'")
    if has_text and not isinstance(body["text"], str):
        raise InvalidRequest(f"'text' must be a string, got {type(body['text']).__name__} (batched prompts are not supported)")
    prompt = body["text"] if has_text else _token_list(body["input_ids"], "input_ids")
    params_body = body.get("sampling_params") or {}
    params = sampling_params(params_body, "max_new_tokens", 128)
    return GenerationRequest(prompt, params, _stop_strings(params_body.get("stop")),
                             _typed(body, "stream", (bool,), False, "a boolean"),
                             _typed(body, "return_logprob", (bool,), False, "a boolean"))


def _openai_common(body: dict, prompt: str | list[int]) -> GenerationRequest:
    if _typed(body, "n", (int,), 1, "an integer") != 1:
        raise InvalidRequest("only 'n' = 1 is supported")
    params = sampling_params(body, "max_tokens", 16)
    if body.get("max_completion_tokens") is not None:
        params = sampling_params({**body, "max_tokens": body["max_completion_tokens"]}, "max_tokens", 16)
    return GenerationRequest(prompt, params, _stop_strings(body.get("stop")), _typed(body, "stream", (bool,), False, "a boolean"))


def parse_completion(body: Any) -> GenerationRequest:
    """OpenAI ``/v1/completions``: ``prompt`` is a string, a one-element list of strings, or token ids."""
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return _openai_common(body, prompt)
    if not isinstance(prompt, str):
        raise InvalidRequest("missing prompt: 'prompt' must be a string (or one string in a list, or token ids)")
    return _openai_common(body, prompt)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def parse_chat_messages(body: Any) -> tuple[list[ChatMessage], dict]:
    """OpenAI ``/v1/chat/completions`` messages; content may be a string or a list of text parts."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{index}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise InvalidRequest(f"messages[{index}].content parts must be text parts")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{index}].content must be a string")
        parsed.append(ChatMessage(message["role"], content))
    return parsed, body


def parse_chat(body: Any, render: Callable[[list["ChatMessage"]], str]) -> GenerationRequest:
    """Messages rendered to one prompt by ``render`` (the model's chat template)."""
    messages, body = parse_chat_messages(body)
    return _openai_common(body, render(messages))


def parse_warmup(body: Any) -> list[str]:
    """``/warmup``: ``{"documents": [str, ...]}``."""
    documents = _object(body).get("documents")
    if not isinstance(documents, list) or not documents or not all(isinstance(d, str) for d in documents):
        raise InvalidRequest("'documents' must be a non-empty list of strings")
    return documents
