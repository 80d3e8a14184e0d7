"""Chat templates: the two nanoforge writes (plain ChatML, and ChatML with thinking and tool calls in MiniMind-3's
format), compiling any template the way transformers does, finding the assistant turns of a rendered
conversation, and their loss mask (1 on each assistant turn after its `<|im_start|>assistant\\n` header, through
its closing <|im_end|>).

The Tokenizer (tokenizer.py) renders and encodes; this module holds the pieces that need no tokenizer."""
import json
import re

import numpy as np
from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanoforge.core.errors import NanoforgeError

IM_END = "<|im_end|>"

# ChatML (as Qwen uses it). Whitespace matters: HF renders with trim_blocks/lstrip_blocks and the `{%-` marks
# keep the template's own newlines out of the output, so only the quoted '\n's appear.
# Both templates wrap what our loss mask covers (an assistant turn after its header, through <|im_end|>) in
# `{% generation %}`, so HF's return_assistant_tokens_mask (TRL's assistant_only_loss) gives the same mask.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


# The six tags of thinking and tool use. `nanoforge tokenizer train` adds them as single tokens that are not
# special (as MiniMind-3 has them): a message may contain them, and HF encodes them as the same single tokens.
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# ChatML with reasoning and tool calls, rendering what MiniMind-3's template renders (its format):
#  - with `tools`, the system turn is the system text (if any), then a `# Tools` section with one JSON schema per
#    tool inside <tools></tools> and how to answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>;
#  - every assistant turn opens with a think block, from `reasoning_content` or a `<think>...</think>` inline at
#    the head of the content, then the content, then one <tool_call> block per call;
#  - a run of `tool` messages becomes one user turn of <tool_response> blocks;
#  - the generation prompt opens the think block when `open_thinking` (or `enable_thinking`) is true, and
#    gives an empty one otherwise.
# Whitespace matters: every line starts with `{{-` or `{%-`, so only the quoted '\n's reach the output.
THINKING_TOOLS_TEMPLATE = r"""
{%- set thinking = (open_thinking is defined and open_thinking is true)
                   or (enable_thinking is defined and enable_thinking is true) %}
{%- set opening_system = messages[0].role == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if opening_system %}
        {{- messages[0].content ~ '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' ~ (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, ' }}
    {{- '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif opening_system %}
    {{- '<|im_start|>system\n' ~ messages[0].content ~ '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set text = message.content if message.content is string else '' %}
    {%- set before = messages[loop.index0 - 1].role if not loop.first else none %}
    {%- set after = messages[loop.index0 + 1].role if not loop.last else none %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' ~ message.role ~ '\n' ~ text ~ '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in text %}
            {%- set head = text.split('</think>')[0] %}
            {%- set reasoning = head.rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set text = text.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
        {{- '<think>\n' ~ reasoning.strip('\n') ~ '\n</think>\n\n' ~ text.lstrip('\n') }}
        {%- for call in (message.tool_calls or []) %}
            {%- if text or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {%- set call = call.function if call.function else call %}
            {%- set arguments = call.arguments if call.arguments is string else (call.arguments | tojson) %}
            {{- '<tool_call>\n{"name": "' ~ call.name ~ '", "arguments": ' ~ arguments ~ '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == 'tool' %}
        {%- if before != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' ~ text ~ '\n</tool_response>' }}
        {%- if after != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<think>\n' if thinking else '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}
{%- endif %}
"""


# What both our thinking template and MiniMind-3's write at the head of an assistant turn with no reasoning.
# `render_text(..., drop_empty_think=True)` removes it from every assistant turn (not from a generation prompt,
# which stays as the template wrote it), so a model also learns turns without one.
ASSISTANT_HEADER = "<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"


def without_empty_think(text: str) -> str:
    """`text` with every empty think block right after an assistant header removed; a generation prompt at the
    very end keeps its own."""
    prompt = ASSISTANT_HEADER + EMPTY_THINK
    head, tail = (text[:-len(prompt)], prompt) if text.endswith(prompt) else (text, "")
    return head.replace(prompt, ASSISTANT_HEADER) + tail


class ChatTemplateError(NanoforgeError):
    """The chat template and a conversation do not fit together (no ChatML tokens, unmaskable render)."""


def disguise(value, specials: tuple, fill: str, where: str):
    """`value` (messages, tools, ...) with each special-token text in its strings, object keys too, replaced by as
    many `fill` characters: the same length, and no control token left to find. Returns (value, the paths below
    `where` of the fields it was in)."""
    if isinstance(value, str):
        out = value
        for special in specials:
            if special in out:
                out = out.replace(special, fill * len(special))
        return out, [where] if out is not value else []
    if isinstance(value, dict):
        keys = [disguise(k, specials, fill, f"{where}: key {k!r:.60}") for k in value]
        items = [disguise(v, specials, fill, f"{where}[{k!r:.60}]" if bad else f"{where}.{k}")
                 for (_, bad), (k, v) in zip(keys, value.items())]
        fields = [f for _, found in keys + items for f in found]
        return ({k: v for (k, _), (v, _) in zip(keys, items)} if fields else value), fields
    if isinstance(value, (list, tuple)):
        items = [disguise(v, specials, fill, f"{where}[{i}]") for i, v in enumerate(value)]
        fields = [f for _, found in items for f in found]
        return ([v for v, _ in items] if fields else value), fields
    return value, []


