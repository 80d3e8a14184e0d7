"""Checking a conversation's shape before it is rendered: roles and contents, reasoning, tool calls, tools.

Accepted, as OpenAI's API and MiniMind-3's data write them: `content` a string (null only for an assistant
message with `tool_calls`); `reasoning_content` (assistant) a string or null; `tool_calls` (assistant) a list,
or a JSON string of one, of OpenAI's `{"type": "function", "function": {"name", "arguments"}}` or a bare
`{"name", "arguments"}`, `arguments` an object or a string (passed as written); role `tool` with the result as
a string; `tools`, the list of tool schemas (or a JSON string of it), given to render_text or on the opening
system message. `prepare` applies the same checks to SFT records (data/jsonl.py). A JSON-string `tool_calls` or
`tools` is parsed here (templates iterate over a list); all else reaches the template as given, so the render
equals HF apply_chat_template's. Errors are ChatTemplateErrors naming the message index and the field."""
import json
from typing import Any

from nanoforge.core import safejson
from nanoforge.chat.template import ChatTemplateError
from nanoforge.core.errors import NanoforgeError

ROLES = ("system", "user", "assistant")


class RecordError(NanoforgeError, ValueError):
    """A schema violation inside one record, before its file and line are known (see validate_record)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message if field is None else f"{field}: {message}")
        self.message, self.field = message, field


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _keys(obj: dict) -> str:
    return ", ".join(f'"{k}"' for k in list(obj)[:8]) or "none"


def check_messages(messages: Any, name: str, tools: bool = False) -> None:
    """A conversation: at most one leading system message, then user/assistant strictly alternating,
    starting with user and ending with assistant (what MiniMind's SFT and DPO loaders assume).

    tools=True (SFT) also accepts MiniMind-3's tool use: `tools` on the opening system message, an
    assistant's `tool_calls` (content may then be null) and `reasoning_content`, and `tool` messages, which
    follow an assistant message with tool_calls (at most one per call) and are followed by an assistant."""
    if not isinstance(messages, list):
        raise RecordError(f"must be a list of messages, got {_type_name(messages)}", f'"{name}"')
    if not messages:
        raise RecordError("is an empty conversation; it needs at least a user and an assistant message", f'"{name}"')
    declared = _declared_tools(messages, name) if tools else None
    calls = answered = 0  # tool calls of the last assistant message, and tool messages answering them
    for i, message in enumerate(messages):
        where = f'"{name}"[{i}]'
        _check_role_and_content(message, where, tools)
        role = message["role"]
        parsed = check_tool_fields(message, f"{where}.", declared) if tools else None
        expected = _expected_role(messages, i, calls, answered)
        if role not in expected:
            previous = f'after "{messages[i - 1]["role"]}"' if i else "as the first message"
            wanted = " or ".join(f'"{r}"' for r in expected)
            raise RecordError(f'expected {wanted} {previous}, got "{role}" ({_order_rule(messages, i, calls)})',
                              f"{where}.role")
        if role == "assistant":
            calls, answered = len(parsed or []), 0
        elif role == "tool":
            answered += 1
    if messages[-1]["role"] != "assistant":
        raise RecordError(f'must end with an assistant message, ends with "{messages[-1]["role"]}"', f'"{name}"')


def _check_role_and_content(message: Any, where: str, tools: bool) -> None:
    if not isinstance(message, dict):
        raise RecordError(f"must be an object with role and content, got {_type_name(message)}", where)
    for key in ("role", "content"):
        if key not in message and not (key == "content" and tools and has_tool_calls(message)):
            raise RecordError(f'missing "{key}"', where)
    if not isinstance(message["role"], str):
        raise RecordError(f"must be a string, got {_type_name(message['role'])}", f"{where}.role")
    check_content(message, f"{where}.", tools)
    roles = ROLES + (("tool",) if tools else ())
    if message["role"] not in roles:
        extra = " (or tool, answering an assistant's tool_calls)" if tools else ""
        raise RecordError(f'"{message["role"]}" is not one of {", ".join(ROLES)}{extra}', f"{where}.role")


def _expected_role(messages: list, i: int, calls: int = 0, answered: int = 0) -> tuple[str, ...]:
    """The roles allowed at position i given the ones before it (`calls`: tool calls of the last assistant
    message, `answered`: the tool messages after it so far)."""
    if i == 0:
        return ("system", "user")
    previous = messages[i - 1]["role"]
    if previous == "user":
        return ("assistant",)
    if previous == "assistant" and calls:
        return ("tool",)
    if previous == "tool":
        return ("tool", "assistant") if answered < calls else ("assistant",)
    return ("user",)


def _order_rule(messages: list, i: int, calls: int) -> str:
    role, previous = messages[i]["role"], messages[i - 1]["role"] if i else None
    if role == "tool" and not (previous in ("assistant", "tool") and calls):
        return "a tool message answers a call in the tool_calls of the assistant message before it"
    if role == "tool":
        return f"no more tool messages than the {calls} tool_calls they answer"
    if previous in ("assistant", "tool") and calls:
        return f"the {calls} tool_calls are answered by tool messages, then the assistant replies"
    return "at most one leading system message, then user and assistant alternating"


# ---------------------------------------------------------------------------------------------- tool use
# The shapes of MiniMind-3's tool use, checked here for `prepare` and by chat/messages.py before rendering (one
# definition of each). `prefix` starts every RecordError field: '"conversations"[2].' here, "" for toolcalls.


def _parsed_json(value: Any) -> Any:
    """A JSON-string field parsed (an empty string is an empty list, as the renderer reads it); else as it is."""
    if not isinstance(value, str):
        return value
    return safejson.loads(value) if value.strip() else []


def _json_field(value: Any, field: str, parse=_parsed_json) -> Any:
    try:
        return parse(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        raise RecordError(f"not valid JSON: {e.msg} at column {e.colno}", field) from None


def has_tool_calls(message: dict) -> bool:
    """Whether an assistant message calls tools (invalid JSON counts as calls: its own check reports it)."""
    try:
        return bool(_parsed_json(message.get("tool_calls")))
    except json.JSONDecodeError:
        return True


def call_function(call: dict) -> Any:
    """A tool call's {"name", "arguments"}: its "function" when set (as the chat template reads it), else itself."""
    return call["function"] if call.get("function") else call


def tool_function(tool: dict) -> dict:
    """A tool schema's {"name", "parameters", ...}: OpenAI's {"type": "function", "function": {...}}, or bare."""
    return tool["function"] if isinstance(tool.get("function"), dict) else tool


def check_content(message: dict, prefix: str = "", tools: bool = True) -> None:
    """`content` is a string, or (tools=True) null in an assistant message that calls tools."""
    content = message.get("content")
    if isinstance(content, str) or (tools and content is None and message["role"] == "assistant"
                                    and has_tool_calls(message)):
        return
    why = " (null is allowed only in an assistant message with tool_calls)" if tools and content is None else ""
    raise RecordError(f"must be a string, got {_type_name(content)}{why}", f"{prefix}content")


def parsed_tools(tools: Any, field: str) -> list:
    """`tools`: a list of tool schema objects, or a JSON string of one, parsed."""
    tools = _json_field(tools, field)
    if not isinstance(tools, list):
        raise RecordError(f"must be a list of tool schemas (or a JSON string of one), got {_type_name(tools)}", field)
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise RecordError(f"must be a tool schema object, got {_type_name(tool)}", f"{field}[{j}]")
    return tools


def _declared_tools(messages: list, name: str) -> set[str] | None:
    """The tool names the opening system message declares in `tools` (None when it declares none)."""
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("tools") is not None and not (
                i == 0 and message.get("role") == "system"):
            raise RecordError("only the opening system message declares tools", f'"{name}"[{i}].tools')
    if not isinstance(messages[0], dict) or messages[0].get("tools") is None:
        return None
    where, names = f'"{name}"[0].tools', set()
    for j, tool in enumerate(parsed_tools(messages[0]["tools"], where)):
        inner = tool_function(tool)
        if not (isinstance(inner.get("name"), str) and inner["name"]):
            raise RecordError('must be a tool schema with a string "name" (or OpenAI\'s {"type": "function", '
                              '"function": {"name": ..., "parameters": ...}})', f"{where}[{j}]")
        names.add(inner["name"])
    return names


def check_tool_fields(message: dict, prefix: str = "", declared: set[str] | None = None,
                      json_arguments: bool = True) -> list | None:
    """`reasoning_content` and `tool_calls` of one message; returns the calls, parsed (None when it has none).
    `declared`: the names a call may use (None: any). json_arguments=False passes a string `arguments` as
    written (the renderer does, like HF's apply_chat_template); True (data) requires a JSON object in it."""
    reasoning = message.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise RecordError(f"must be a string, got {_type_name(reasoning)}", f"{prefix}reasoning_content")
    calls, where = message.get("tool_calls"), f"{prefix}tool_calls"
    if calls is None:
        return None
    if message["role"] != "assistant":
        raise RecordError(f"only assistant messages call tools (this is a {message['role']} message)", where)
    calls = _json_field(calls, where)
    if isinstance(calls, dict):
        raise RecordError("must be a list of calls, got one object (wrap it in a list)", where)
    if not isinstance(calls, list):
        raise RecordError(f"must be a list of calls (or a JSON string of one), got {_type_name(calls)}", where)
    for k, call in enumerate(calls):
        _check_call(call, f"{where}[{k}]", declared, json_arguments)
    return calls


def _check_call(call: Any, where: str, declared: set[str] | None, json_arguments: bool) -> None:
    if not isinstance(call, dict):
        raise RecordError('must be an object: {"name": ..., "arguments": ...} or OpenAI\'s {"type": "function", '
                          f'"function": {{"name": ..., "arguments": ...}}}}, got {_type_name(call)}', where)
    if call_function(call) is not call:
        where, call = f"{where}.function", call["function"]
        if not isinstance(call, dict):
            raise RecordError(f'must be an object with "name" and "arguments", got {_type_name(call)}', where)
    name = call.get("name")
    if name is None:
        raise RecordError('missing "name"', where)
    if not isinstance(name, str) or not name:
        raise RecordError(f"must be a non-empty string, got {_type_name(name)}", f"{where}.name")
    if declared is not None and name not in declared:
        known = ", ".join(sorted(declared)) or "none"
        raise RecordError(f'"{name}" is not a tool the record declares (in the system message\'s tools: {known})',
                          f"{where}.name")
    if "arguments" not in call:
        raise RecordError('missing "arguments" (an object, or a JSON string of one)', where)
    arguments = call["arguments"]
    arguments = _json_field(arguments, f"{where}.arguments", safejson.loads) if json_arguments else arguments
    if not isinstance(arguments, dict if json_arguments else (dict, str)):
        raise RecordError(f"must be an object of arguments (or a JSON string of one), got {_type_name(arguments)}",
                          f"{where}.arguments")


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
