"""Checking a conversation's shape before it is rendered: roles and contents, reasoning, tool calls, tools.

Accepted, as OpenAI's API and MiniMind-3's data write them:
  - `content`: a string; null/None only for an assistant message that has `tool_calls`;
  - `reasoning_content` (assistant): a string or null;
  - `tool_calls` (assistant): a list, or a JSON string holding one, of calls each either OpenAI's
    `{"type": "function", "function": {"name", "arguments"}}` or a bare `{"name", "arguments"}`, whose
    `arguments` are an object or a string (passed as written);
  - role `tool`: a message whose content is the tool's result, as a string;
  - `tools`: the list of tool schemas (or a JSON string of it), given to render_text or carried by the
    opening system message.
The checks are data/jsonl.py's, the ones `prepare` applies to SFT records. A JSON-string `tool_calls` or `tools`
is parsed here (templates, MiniMind-3's included, iterate over a list); everything else reaches the template as
given, so the render equals HF apply_chat_template's on the same input.
Errors are ChatTemplateErrors naming the message index and the field.
"""
from __future__ import annotations

from nanoforge.chat.template import ChatTemplateError
from nanoforge.data.jsonl import RecordError, check_content, check_tool_fields, parsed_tools


def normalize_conversation(messages, tools=None) -> tuple[list[dict], list | None]:
    """(messages, tools) ready for the template: checked, JSON strings parsed; the input is not modified."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of {{role, content}} objects, got {type(messages).__name__}")
    try:
        tools = None if tools is None else parsed_tools(tools, "tools")
    except RecordError as e:
        raise ChatTemplateError(f"{e.field}: {e.message}") from None
    out = []
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            raise ChatTemplateError(f"message {i} must be an object with string role and content, got {message!r:.80}")
        try:
            calls = check_tool_fields(message, json_arguments=False)
            check_content(message)
            if i == 0 and tools is None and message["role"] == "system" and message.get("tools") is not None:
                tools = parsed_tools(message["tools"], "tools")
        except RecordError as e:
            raise ChatTemplateError(f"message {i} ({message['role']}) field '{e.field}': {e.message}") from None
        out.append(message if calls is None or calls is message["tool_calls"] else {**message, "tool_calls": calls})
    return out, tools
