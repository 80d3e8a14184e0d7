"""The one decoder for JSON from outside (data files, request bodies, tool arguments, a model's replies).
Python's json recurses once per nesting level (`[[[[...` a thousand deep: RecursionError) and int() refuses over
4,300 digits (a bare ValueError); `loads` refuses both up front as a json.JSONDecodeError at the place, so each
reader's handling of malformed JSON (a 400 naming the field, `file:line:`, an "Error: ..." for the model) covers
them. Imports nothing of nanoforge."""
import json
import re

MAX_DEPTH = 100  # arrays and objects inside each other; records and tool schemas need a handful
MAX_INT_DIGITS = 4300  # Python's own limit for int("...")
_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def loads(text: str | bytes, **options):
    """json.loads(text, **options), with nesting over MAX_DEPTH or an integer of over MAX_INT_DIGITS digits
    refused like malformed JSON."""
    if isinstance(text, (bytes, bytearray)):
        text = text.decode(json.detect_encoding(text), "surrogatepass")  # as json.loads decodes bytes
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(text) if text.count("[") + text.count("{") > MAX_DEPTH else ():
        depth += (match[0] in "[{") - (match[0] in "]}")  # a string token is never one of those
        if depth > MAX_DEPTH:
            raise json.JSONDecodeError(f"nested deeper than {MAX_DEPTH} levels", text, match.start())

    def parse_int(digits: str) -> int:
        if len(digits) - digits.startswith("-") > MAX_INT_DIGITS:
            raise json.JSONDecodeError(f"a number of {len(digits) - digits.startswith('-')} digits (the limit is "
                                       f"{MAX_INT_DIGITS})", text, text.find(digits))
        return int(digits)
    return json.loads(text, parse_int=parse_int, **options)
