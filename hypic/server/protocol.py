"""Request and response messages of the HTTP surface, validated into typed dataclasses.

Every check raises ``InvalidRequest`` with a message naming the field, which the app turns into
a 400; nothing here touches the engine. Each endpoint knows the fields it serves: any other field
is judged by its value (``fields.py``: refused by name when it asks for something).
"""
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..errors import InvalidRequest, as_written
from ..sampling.params import SamplingParams
from ..scheduler.requests import Completion, SampleResult  # noqa: F401 - what the loop reports, at home there
from .fields import check_fields

SGLANG_SAMPLING = {"max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
                   "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "no_stop_trim",
                   "skip_special_tokens", "n", "regex", "json_schema", "ebnf", "logit_bias", "seed", "sampling_seed"}
SALT_FIELDS = {"cache_salt", "extra_key"}  # vLLM's cache salt, SGLang's extra key: both name a cache namespace
MAX_SALT_CHARS = 1024
GENERATE_FIELDS = SALT_FIELDS | {"text", "input_ids", "sampling_params", "stream", "return_logprob", "logprob_start_len",
                                 "top_logprobs_num", "return_text_in_logprobs", "rid",
                                 "stream_options"}  # usage is in every chunk's meta_info: any include_usage is served
OPENAI_COMMON = SALT_FIELDS | {
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "best_of",
    # extensions SGLang and vLLM accept on their OpenAI endpoints
    "top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids", "no_stop_trim",
    "regex", "ebnf", "json_schema", "response_format", "skip_special_tokens", "include_stop_str_in_output"}
COMPLETION_FIELDS = OPENAI_COMMON | {"prompt", "logprobs", "echo"}
CHAT_TEMPLATE_FIELDS = {"add_generation_prompt", "continue_final_message", "chat_template_kwargs"}
CHAT_FIELDS = OPENAI_COMMON | CHAT_TEMPLATE_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}
CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class LogprobRequest:
    """The logprobs a request wants: each output token's and its ``top`` alternatives; input tokens'
    from prompt position ``start`` (-1: only the last prompt token, as SGLang's default)."""

    top: int = 0
    start: int = -1
    with_text: bool = False

    def input_from(self, prompt_length: int) -> int:
        """The first prompt position reported; raises if it is past the prompt."""
        start = prompt_length - 1 if self.start == -1 else self.start
        if not 0 <= start < prompt_length:
            raise InvalidRequest(f"logprob_start_len={self.start} is outside the prompt of {prompt_length} tokens",
                                 param="logprob_start_len")
        return start


@dataclass(frozen=True)
class GenerationRequest:
    """One validated prompt to generate from (a batch is several)."""

    prompt: str | list[int]
    params: SamplingParams
    stream: bool = False
    logprobs: LogprobRequest | None = None
    echo: bool = False  # OpenAI completions: the prompt (and its logprobs) come back before the output
    rid: str | None = None
    to_context: bool = False  # max_new_tokens is the context the prompt leaves (set once it is tokenized)
    salt: tuple[str, ...] = ()  # the cache salt and extra key it named (its cache namespace with the caller's key)
    spelling: tuple[tuple[str, str], ...] = ()  # (SamplingParams field, the client's name for it) where they differ
    warnings: tuple[str, ...] = ()  # how its prompt was read, for the response (``PromptParts.warnings``)

    def in_its_words(self, err: InvalidRequest) -> InvalidRequest:
        """``err`` naming the request's fields as the client spelled them (its ``max_tokens``, not our
        ``max_new_tokens``)."""
        return spelled(err, dict(self.spelling))

    def fitted(self, prompt_tokens: int, context: int) -> "GenerationRequest":
        """This request, its output budget set to what the prompt leaves of the model's ``context``
        positions if it asked for no budget."""
        if not self.to_context:
            return self
        return replace(self, params=replace(self.params, max_new_tokens=max(context - prompt_tokens, 0)),
                       to_context=False)


