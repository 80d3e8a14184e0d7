"""Reading a `/v1/chat/completions` body into a prompt: the messages (system, user, assistant with `tool_calls`
and `reasoning_content`, `tool` results), the `tools` offered, `tool_choice`, and the template switches of
`chat_template_kwargs` (`enable_thinking`, or its other name `open_thinking`). Accepted, as OpenAI sends them:
  - `tools`: `{"type": "function", "function": {"name", "description"?, "parameters"?}}`, names as OpenAI
    allows them (letters, digits, _ and -, at most 64), since the template writes them into JSON text;
  - `tool_choice`: "auto" (the default) or "none" (tools left out of the prompt, no calls come back);
    "required" and a named function are refused: a small model cannot be made to call a tool;
  - messages: content a string or text parts, null for an assistant message with `tool_calls` (`arguments`
    a JSON object or its string); `tool` messages (`tool_call_id` optional: results match calls by order).
Tools, calls or tool messages sent to a model whose template has no tool support (plain ChatML) get a 400
that says so, rather than being rendered into something it never learnt.

Every other field of OpenAI's is read here too (`openai_options`): supported (`n`, `logprobs` and
`top_logprobs`, `logit_bias`, ...), accepted because it changes nothing this server would do differently
(`user`, `metadata`, `store: false`, `service_tier` "auto"/"default", the prompt-cache hints,
`safety_identifier`, `modalities: ["text"]`, `response_format: {"type": "text"}`), or refused with a 400 naming
it (CHAT_REFUSED, and any field this server does not know). Message fields likewise: `name` (no place for it in
the template), `refusal`, `audio`, `function_call` and `annotations` are refused unless null, and any key not
in MESSAGE_FIELDS."""
import json
import re
from typing import Any

from nanoforge.core import safejson
from nanoforge.core.errors import NanoforgeError
from nanoforge.serve.protocol import (SHARED_FIELDS, GenerationRequest, Limits, bad_request, check_fits, check_known,
                                      check_unicode, field, integer, sampling)

ROLES = ("system", "user", "assistant", "tool")
CHAT_FIELDS = SHARED_FIELDS | {"messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                               "top_logprobs", "metadata", "store", "service_tier", "prompt_cache_key",
                               "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "modalities",
                               "response_format"}
CHAT_REFUSED = {
    "audio": "this model writes text only",
    "functions": "the legacy function-calling fields are not supported; send `tools` instead",
    "function_call": "the legacy function-calling fields are not supported; send `tool_choice` instead",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "the model thinks or it does not: send chat_template_kwargs {\"enable_thinking\": true}",
    "verbosity": "this model cannot be asked for a verbosity",
    "web_search_options": "this server has no web search",
    "moderation": "this server runs no moderation",
}
MESSAGE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "reasoning_content")
MESSAGE_REFUSED = {"name": "the chat template has no place for a participant's name (put it in the content)",
                   "refusal": "an assistant refusal cannot be shown to this model", "audio": "text only",
                   "function_call": "the legacy function-calling fields are not supported; send tool_calls",
                   "annotations": "annotations cannot be shown to this model"}
MAX_TOP_LOGPROBS = 20  # OpenAI's
TEMPLATE_SWITCHES = ("enable_thinking", "open_thinking")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
THINK_OPENED = "<think>\n"  # a prompt ending with this leaves the reply inside the think block


