"""One assistant turn with tools, shared by `chat`, `eval --gsm8k/--toolcall` and the server's callers: which
built-in tools are enabled (their schemas for the system turn), and what a parsed reply adds to the
conversation (the assistant message, then one `tool` message per call, run against the enabled tools).

The conversation it builds is the one the template renders back (chat_template.THINKING_TOOLS_TEMPLATE):
an assistant message with `reasoning_content`, `content` and `tool_calls`, then the tool results in order."""
from nanoforge.core.errors import NanoforgeError
from nanoforge.chat.replies import Reply
from nanoforge.chat.calculator import BUILTIN_TOOLS, run_tool_call


def parse_tool_names(text: str | None) -> list[str]:
    """`--tools calculator[,NAME...]` -> the names, checked against the built-in tools ("" or None: none)."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in BUILTIN_TOOLS]
    if unknown:
        raise NanoforgeError(f"--tools: unknown tool {unknown[0]!r}; the built-in tools are "
                             f"{', '.join(sorted(BUILTIN_TOOLS))}")
    return list(dict.fromkeys(names))


def tool_schemas(names) -> list[dict] | None:
    """The OpenAI-format schemas of the named built-in tools, for the template's `tools` (None when none)."""
    return [BUILTIN_TOOLS[n] for n in names] or None


def assistant_message(reply: Reply) -> dict:
    """The reply as a history message: content, and reasoning_content / tool_calls when it has them."""
    return {"role": "assistant", "content": reply.content,
            **({"reasoning_content": reply.reasoning} if reply.reasoning is not None else {}),
            **({"tool_calls": reply.tool_calls} if reply.tool_calls else {})}


def tool_messages(reply: Reply, enabled) -> list[dict]:
    """One `tool` message per call of the reply, its content the tool's result (or "Error: ..." for a tool
    that is not enabled or bad arguments: a result the model can read, never an exception)."""
    return [{"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
             "content": run_tool_call(call, enabled)} for call in reply.tool_calls]