@dataclass(frozen=True)
class OpenAIOptions:
    """Response-shaping options of an OpenAI request."""

    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs in the response
    continuous_usage: bool = False  # usage so far in every stream chunk (vLLM's continuous_usage_stats)


# ----- field checks --------------------------------------------------------------------------
def spelled(err: InvalidRequest, names: dict[str, str]) -> InvalidRequest:
    """``err`` with our field names in its message and param replaced by the client's (``names``)."""
    if not names:
        return err
    ours = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    param = names.get(err.param, err.param) if err.param is not None else None
    renamed = InvalidRequest(ours.sub(lambda match: names[match.group(1)], str(err)), param=param)
    renamed.__cause__ = err.__cause__
    return renamed


def json_object(body: Any, what: str = "the request body") -> dict:
    if not isinstance(body, dict):
        raise InvalidRequest(f"{what} must be a JSON object, got {type(body).__name__}",
                             param=what.strip("'") if what.startswith("'") else None)
    return body


def _typed(body: dict, name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise InvalidRequest(f"'{name}' must be {what}, got {as_written(value)}", param=name)
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) and s for s in value):
        return tuple(value)
    raise InvalidRequest(f"'stop' must be a non-empty string or a list of them, got {as_written(value)}", param="stop")


def _token_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequest(f"'{name}' must be a list of integers, got {as_written(value)}", param=name)
    return value


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI / SGLang form: {"token id": bias}."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidRequest(f"'logit_bias' must be an object mapping token ids to biases, got {as_written(value)}",
                             param="logit_bias")
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequest(f"'logit_bias' keys must be token ids, got {as_written(key)}", param="logit_bias") from None
        if not isinstance(bias, (int, float)) or isinstance(bias, bool):
            raise InvalidRequest(f"'logit_bias' values must be numbers, got {as_written(bias)}", param="logit_bias")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


def _schema(value: Any, name: str) -> str | None:
    """A JSON schema given as a string or an object -> its text."""
    if value is None:
        return None
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str):
        return value
    raise InvalidRequest(f"'{name}' must be a JSON schema (an object or its text), got {as_written(value)}", param=name)


def cache_salt(body: dict) -> tuple[str, ...]:
    """A request's ``cache_salt`` and ``extra_key``: strings of at most ``MAX_SALT_CHARS`` characters;
    null or "" name no salt. Returns the named ones, tagged by field (empty: the shared namespace)."""
    named = []
    for name in sorted(SALT_FIELDS):
        value = _typed(body, name, (str,), None, f"a string of at most {MAX_SALT_CHARS} characters")
        if value is not None and len(value) > MAX_SALT_CHARS:
            raise InvalidRequest(f"'{name}' has {len(value)} characters, over the limit of {MAX_SALT_CHARS}",
                                 param=name)
        if value:
            named.append(f"{name}={value}")
    return tuple(named)


def _special_tokens(body: dict) -> None:
    if body.get("skip_special_tokens", True) is not True:
        raise InvalidRequest("'skip_special_tokens' = false is not supported: special tokens are never shown",
                             param="skip_special_tokens")


def _budget(body: dict, name: str, default: int | None) -> int | None:
    """The output budget: ``default`` when the field is absent, None (what the prompt leaves of the
    context) when it is null, as SGLang and vLLM read it."""
    if body.get(name, 0) is None:
        return None
    return _typed(body, name, (int,), default, "an integer >= 0")