def parse_chat_request(body: Any, tokenizer, limits: Limits) -> GenerationRequest:
    """A /v1/chat/completions body -> a checked request (APIError when it is not one)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_known(body, CHAT_FIELDS, CHAT_REFUSED)
    field(body, "model", (str,), "a string")
    messages = chat_messages(body)
    tools = parse_tools(body.get("tools"))
    offered = bool(tools) and parse_tool_choice(body.get("tool_choice")) == "auto"
    switches = template_switches(body.get("chat_template_kwargs"))
    top_logprobs = openai_options(body, offered)
    shared = sampling(body, limits)
    if not tokenizer.supports_tools:
        _refuse_tools(messages, offered)
    try:
        prompt_ids, _, text = tokenizer.render_chat_with_text(messages, add_generation_prompt=True,
                                                              tools=tools if offered else None, **switches)
    except NanoforgeError as e:
        raise bad_request(str(e), param="messages") from None
    check_fits(prompt_ids, limits, "messages")
    return GenerationRequest(prompt_ids, shared.cfg, shared.stream, shared.include_usage,
                             structured=tokenizer.supports_tools, thinking_open=text.endswith(THINK_OPENED),
                             tools_offered=offered, n=shared.n, logit_bias=shared.logit_bias,
                             ignore_eos=shared.ignore_eos, top_logprobs=top_logprobs)


def openai_options(body: dict, offered: bool) -> int | None:
    """The chat fields beside messages, tools and sampling (the module docstring) -> top_logprobs (None: no
    log-probs)."""
    for name in ("prompt_cache_key", "prompt_cache_retention", "safety_identifier"):
        field(body, name, (str,), "a string")
    field(body, "prompt_cache_options", (dict,), "an object")
    metadata = field(body, "metadata", (dict,), "an object of strings", {})
    if not all(isinstance(v, str) for v in metadata.values()):
        raise bad_request("metadata must be an object of strings", param="metadata")
    if field(body, "store", (bool,), "a boolean"):
        raise bad_request("store: true is not supported: this server stores no replies", param="store")
    if field(body, "service_tier", (str,), "a string", "auto") not in ("auto", "default"):
        raise bad_request("service_tier: this server has one tier; only \"auto\" and \"default\" are accepted",
                          param="service_tier")
    if field(body, "modalities", (list,), "a list", ["text"]) != ["text"]:
        raise bad_request("modalities: this model writes text only; send [\"text\"] or leave it out",
                          param="modalities")
    if field(body, "response_format", (dict,), "an object", {"type": "text"}) != {"type": "text"}:
        raise bad_request("response_format: only {\"type\": \"text\"} is supported (no JSON mode or schema: a "
                          "small model cannot be held to one)", param="response_format")
    if field(body, "parallel_tool_calls", (bool,), "a boolean") is False and offered:
        raise bad_request("parallel_tool_calls: false is not supported: the model may write several calls in one "
                          "reply, and all are returned", param="parallel_tool_calls")
    return logprobs_wanted(body)


def logprobs_wanted(body: dict) -> int | None:
    """`logprobs` (a boolean) and `top_logprobs` (0 to 20, only with logprobs) -> top_logprobs, None for none."""
    wanted = field(body, "logprobs", (bool,), "true or false", False)
    top = integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def _refuse_tools(messages: list[dict], offered: bool) -> None:
    why = ("this model's chat template has no tool support (plain ChatML: no way to show tools, calls or "
           "results); serve a model whose tokenizer has the thinking/tool template (`nanoforge tokenizer train` "
           "writes one), or send plain messages")
    if offered:
        raise bad_request(f"tools were sent, but {why}", param="tools")
    for i, message in enumerate(messages):
        if message["role"] == "tool" or message.get("tool_calls"):
            what = "is a tool result" if message["role"] == "tool" else "has tool_calls"
            raise bad_request(f"messages[{i}] {what}, but {why}", param=f"messages[{i}]")


# -------------------------------------------------------------------- tools, tool_choice, template switches

def parse_tools(tools) -> list[dict] | None:
    """The `tools` field -> the schemas for the template (None when absent or empty)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects",
                          param="tools")
    return [_tool(i, tool) for i, tool in enumerate(tools)] or None


def _tool(i: int, tool) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f"{where} must be an object with \"type\": \"function\" (the only kind of tool)",
                          param=f"{where}.type" if isinstance(tool, dict) else where)
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object with a name", param=f"{where}.function")
    name = function.get("name")
    if not (isinstance(name, str) and TOOL_NAME.fullmatch(name)):
        raise bad_request(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got "
                          f"{json.dumps(name)[:60]}", param=f"{where}.function.name")
    out = {"name": name}
    if function.get("description") is not None:
        out["description"] = _string(function["description"], f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON Schema object",
                              param=f"{where}.function.parameters")
        out["parameters"] = parameters
    return {"type": "function", "function": out}


def parse_tool_choice(choice) -> str:
    """"auto" (also for absent) or "none"; everything else a 400."""
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    if choice == "required" or isinstance(choice, dict):
        raise bad_request("tool_choice: only \"auto\" and \"none\" are supported (this server cannot force a "
                          "small model to call a tool)", param="tool_choice")
    raise bad_request(f"tool_choice must be \"auto\" or \"none\", got {json.dumps(choice)[:60]}", param="tool_choice")


