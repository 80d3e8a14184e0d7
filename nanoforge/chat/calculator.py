"""The built-in calculator tool: a safe arithmetic evaluator, its schema in OpenAI's tool format, and
`run_tool_call`, which runs a parsed tool call against the enabled built-in tools.

Safety: the expression is parsed with `ast` and walked by `_Evaluator`, which knows only numbers, + - * / // %
**, unary + and -, parentheses, and the names in FUNCTIONS and CONSTANTS; all else is refused, and nothing is
passed to eval or exec. Sizes are bounded before any work: the expression's length, every intermediate's
magnitude (integers to MAX_DIGITS digits), a power's result (estimated from its logarithm), round's digits.
Every failure comes back as a string starting "Error: " (a tool result the model can read), never raised.

Results: an int stays an int; `/` gives an int when exact (GSM8K's `<<48/2=24>>` -> "24"), else a float; a
whole float prints as one ("5", not "5.0"), others with 12 significant digits."""
import ast
import json
import math
import operator

from nanoforge.core import safejson

MAX_LENGTH = 200
MAX_DIGITS = 100
_LIMIT = 10 ** MAX_DIGITS
MAX_ROUND_DIGITS = 15

CONSTANTS = {"pi": math.pi, "e": math.e}


def _round(x, ndigits=None):
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int) or abs(ndigits) > MAX_ROUND_DIGITS:
        raise CalculatorError(f"round's digits must be a whole number from -{MAX_ROUND_DIGITS} to "
                              f"{MAX_ROUND_DIGITS}")
    return round(x, ndigits)


def _log(x, base=None):
    return math.log(x) if base is None else math.log(x, base)


# name -> (function, fewest arguments, most arguments (None: any number))
FUNCTIONS = {
    "sqrt": (math.sqrt, 1, 1), "abs": (abs, 1, 1), "round": (_round, 1, 2), "min": (min, 1, None),
    "max": (max, 1, None), "floor": (math.floor, 1, 1), "ceil": (math.ceil, 1, 1), "log": (_log, 1, 2),
}

CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": ("Evaluate an arithmetic expression and return its value. Supports numbers, + - * / // % "
                        "** and parentheses, the functions sqrt, abs, round, min, max, floor, ceil, log and the "
                        f"constants pi and e. At most {MAX_LENGTH} characters."),
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression, e.g. (48 / 2) * 3"}},
            "required": ["expression"],
        },
    },
}


class CalculatorError(Exception):
    """An expression the calculator refuses or cannot compute; its message is the tool's answer."""


def evaluate(expression: str) -> str:
    """The value of `expression` as text, or "Error: ..." saying why there is none."""
    if not isinstance(expression, str):
        return f"Error: the expression must be a string, got {type(expression).__name__}"
    text = expression.strip()
    if not text:
        return "Error: the expression is empty"
    if len(text) > MAX_LENGTH:
        return f"Error: the expression is longer than {MAX_LENGTH} characters"
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return f"Error: not a valid arithmetic expression: {text[:60]!r}"
    try:
        return format_number(_Evaluator().visit(tree.body))
    except CalculatorError as e:
        return f"Error: {e}"
    except ZeroDivisionError:
        return "Error: division by zero"
    except (OverflowError, RecursionError, MemoryError):
        return "Error: the result is too large"
    except (ValueError, TypeError) as e:
        return f"Error: {e}"


def format_number(value) -> str:
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:.12g}"