def sampling_params(body: dict, max_tokens_field: str, default_max_tokens: int | None, min_tokens_field: str,
                    default_temperature: float = 1.0, json_schema: str | None = None) -> tuple[SamplingParams, bool]:
    """SamplingParams from the fields of ``body`` (SGLang's sampling_params or an OpenAI body), and
    whether max_new_tokens is left to the context (then it holds min_new_tokens until the prompt is known).
    A value out of range is refused naming the field as ``body`` spells it."""
    _special_tokens(body)
    seed = body.get("seed", body.get("sampling_seed"))
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise InvalidRequest(f"'seed' must be an integer, got {as_written(seed)}", param="seed")
    number = (int, float)
    budget = _budget(body, max_tokens_field, default_max_tokens)
    least = _typed(body, min_tokens_field, (int,), 0, "an integer >= 0")
    keep_stop = _typed(body, "no_stop_trim", (bool,), False, "a boolean") or \
        _typed(body, "include_stop_str_in_output", (bool,), False, "a boolean")  # vLLM's name
    try:
        return SamplingParams(
            max_new_tokens=least if budget is None else budget,
            min_new_tokens=least,
            temperature=_typed(body, "temperature", number, default_temperature, "a number >= 0"),
            top_p=_typed(body, "top_p", number, 1.0, "a number in (0, 1]"),
            top_k=_typed(body, "top_k", (int,), -1, "an integer"),
            min_p=_typed(body, "min_p", number, 0.0, "a number in [0, 1]"),
            frequency_penalty=_typed(body, "frequency_penalty", number, 0.0, "a number in [-2, 2]"),
            presence_penalty=_typed(body, "presence_penalty", number, 0.0, "a number in [-2, 2]"),
            repetition_penalty=_typed(body, "repetition_penalty", number, 1.0, "a number in (0, 2]"),
            logit_bias=_logit_bias(body.get("logit_bias")),
            stop=_stop_strings(body.get("stop")),
            stop_token_ids=tuple(_token_list(body.get("stop_token_ids") or [], "stop_token_ids")),
            ignore_eos=_typed(body, "ignore_eos", (bool,), False, "a boolean"),
            no_stop_trim=keep_stop,
            n=_typed(body, "n", (int,), 1, "an integer"),
            seed=seed,
            regex=_typed(body, "regex", (str,), None, "a string"),
            json_schema=json_schema if json_schema is not None else _schema(body.get("json_schema"), "json_schema"),
            ebnf=_typed(body, "ebnf", (str,), None, "a string"),
        ), budget is None
    except InvalidRequest as err:
        raise spelled(err, budget_spelling(max_tokens_field, min_tokens_field)) from err.__cause__


def budget_spelling(max_tokens_field: str, min_tokens_field: str) -> dict[str, str]:
    """The client's names of the output budget's fields, where they are not SamplingParams'."""
    names = {"max_new_tokens": max_tokens_field, "min_new_tokens": min_tokens_field}
    return {ours: theirs for ours, theirs in names.items() if ours != theirs}


# ----- SGLang /generate ----------------------------------------------------------------------
def _generate_prompts(body: dict) -> tuple[list[str | list[int]], bool]:
    """The prompts of a /generate body and whether it is a batch."""
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise InvalidRequest("give exactly one of 'text' and 'input_ids'" if has_text else "missing prompt: give 'text' or 'input_ids'")
    if has_text:
        text = body["text"]
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), True
        if not isinstance(text, str):
            raise InvalidRequest(f"'text' must be a string or a non-empty list of strings, got {type(text).__name__}",
                                 param="text")
        return [text], False
    ids = body["input_ids"]
    if isinstance(ids, list) and ids and all(isinstance(item, list) for item in ids):
        return [_token_list(item, "input_ids") for item in ids], True
    return [_token_list(ids, "input_ids")], False


def _generate_logprobs(body: dict) -> LogprobRequest | None:
    if not _typed(body, "return_logprob", (bool,), False, "a boolean"):
        for name in ("logprob_start_len", "top_logprobs_num"):
            if body.get(name) not in (None, -1, 0):
                raise InvalidRequest(f"'{name}' needs 'return_logprob': true", param=name)
        return None
    top = _typed(body, "top_logprobs_num", (int,), 0, "an integer >= 0")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"'top_logprobs_num' must be in [0, {MAX_TOP_LOGPROBS}], got {top}",
                             param="top_logprobs_num")
    start = _typed(body, "logprob_start_len", (int,), -1, "an integer >= -1")
    if start < -1:
        raise InvalidRequest(f"'logprob_start_len' must be -1 (output only) or a prompt position, got {start}",
                             param="logprob_start_len")
    return LogprobRequest(top, start, _typed(body, "return_text_in_logprobs", (bool,), False, "a boolean"))