def template_switches(kwargs) -> dict:
    """`chat_template_kwargs` -> the keyword arguments for the template: only its boolean switches."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object such as {\"enable_thinking\": true}",
                          param="chat_template_kwargs")
    for key, value in kwargs.items():
        if key not in TEMPLATE_SWITCHES:
            raise bad_request(f"chat_template_kwargs.{key} is not known; the template's switches are "
                              f"{', '.join(TEMPLATE_SWITCHES)}", param=f"chat_template_kwargs.{key}")
        if not isinstance(value, bool):
            raise bad_request(f"chat_template_kwargs.{key} must be true or false", param=f"chat_template_kwargs.{key}")
    return dict(kwargs)


# ------------------------------------------------------------------------------------------------- messages

def chat_messages(body: dict) -> list[dict]:
    """The `messages` field -> the conversation for the template (only the fields it reads)."""
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages is required: a list of {role, content} objects", param="messages")
    if not isinstance(messages, list):
        raise bad_request("messages must be a list of {role, content} objects", param="messages")
    if not messages:
        raise bad_request("messages is empty; send at least one message", param="messages")
    return [_message(i, message) for i, message in enumerate(messages)]


def _message(i: int, message) -> dict:
    if not isinstance(message, dict):
        raise bad_request(f"messages[{i}] must be an object with role and content", param=f"messages[{i}]")
    for key, value in message.items():
        if key in MESSAGE_REFUSED and value is not None:
            raise bad_request(f"messages[{i}].{key} is not supported: {MESSAGE_REFUSED[key]}",
                              param=f"messages[{i}].{key}")
        if key not in MESSAGE_FIELDS and key not in MESSAGE_REFUSED:
            raise bad_request(f"messages[{i}].{key} is not a field of a message this server reads; the fields are "
                              f"{', '.join(MESSAGE_FIELDS)}", param=f"messages[{i}].{key}")
    role = message.get("role")
    role = "system" if role == "developer" else role  # "developer": OpenAI's newer name for the system role
    if role not in ROLES:
        raise bad_request(f"messages[{i}].role {json.dumps(role)[:40]} is not one of {', '.join(ROLES)}",
                          param=f"messages[{i}].role")
    if role != "assistant":
        return {"role": role, "content": _content(message, i)}
    out: dict = {"role": role}
    calls = message.get("tool_calls")
    if calls is not None:
        out["tool_calls"] = _tool_calls(i, calls)
    out["content"] = None if message.get("content") is None and calls else _content(message, i)
    if message.get("reasoning_content") is not None:
        out["reasoning_content"] = _string(message["reasoning_content"], f"messages[{i}].reasoning_content")
    return out


def _string(value, param: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{param} must be a string", param=param)
    return check_unicode(value, param)


def _content(message: dict, i: int) -> str:
    content, param = message.get("content"), f"messages[{i}].content"
    if isinstance(content, list):  # OpenAI's content parts; text is all a language model can read
        if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return check_unicode("".join(p["text"] for p in content), param)
        raise bad_request(f"{param}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
                          param=param)
    if not isinstance(content, str):
        null_ok = " (null only in an assistant message with tool_calls)" if message.get("role") == "assistant" else ""
        raise bad_request(f"{param} must be a string{null_ok}, got {json.dumps(content)[:60]}", param=param)
    return check_unicode(content, param)


def _tool_calls(i: int, calls) -> list[dict]:
    """An assistant message's `tool_calls` -> the calls for the template, arguments as given (a JSON object
    as text, written into the prompt as it is, or an object the template serialises)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list of calls", param=where)
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise bad_request(f"{where}[{k}] must be {{\"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\"}}}}", param=f"{where}[{k}]")
        name = function.get("name")
        if not (isinstance(name, str) and TOOL_NAME.fullmatch(name)):
            raise bad_request(f"{where}[{k}].function.name must be 1 to 64 letters, digits, _ or -",
                              param=f"{where}[{k}].function.name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _arguments_text(arguments, f"{where}[{k}].function.arguments")
        elif not isinstance(arguments, dict):
            raise bad_request(f"{where}[{k}].function.arguments must be a JSON object (as a string)",
                              param=f"{where}[{k}].function.arguments")
        out.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def _arguments_text(text: str, param: str) -> str:
    if not text.strip():
        return "{}"
    try:
        parsed = safejson.loads(check_unicode(text, param))
    except ValueError as e:
        raise bad_request(f"{param} must be a JSON object as a string, got invalid JSON: {e}", param=param) from None
    if not isinstance(parsed, dict):
        raise bad_request(f"{param} must be a JSON object as a string, got {text[:60]!r}", param=param)
    return text