def _checked(value):
    """`value` if it is a real number within the limits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"the result is not a real number ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is too large (or not a number)")
    if abs(value) >= _LIMIT:
        raise CalculatorError(f"a value has more than {MAX_DIGITS} digits")
    return value


def _divide(a, b):
    if b == 0:
        raise ZeroDivisionError
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return a / b


def _power(a, b):
    if a == 0 and b < 0:
        raise ZeroDivisionError
    if a != 0 and abs(a) != 1 and b * math.log10(abs(a)) > MAX_DIGITS:  # size from logs, before computing
        raise CalculatorError(f"the power has more than {MAX_DIGITS} digits")
    if isinstance(b, float) and a < 0 and not b.is_integer():
        raise CalculatorError("a negative number to a fractional power is not a real number")
    return a ** b


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _divide,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _power}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Evaluator:
    """Walks the expression's tree; any node it has no method for is refused."""

    def visit(self, node):
        method = getattr(self, "visit_" + type(node).__name__, None)
        if method is None:
            raise CalculatorError(f"{_describe(node)} is not allowed; only numbers, + - * / // % **, "
                                  f"parentheses, {', '.join(FUNCTIONS)} and {', '.join(CONSTANTS)}")
        return _checked(method(node))

    def visit_Constant(self, node):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"{node.value!r} is not a number")
        return node.value

    def visit_Name(self, node):
        if node.id not in CONSTANTS:
            raise CalculatorError(f"unknown name {node.id!r} (known constants: {', '.join(CONSTANTS)})")
        return CONSTANTS[node.id]

    def visit_BinOp(self, node):
        op = _BINARY.get(type(node.op))
        if op is None:
            hint = " (write ** for a power)" if isinstance(node.op, ast.BitXor) else ""
            raise CalculatorError(f"the operator {type(node.op).__name__} is not allowed{hint}")
        return op(self.visit(node.left), self.visit(node.right))

    def visit_UnaryOp(self, node):
        op = _UNARY.get(type(node.op))
        if op is None:
            raise CalculatorError(f"the operator {type(node.op).__name__} is not allowed")
        return op(self.visit(node.operand))

    def visit_Call(self, node):
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name not in FUNCTIONS:
            raise CalculatorError(f"only the functions {', '.join(FUNCTIONS)} may be called")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise CalculatorError(f"{name}() takes plain arguments only")
        function, fewest, most = FUNCTIONS[name]
        if len(node.args) < fewest or (most is not None and len(node.args) > most):
            count = str(fewest) if fewest == most else f"{fewest} or more" if most is None else f"{fewest}-{most}"
            raise CalculatorError(f"{name}() takes {count} arguments, got {len(node.args)}")
        return function(*[self.visit(a) for a in node.args])


def _describe(node) -> str:
    names = {"Attribute": "attribute access", "Subscript": "indexing", "Lambda": "a lambda",
             "ListComp": "a comprehension", "SetComp": "a comprehension", "DictComp": "a comprehension",
             "GeneratorExp": "a comprehension", "Compare": "a comparison", "BoolOp": "and/or",
             "Tuple": "a tuple (write numbers without thousands separators)"}
    return names.get(type(node).__name__, f"{type(node).__name__} ({ast.dump(node)[:40]})")


BUILTIN_TOOLS = {"calculator": CALCULATOR_SCHEMA}


def run_tool_call(call: dict, tools_enabled) -> str:
    """Run a parsed tool call (OpenAI's `{"function": {"name", "arguments"}}` or a bare `{"name",
    "arguments"}`, arguments a JSON string or an object) against the enabled built-in tools: the tool's result,
    or "Error: ..." for an unknown or disabled tool or bad arguments."""
    inner = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
    if not isinstance(inner, dict) or not isinstance(inner.get("name"), str):
        return "Error: a tool call needs a name"
    name, enabled = inner["name"], sorted(set(tools_enabled or ()) & set(BUILTIN_TOOLS))
    if name not in enabled:
        return f"Error: unknown tool {name!r} (available: {', '.join(enabled) or 'none'})"
    arguments = inner.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = safejson.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return f"Error: the arguments of {name!r} are not valid JSON ({e.msg})"
    if not isinstance(arguments, dict) or not isinstance(arguments.get("expression"), str):
        return f"Error: {name} needs the argument 'expression' (a string)"
    return evaluate(arguments["expression"])