def parse_generate(body: Any) -> tuple[list[GenerationRequest], bool]:
    """SGLang-native ``/generate``: its requests (one per prompt of a batch) and whether it is a batch."""
    body = json_object(body)
    check_fields(body, GENERATE_FIELDS, "/generate")
    prompts, batched = _generate_prompts(body)
    params_body = body.get("sampling_params") or {}
    params_list = params_body if isinstance(params_body, list) else [params_body] * len(prompts)
    if len(params_list) != len(prompts):
        raise InvalidRequest(f"'sampling_params' has {len(params_list)} entries for {len(prompts)} prompts",
                             param="sampling_params")
    logprobs, stream = _generate_logprobs(body), _typed(body, "stream", (bool,), False, "a boolean")
    rid, salt = _typed(body, "rid", (str,), None, "a string"), cache_salt(body)
    _stream_options(body)  # checked only: every chunk's meta_info carries the usage
    requests = []
    for index, (prompt, entry) in enumerate(zip(prompts, params_list)):
        entry = json_object(entry, "'sampling_params'")
        check_fields(entry, SGLANG_SAMPLING, "sampling_params")
        params, to_context = sampling_params(entry, "max_new_tokens", 128, "min_new_tokens")
        requests.append(GenerationRequest(prompt, params, stream, logprobs, to_context=to_context, salt=salt,
                                          rid=None if rid is None else (f"{rid}_{index}" if batched else rid)))
    if len({r.params.n for r in requests}) > 1:
        raise InvalidRequest("'n' must be the same in every entry of 'sampling_params'", param="n")
    return requests, batched


# ----- OpenAI --------------------------------------------------------------------------------
def _response_format(body: dict) -> str | None:
    """OpenAI ``response_format`` -> a JSON schema text (None for plain text)."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = json_object(value, "'response_format'").get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = json_object(value.get("json_schema"), "'response_format.json_schema'")
        if not isinstance(spec.get("schema"), dict):
            raise InvalidRequest("'response_format.json_schema.schema' must be a JSON schema object",
                                 param="response_format")
        return json.dumps(spec["schema"])
    raise InvalidRequest(f"'response_format.type' must be text, json_object or json_schema, got {as_written(kind)}",
                         param="response_format")


def _openai_params(body: dict, max_tokens_default: int | None) -> tuple[SamplingParams, bool, tuple[tuple[str, str], ...]]:
    """The request's sampling parameters, whether its budget is left to the context, and the client's
    names of the fields later checks may refuse."""
    budget = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    schema = _response_format(body)
    params, to_context = sampling_params(body, budget, max_tokens_default, "min_tokens", json_schema=schema)
    best_of = body.get("best_of")
    if best_of is not None and best_of != params.n:
        raise InvalidRequest(f"'best_of' = {as_written(best_of)} is not supported (only best_of = n)", param="best_of")
    spelling = budget_spelling(budget, "min_tokens") | ({"json_schema": "response_format"} if schema is not None else {})
    return params, to_context, tuple(spelling.items())


def _stream_options(body: dict) -> tuple[bool, bool]:
    """``stream_options``: (include_usage, continuous_usage_stats)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    options = json_object(options, "'stream_options'")
    check_fields(options, {"include_usage", "continuous_usage_stats"}, "stream_options")
    return (_typed(options, "include_usage", (bool,), False, "a boolean"),
            _typed(options, "continuous_usage_stats", (bool,), False, "a boolean"))


