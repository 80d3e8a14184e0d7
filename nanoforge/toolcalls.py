"""Checking a conversation's shape before it is rendered: roles and contents, reasoning, tool calls, tools.

Accepted, as OpenAI's API and MiniMind-3's data write them:
  - `content`: a string; null/None only for an assistant message that has `tool_calls`;
  - `reasoning_content` (assistant): a string or null;
  - `tool_calls` (assistant): a list, or a JSON string holding one, of calls each either OpenAI's
    `{"type": "function", "function": {"name", "arguments"}}` or a bare `{"name", "arguments"}`, whose
    `arguments` are an object or a (JSON) string;
  - role `tool`: a message whose content is the tool's result, as a string;
  - `tools`: the list of tool schemas (or a JSON string of it), given to render_text or carried by the
    opening system message.
A JSON-string `tool_calls` or `tools` is parsed here (templates, MiniMind-3's included, iterate over a list);
everything else reaches the template as given, so the render equals HF apply_chat_template's on the same input.
Errors are ChatTemplateErrors naming the message index and the field.
"""
from __future__ import annotations

import json

from nanoforge.chat_template import ChatTemplateError


def normalize_conversation(messages, tools=None) -> tuple[list[dict], list | None]:
    """(messages, tools) ready for the template: checked, JSON strings parsed; the input is not modified."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of {{role, content}} objects, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            raise ChatTemplateError(f"message {i} must be an object with string role and content, got {message!r:.80}")
        out.append(_checked_message(i, message))
    if tools is None and out and out[0]["role"] == "system" and out[0].get("tools") is not None:
        tools = _parsed_tools(out[0]["tools"], "message 0 field 'tools'")
    elif tools is not None:
        tools = _parsed_tools(tools, "tools")
    return out, tools


def _checked_message(i: int, message: dict) -> dict:
    role, content = message["role"], message.get("content")
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise ChatTemplateError(f"message {i} ({role}) field 'tool_calls': only assistant messages call tools")
        calls = _parsed_calls(i, calls)
    if not isinstance(content, str) and not (content is None and role == "assistant" and calls):
        what = "a string (or null in an assistant message with tool_calls)" if role == "assistant" else "a string"
        raise ChatTemplateError(f"message {i} must be an object with string role and content; field 'content' "
                                f"of this {role} message must be {what}, got {content!r:.80}")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatTemplateError(f"message {i} ({role}) field 'reasoning_content' must be a string, "
                                f"got {type(reasoning).__name__}")
    if calls is not None and calls is not message.get("tool_calls"):
        message = {**message, "tool_calls": calls}
    return message


def _parsed_calls(i: int, calls) -> list:
    where = f"message {i} (assistant) field 'tool_calls'"
    if isinstance(calls, str):
        try:
            calls = json.loads(calls) if calls.strip() else []
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"{where} is a string but not valid JSON ({e})") from None
    if isinstance(calls, dict):
        raise ChatTemplateError(f"{where} must be a list of calls, got one object (wrap it in a list)")
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where} must be a list of calls or a JSON string of one, "
                                f"got {type(calls).__name__}")
    for k, call in enumerate(calls):
        inner = call.get("function") if isinstance(call, dict) and call.get("function") else call
        if not (isinstance(inner, dict) and isinstance(inner.get("name"), str) and inner["name"]):
            raise ChatTemplateError(f"{where}[{k}] must be an object with a string 'name' (or OpenAI's "
                                    f"{{'type': 'function', 'function': {{'name', 'arguments'}}}}), got {call!r:.80}")
        if not isinstance(inner.get("arguments"), (str, dict)):
            raise ChatTemplateError(f"{where}[{k}] field 'arguments' must be an object or a JSON string, "
                                    f"got {type(inner.get('arguments')).__name__}")
    return calls


def _parsed_tools(tools, where: str) -> list:
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ChatTemplateError(f"{where} is a string but not valid JSON ({e})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ChatTemplateError(f"{where} must be a list of tool schema objects, got {tools!r:.80}")
    return tools