def check_disguise(text: str, disguised: str, specials: tuple, fields: list) -> None:
    """The disguised render must be the real one with some special-token texts covered, nothing else changed
    (a template that transforms message text in a length-changing way breaks that; then we do not guess).
    `fields`: where the special-token texts are (disguise's), named in the error."""
    where = "; ".join(fields[:3]) + ("; ..." if len(fields) > 3 else "")
    if len(text) != len(disguised):
        raise ChatTemplateError("a message contains special-token text, and the chat template alters that text "
                                "while rendering, so it cannot be kept as plain text (it would become a control "
                                f"token); remove the special-token text from {where}")
    covered = bytearray(len(text))
    for special in specials:
        at = text.find(special)
        while at >= 0:
            covered[at:at + len(special)] = b"\x01" * len(special)
            at = text.find(special, at + 1)
    for i, (a, b) in enumerate(zip(text, disguised)):
        if a != b and not covered[i]:
            raise ChatTemplateError(f"the chat template renders a message with special-token text differently "
                                    f"around character {i}, so that text cannot be kept as plain text; remove "
                                    f"the special-token text from {where}")


def assistant_turns(text: str, structural, im_start_id: int, im_end_id: int, expected: int) -> list[tuple]:
    """The (start, end) character spans of the closed assistant turns: from just after each
    `<|im_start|>assistant\\n` header through its closing `<|im_end|>`.

    `structural` lists the control tokens the template itself produced, as (start, end, id), in order; text
    inside a message never counts (it was kept plain), so a message cannot open or close a turn. An open
    turn at the end (the generation prompt) is not one. The turns are matched to the `expected` assistant
    messages in order; a template that drops or merges assistant turns is refused."""
    spans, opened = [], None
    for _start, end, token in structural:
        if token == im_start_id:
            opened = end + len("assistant\n") if text.startswith("assistant\n", end) else None
        elif token == im_end_id and opened is not None:
            spans.append((opened, end))
            opened = None
    if len(spans) != expected:
        raise ChatTemplateError(f"the chat template rendered {len(spans)} closed assistant turns for {expected} "
                                "assistant messages, so the loss mask cannot be computed")
    return spans


def assistant_mask(ids, offsets, spans, im_end_id, text) -> np.ndarray:
    """1 (uint8) for tokens inside an assistant span, 0 outside; a token crossing a span edge is an error.

    Byte-level BPE with the GPT-2 split regex keeps edges clean for ChatML: the special tokens are split out
    first and the header's '\\n' only merges with the turn when the turn itself starts with two or more
    whitespace characters or is only whitespace (plain ChatML with such a content: then we raise rather than
    silently train on half a token). With the thinking template every turn starts with the <think> token.
    Each token is judged against the first span that ends after it starts (`ids` and the (n, 2) character
    `offsets` as arrays: a long conversation's millions of tokens are never Python objects)."""
    ids, offsets = np.asarray(ids), np.asarray(offsets).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(ids), dtype=np.uint8)
    if spans:
        los, his = np.array(spans, dtype=np.int64).T
        k = np.searchsorted(his, starts, side="right")
        inside = k < len(spans)
        lo, hi = los[np.minimum(k, len(spans) - 1)], his[np.minimum(k, len(spans) - 1)]
        crossing = inside & (((starts < lo) & (lo < ends)) | ((starts < hi) & (hi < ends)))
        if crossing.any():
            i = int(np.argmax(crossing))
            start, end = int(starts[i]), int(ends[i])
            edge = int(lo[i] if start < lo[i] < end else hi[i])
            raise ChatTemplateError(
                f"token {i} ({text[start:end]!r}) crosses the edge of an assistant message at character {edge}, "
                "so it cannot be masked cleanly; this happens when an assistant message starts with two or more "
                "whitespace characters or is only whitespace; strip that whitespace from the data")
        mask[inside & (lo <= starts) & (ends <= hi) & (ends > starts)] = 1
    _check_mask_closes_with_im_end(ids, mask, im_end_id, len(spans))
    return mask


def _check_mask_closes_with_im_end(ids: np.ndarray, mask: np.ndarray, im_end_id, num_spans) -> None:
    """Every masked run must end on <|im_end|>: that is the token that teaches the model to stop."""
    run_ends = np.flatnonzero((mask == 1) & (np.append(mask[1:], 0) == 0))
    if (ids[run_ends] != im_end_id).any():
        raise ChatTemplateError("an assistant message was not encoded with a closing <|im_end|> token")
    if len(run_ends) != num_spans:
        raise ChatTemplateError(f"found {len(run_ends)} masked assistant runs for {num_spans} assistant messages")


def without_generation_markers(source: str) -> str:
    """The template with its `{% generation %}` markers taken out (for engines that may not know the tag: GGUF's).
    Every marker in our templates sits between whitespace-trimming tags, so the render is unchanged (tested)."""
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", source)


class GenerationMarkers(Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged (the markers only feed HF's mask)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        # a Scope, as HF's block is a call: a `set` inside stays inside
        return nodes.Scope(parser.parse_statements(("name:endgeneration",), drop_needle=True), lineno=lineno)


def compile_template(source: str):
    """Compile a chat template the way transformers does (sandboxed, trim_blocks, lstrip_blocks, generation tags)."""
    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the conversation: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, GenerationMarkers])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {e}") from e