def _openai_stream(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats); stream options without a stream are refused, as OpenAI does."""
    stream = _typed(body, "stream", (bool,), False, "a boolean")
    if body.get("stream_options") is not None and not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return (stream, *_stream_options(body))


def _completion_prompts(body: dict) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [_token_list(p, "prompt") for p in prompt]
    raise InvalidRequest("missing prompt: 'prompt' must be a string, a list of strings, token ids, or lists of them",
                         param="prompt")


def parse_completion(body: Any) -> tuple[list[GenerationRequest], OpenAIOptions]:
    """OpenAI ``/v1/completions``: one request per prompt of ``prompt``."""
    body = json_object(body)
    check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    params, to_context, spelling = _openai_params(body, 16)  # OpenAI's and vLLM's default for completions; null: the context
    top = _typed(body, "logprobs", (int,), None, "an integer in [0, 5]")
    if top is not None and not 0 <= top <= 5:
        raise InvalidRequest(f"'logprobs' must be in [0, 5], got {top}", param="logprobs")
    echo = _typed(body, "echo", (bool,), False, "a boolean")
    stream, usage, continuous = _openai_stream(body)
    if echo and stream:
        raise InvalidRequest("'echo' with 'stream' is not supported", param="echo")
    logprobs, salt = LogprobRequest(top, 0 if echo else -1, True) if top is not None else None, cache_salt(body)
    requests = [GenerationRequest(prompt, params, stream, logprobs, echo, to_context=to_context, salt=salt,
                                  spelling=spelling) for prompt in _completion_prompts(body)]
    return requests, OpenAIOptions(usage, top, continuous)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class ChatOptions:
    """How messages become a prompt: the generation prompt after them, or the last message left
    open for the model to continue (vLLM's ``continue_final_message``), and extra template variables."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: tuple[tuple[str, Any], ...] = ()


TEMPLATE_NAMES = {"messages", "add_generation_prompt", "bos_token", "eos_token"}  # set by the renderer itself


def parse_chat_options(body: dict) -> ChatOptions:
    """``add_generation_prompt`` (default true), ``continue_final_message`` and ``chat_template_kwargs``."""
    continue_final = _typed(body, "continue_final_message", (bool,), False, "a boolean")
    add = _typed(body, "add_generation_prompt", (bool,), not continue_final, "a boolean")
    if add and continue_final:
        raise InvalidRequest("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                             param="continue_final_message")
    kwargs = json_object(body.get("chat_template_kwargs") or {}, "'chat_template_kwargs'")
    reserved = sorted(TEMPLATE_NAMES & set(kwargs))
    if reserved:
        raise InvalidRequest(f"'chat_template_kwargs' may not set {', '.join(reserved)}", param="chat_template_kwargs")
    return ChatOptions(add, continue_final, tuple(sorted(kwargs.items())))


def _message_content(message: dict, index: int) -> str:
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise InvalidRequest(f"messages[{index}].content parts must be text parts",
                                 param=f"messages[{index}].content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise InvalidRequest(f"messages[{index}].content must be a string", param=f"messages[{index}].content")
    return content


def parse_chat_messages(body: Any) -> list[ChatMessage]:
    """OpenAI chat messages (roles system, developer, user, assistant); content may be a string or a
    list of text parts."""
    messages = json_object(body).get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    parsed = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{index}] must be an object with a string 'role'",
                                 param=f"messages[{index}].role")
        if message["role"] not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{index}].role = {as_written(message['role'])} is not supported: use one of "
                                 f"{', '.join(CHAT_ROLES)} (tool calling is not served)",
                                 param=f"messages[{index}].role")
        check_fields(message, {"role", "content", "name"}, f"messages[{index}]")
        parsed.append(ChatMessage(message["role"], _message_content(message, index)))
    return parsed


Render = Callable[[list[ChatMessage], ChatOptions], str]


