"""Rendering one SFT record for `prepare` (data/chunks.py): the tokenizer's chat template with the record's
tools, refusing a template that would silently drop its tool calls or results, and the seeded choice of the
records whose empty think blocks are left out (`prepare --drop-empty-think P`)."""
import hashlib

from nanoforge.chat.template import ChatTemplateError
from nanoforge.chat.messages import has_tool_calls

# Fixed: which records drop their empty think blocks depends only on P, the file's index and the line.
DROP_THINK_SEED = 16

NO_TOOL_SUPPORT = ("the tokenizer's chat template has no tool support: it would render this record without its "
                   "{what}; use a tokenizer whose template renders MiniMind-3's tool format (one written by "
                   "`nanoforge tokenizer train`, or MiniMind-3's tokenizer)")


def drops_empty_think(share: float, file_index: int, line_no: int) -> bool:
    """Whether the record at (file_index, line_no) is one of the seeded `share` rendered without empty think
    blocks: a hash of the place, so the same for any number of workers and every run."""
    if share <= 0:
        return False
    digest = hashlib.sha256(f"{DROP_THINK_SEED}:{file_index}:{line_no}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < share


def render_sft_record(tokenizer, conversation: list, drop_empty_think: bool = False):
    """(ids, mask, text) of one conversation, ids and mask as arrays; ChatTemplateError when it cannot be rendered
    faithfully."""
    calls, results = any(has_tool_calls(m) for m in conversation), any(m.get("role") == "tool" for m in conversation)
    what = " and ".join(w for w, used in (("tool calls", calls), ("tool results", results)) if used)
    try:
        ids, mask, text = tokenizer.render_chat_arrays(conversation, drop_empty_think=drop_empty_think)
    except ChatTemplateError as e:
        if what and not tokenizer.supports_tools:
            raise ChatTemplateError(NO_TOOL_SUPPORT.format(what=what)) from e
        raise
    if (calls and "<tool_call>" not in text) or (results and "<tool_response>" not in text):
        raise ChatTemplateError(NO_TOOL_SUPPORT.format(what=what))
    return ids, mask, text
