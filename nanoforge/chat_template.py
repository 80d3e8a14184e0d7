"""ChatML as a chat template: the template nanoforge writes, compiling any template the way transformers does,
and the loss mask of a rendered conversation (1 on each assistant reply and its closing <|im_end|>).

The Tokenizer (tokenizer.py) renders and encodes; this module holds the pieces that need no tokenizer.
"""
from __future__ import annotations

import json

from nanoforge.errors import NanoforgeError

IM_END = "<|im_end|>"

# ChatML (as Qwen uses it). Whitespace matters: HF renders with trim_blocks/lstrip_blocks and the `{%-` marks
# keep the template's own newlines out of the output, so only the quoted '\n's appear.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


class ChatTemplateError(NanoforgeError):
    """The chat template and a conversation do not fit together (no ChatML tokens, unmaskable render)."""


def marker_tag(messages) -> str:
    """A tag that makes the content markers (private-use characters) absent from every message, so a
    message cannot contain another message's marker."""
    texts = [str(v) for m in messages for v in m.values() if isinstance(v, str)]
    tag = ""
    while any(f"\ue000{tag}" in t for t in texts):
        tag += "\ue002"
    return tag


def locate_contents(render_text, messages, add_generation_prompt, which: list[bool]):
    """Render with `render_text`, and find where each chosen message's content sits in the text.

    Each chosen content is replaced by a unique marker, the template renders, each marker is found
    exactly once (searching the text for the content would be wrong: a user turn may repeat it), and
    the contents are put back; re-rendering the real messages must give the same text, or the template
    is doing something to a content that we cannot track (then we say so rather than guess)."""
    tag = marker_tag(messages)
    marked = [{**m, "content": f"\ue000{tag}{i}\ue001"} if chosen else m
              for i, (m, chosen) in enumerate(zip(messages, which))]
    template_text = render_text(marked, add_generation_prompt)
    found = []
    for i, chosen in enumerate(which):
        if not chosen:
            continue
        marker = marked[i]["content"]
        at = template_text.find(marker)
        if at < 0 or template_text.find(marker, at + 1) >= 0:
            raise ChatTemplateError(f"the chat template dropped, altered or repeated {messages[i]['role']} "
                                    f"message {i}, so its loss mask cannot be computed")
        found.append((at, i, marker))
    found.sort()
    pieces, contents, assistant_spans, cursor, out_len = [], [], [], 0, 0
    for at, i, marker in found:
        pieces.append(template_text[cursor:at])
        out_len += at - cursor
        start = out_len
        pieces.append(messages[i]["content"])
        out_len += len(messages[i]["content"])
        cursor = at + len(marker)
        contents.append((start, out_len))
        if messages[i]["role"] == "assistant":
            if not template_text.startswith(IM_END, cursor):
                raise ChatTemplateError(f"the chat template does not close assistant message {i} with "
                                        f"{IM_END}; the loss mask needs that token right after the content")
            assistant_spans.append((start, out_len + len(IM_END)))
    pieces.append(template_text[cursor:])
    text = "".join(pieces)
    if text != render_text(messages, add_generation_prompt):
        roles = sorted({messages[i]["role"] for i, chosen in enumerate(which) if chosen})
        raise ChatTemplateError(f"the chat template changes {'/'.join(roles)} contents while rendering (e.g. "
                                "strips or splits them), so the loss mask cannot be computed from the template")
    return text, contents, assistant_spans


def check_message_shapes(messages) -> None:
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of {{role, content}} objects, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ChatTemplateError(f"message {i} must be an object with string role and content, got {message!r:.80}")


def assistant_mask(ids, offsets, spans, im_end_id, text) -> list[int]:
    """1 for tokens inside an assistant span, 0 outside; a token crossing a span edge is an error.

    Byte-level BPE with the GPT-2 split regex keeps edges clean for ChatML: the special tokens are split out
    first and the template's '\\n' before the content only merges with the content when the content itself
    starts with two or more whitespace characters or is only whitespace (then we raise rather than silently
    train on half a token).
    """
    mask = [0] * len(ids)
    span_index = 0
    for i, (start, end) in enumerate(offsets):
        while span_index < len(spans) and spans[span_index][1] <= start:
            span_index += 1
        if span_index == len(spans):
            break
        lo, hi = spans[span_index]
        if start < lo < end or start < hi < end:
            edge = lo if start < lo < end else hi
            raise ChatTemplateError(
                f"token {i} ({text[start:end]!r}) crosses the edge of an assistant message at character {edge}, "
                "so it cannot be masked cleanly; this happens when an assistant message starts with two or more "
                "whitespace characters or is only whitespace; strip that whitespace from the data")
        if lo <= start and end <= hi and end > start:
            mask[i] = 1
    _check_mask_closes_with_im_end(ids, mask, im_end_id, len(spans))
    return mask


def _check_mask_closes_with_im_end(ids, mask, im_end_id, num_spans) -> None:
    """Every masked run must end on <|im_end|>: that is the token that teaches the model to stop."""
    runs_closed = 0
    for i, m in enumerate(mask):
        if m and (i + 1 == len(mask) or not mask[i + 1]):
            if ids[i] != im_end_id:
                raise ChatTemplateError("an assistant message was not encoded with a closing <|im_end|> token")
            runs_closed += 1
    if runs_closed != num_spans:
        raise ChatTemplateError(f"found {runs_closed} masked assistant runs for {num_spans} assistant messages")


def compile_template(source: str):
    """Compile a chat template the way transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the conversation: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {e}") from e