def parse_chat(body: Any, render: Render) -> tuple[GenerationRequest, OpenAIOptions]:
    """Messages rendered to one prompt by ``render`` (the model's chat template)."""
    body = json_object(body)
    check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    messages = parse_chat_messages(body)
    params, to_context, spelling = _openai_params(body, None)  # no max_tokens: what the prompt leaves, as vLLM and OpenAI
    wants = _typed(body, "logprobs", (bool,), False, "a boolean")
    top = _typed(body, "top_logprobs", (int,), 0, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs")
    if top and not wants:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    logprobs = LogprobRequest(top, -1, True) if wants else None
    stream, usage, continuous = _openai_stream(body)
    prompt = render(messages, parse_chat_options(body))
    request = GenerationRequest(prompt, params, stream, logprobs, to_context=to_context, salt=cache_salt(body),
                                spelling=spelling)
    return request, OpenAIOptions(usage, top if wants else None, continuous)


def parse_tokenize(body: Any, render: Render) -> tuple[list[str], bool]:
    """``/tokenize``: its prompts (``messages`` rendered as a chat prompt, chat options applied) and
    whether ``prompt`` was a list."""
    body = json_object(body)
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise InvalidRequest("give one of 'prompt' and 'messages'", param="messages")
        check_fields(body, {"model", "messages"} | CHAT_TEMPLATE_FIELDS, "/tokenize")
        return [render(parse_chat_messages(body), parse_chat_options(body))], False
    check_fields(body, {"model", "prompt"}, "/tokenize")
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) else [prompt]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise InvalidRequest("'prompt' must be a string or a list of strings (or give chat 'messages')", param="prompt")
    return prompts, isinstance(prompt, list)


def parse_warmup(body: Any) -> tuple[list[str], tuple[str, ...]]:
    """``/warmup``: ``{"documents": [str, ...], "cache_salt": str}``: the documents and the salt."""
    body = json_object(body)
    check_fields(body, {"documents"} | SALT_FIELDS, "/warmup")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents or not all(isinstance(d, str) for d in documents):
        raise InvalidRequest("'documents' must be a non-empty list of strings", param="documents")
    return documents, cache_salt(body)


@dataclass(frozen=True)
class FlushRequest:
    """What ``/flush_cache`` empties: which tiers (memory by default, so a flush never wipes a
    persistent or shared store by accident), and a namespace's salt (None: every namespace)."""

    salt: tuple[str, ...] | None = None
    tiers: frozenset[str] = frozenset({"memory"})


FLUSH_TIERS = ("memory", "disk", "mooncake")


def parse_flush(body: Any) -> FlushRequest:
    """``/flush_cache``: no body (memory, every namespace), ``{"cache_salt": str}`` (that namespace
    only) and ``{"tiers": [...]}``: any of memory, disk, mooncake, or "all" (a list or a
    comma-separated string)."""
    if body is None:
        return FlushRequest()
    body = json_object(body)
    check_fields(body, SALT_FIELDS | {"tiers"}, "/flush_cache")
    salt = cache_salt(body) if any(body.get(name) is not None for name in SALT_FIELDS) else None
    return FlushRequest(salt, flush_tiers(body.get("tiers")))


def flush_tiers(value: Any) -> frozenset[str]:
    """The tiers a flush names (None: memory only)."""
    if value is None:
        return FlushRequest.tiers
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise InvalidRequest(f"'tiers' must be a non-empty list of {', '.join(FLUSH_TIERS)} or 'all', got {as_written(value)}",
                             param="tiers")
    names = [n.strip() for n in names]
    unknown = [n for n in names if n not in (*FLUSH_TIERS, "all")]
    if unknown:
        raise InvalidRequest(f"unknown tier {as_written(unknown[0])} in 'tiers': use {', '.join(FLUSH_TIERS)} or 'all'",
                             param="tiers")
    return frozenset(FLUSH_TIERS) if "all" in names else frozenset(names)