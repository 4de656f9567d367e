"""Chat messages -> one prompt: the model's own chat template when it ships one, else ChatML.

Separators inside message content pass through untouched, so a RAG chat turn still splits into
L, PIC segments and Q after rendering.
"""
import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import InvalidRequest
from .protocol import ChatMessage, ChatOptions, Render

OPEN_END = "\x00hypic-final-message\x00"  # stands in for the last message's content to find where it starts
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def load_chat_template(model_dir: str | Path) -> tuple[str, bool]:
    """(template source, whether it came from the model's tokenizer_config.json)."""
    config = Path(model_dir) / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text()).get("chat_template")
        if isinstance(template, str) and template:
            return template, True
    return CHATML, False


def chat_renderer(template: str) -> Render:
    """A function rendering messages with ``template`` (sandboxed Jinja, as transformers does). With
    ``continue_final_message`` the prompt ends with the last message's content, its end-of-turn
    markup cut off, so the model continues that message."""
    compiled = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)

    def fill(messages: list[ChatMessage], options: ChatOptions) -> str:
        try:
            return compiled.render(dict(options.template_kwargs), messages=[{"role": m.role, "content": m.content}
                                                                            for m in messages],
                                   add_generation_prompt=options.add_generation_prompt, bos_token="", eos_token="")
        except Exception as err:  # a template may reject a message sequence (e.g. roles out of order)
            raise InvalidRequest(f"the chat template rejected the messages: {err}") from err

    def render(messages: list[ChatMessage], options: ChatOptions) -> str:
        if not options.continue_final_message:
            return fill(messages, options)
        final = messages[-1]
        text = fill([*messages[:-1], ChatMessage(final.role, OPEN_END)], options)
        if text.count(OPEN_END) != 1:
            raise InvalidRequest("continue_final_message: the chat template does not show the last message's content")
        return text[:text.index(OPEN_END)] + final.content

    return render
