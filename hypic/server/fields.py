"""The one table of request fields the server does not serve, and the rule that judges them.

A field an endpoint does not serve is judged by its *value*. A value that asks for
behaviour (a LoRA adapter, hidden states, tools) is refused with a 400 naming
the field and why, never accepted and ignored. A neutral value — ``null``, ``false``, ``""``,
``[]``, ``{}`` or the field's documented default — asks for nothing and is accepted, because real
clients (SGLang's ``bench_serving`` and multi-turn benchmark, vLLM's and OpenAI's clients) send
such fields with every request. A field named nowhere is judged by the same neutral values.

The table covers SGLang's ``GenerateReqInput`` and sampling params, OpenAI's completion and chat
requests, vLLM's and SGLang's extensions of them, and chat message fields. What each endpoint
*does* serve is the parser's business (``protocol.py``); a field in both is served where parsed.
"""
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest, as_written


def is_neutral(value: Any) -> bool:
    """``null``, ``false``, ``""``, ``[]`` or ``{}`` (``0`` is not: it is a number that may ask for something)."""
    return value is None or value is False or (isinstance(value, (str, list, dict)) and not value)


def _same(value: Any, default: Any) -> bool:
    """JSON equality without Python's ``False == 0`` and ``True == 1``."""
    numbers = (int, float)
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, numbers) and isinstance(default, numbers):
        return value == default
    return type(value) is type(default) and value == default


@dataclass(frozen=True)
class Unserved:
    """Why a field is not served; ``defaults``: its documented defaults (they ask for nothing);
    ``informational``: any value is accepted (it labels the request and asks for no behaviour)."""

    reason: str
    defaults: tuple[Any, ...] = ()
    informational: bool = False

    def accepts(self, value: Any) -> bool:
        return self.informational or is_neutral(value) or any(_same(value, d) for d in self.defaults)


def _rule(names: str, reason: str, defaults: tuple[Any, ...] = (), informational: bool = False) -> dict[str, Unserved]:
    return dict.fromkeys(names.split(), Unserved(reason, defaults, informational))


TEXT_ONLY = "the served models take text only"
DISAGGREGATION = "prefill-decode disaggregation is not served (use --workers for parallel prefill)"
REASONING = "the served models have no separate reasoning output"
BEAM_SEARCH = "beam search is not served"
LOGPROB_FORMS = "use logprobs / top_logprobs, or /generate's return_logprob"

UNSERVED: dict[str, Unserved] = {
    # --- adapters, extra outputs and custom code (SGLang GenerateReqInput, vLLM extensions)
    **_rule("lora_path lora_id lora_request", "LoRA adapters are not served"),
    **_rule("return_hidden_states", "hidden states are not returned"),
    **_rule("return_routed_experts return_indexer_topk", "expert routings are not returned"),
    **_rule("routed_experts_start_len routed_experts_prompt_start", "expert routings are not returned", (0,)),
    **_rule("return_entropy return_bytes return_sampling_mask return_flat_raw_top_logprobs "
            "return_flat_raw_top_logprobs_b64 token_ids_logprob logprob_token_ids return_tokens_as_token_ids",
            LOGPROB_FORMS),
    **_rule("return_prompt_token_ids return_token_ids return_token_offsets return_prompt_text",
            "token ids come back from /generate (output_ids) and /tokenize"),
    **_rule("prompt_logprobs", "use echo with logprobs (/v1/completions) or logprob_start_len (/generate)"),
    **_rule("custom_logit_processor custom_params logits_processors vllm_xargs",
            "custom logit processors and extension arguments are not served"),
    **_rule("session_params", "SGLang sessions are not served: the private pool resumes a conversation's prefix by itself"),
    **_rule("positional_embed_overrides input_embeds prompt_embeds", "only token prompts are served"),
    # --- multimodal
    **_rule("image_data video_data audio_data mm_hashes mm_content_hashes use_audio_in_video video_config "
            "max_dynamic_patch min_dynamic_patch image_max_dynamic_patch video_max_dynamic_patch images_config "
            "need_wait_for_mm_inputs num_items_assigned encoder_urls media_io_kwargs mm_processor_kwargs audio",
            TEXT_ONLY),
    **_rule("modalities", "only text output is served", (["text"],)),
    **_rule("return_mm_kwargs", TEXT_ONLY, (True,)),
    # --- disaggregation, routing and data parallelism
    **_rule("bootstrap_host bootstrap_port bootstrap_room bootstrap_pair_key decode_tp_size disagg_prefill_dp_rank "
            "kv_router_hint kv_transfer_params ec_transfer_params", DISAGGREGATION),
    **_rule("data_parallel_rank routed_dp_rank", "the server has one data-parallel rank, 0", (0,)),
    **_rule("priority", "requests have no priorities: the scheduler orders prefills by their uncached tokens", (0,)),
    # --- labels: they name or trace the request and ask for nothing
    **_rule("user rid request_id session_id conversation_id routing_key external_trace_header received_time metadata "
            "prompt_cache_key safety_identifier log_metrics no_logs http_worker_ipc",
            "a label of the request (logged nowhere, changes nothing)", informational=True),
    **_rule("custom_labels", "custom metric labels are not served"),
    # --- decoding features not served
    **_rule("use_beam_search beam_width", BEAM_SEARCH, (1,)),
    **_rule("length_penalty", BEAM_SEARCH, (1.0,)),
    **_rule("watermarking", "watermarking is not served"),
    **_rule("stop_regex", "stop_regex is not served (use stop)"),
    **_rule("bad_words allowed_token_ids", "use logit_bias"),
    **_rule("structural_tag structured_outputs guided_json guided_regex guided_choice guided_grammar "
            "guided_decoding_backend guided_whitespace_pattern", "use regex, json_schema, ebnf or response_format"),
    **_rule("repetition_detection", "repetition detection is not served"),
    **_rule("stream_interval", "every token is streamed", (1,)),
    **_rule("spaces_between_special_tokens", "special tokens are never shown", (True,)),
    **_rule("truncate_prompt_tokens truncation_side", "prompts are never truncated"),
    **_rule("suffix", "fill-in-the-middle suffixes are not served"),
    **_rule("add_special_tokens", "prompts are tokenized without special tokens"),
    **_rule("background store", "responses are not stored"),
    **_rule("service_tier", "the server has one service tier", ("auto", "default")),
    **_rule("prediction web_search_options", "predicted outputs and web search are not served"),
    **_rule("verbosity", "output verbosity is not served", ("medium",)),
    # --- reasoning and tools (chat)
    **_rule("reasoning_effort", REASONING, ("none",)),
    **_rule("include_reasoning separate_reasoning stream_reasoning", REASONING, (True,)),
    **_rule("thinking_token_budget", REASONING, (-1,)),
    **_rule("require_reasoning max_thinking_tokens reasoning_content reasoning", REASONING),
    **_rule("tools functions tool_calls tool_call_id", "tool calling is not served"),
    **_rule("tool_choice function_call", "tool calling is not served", ("none", "auto")),
    **_rule("parallel_tool_calls", "tool calling is not served", (True,)),
    **_rule("documents", "put documents in the prompt, between PIC separators"),
    **_rule("chat_template", "the chat template is the model's own (or ChatML)"),
    **_rule("echo", "echo is served by /v1/completions only"),
    **_rule("refusal annotations", "assistant refusals and annotations are not read"),
    **_rule("multi_item_delimiter_indices", "multi-item scoring is not served"),
}


def check_fields(body: dict, served: set[str], where: str) -> None:
    """Refuse, by name, every field of ``body`` outside ``served`` whose value asks for something."""
    for name, value in body.items():
        if name in served:
            continue
        rule = UNSERVED.get(name)
        if rule is None and not is_neutral(value):
            raise InvalidRequest(f"unsupported field '{name}' in {where}", param=name)
        if rule is not None and not rule.accepts(value):
            raise InvalidRequest(f"'{name}' = {as_written(value)} in {where} is not supported: {rule.reason}",
                                 param=name)
