"""chat/calculator.py: arithmetic as GSM8K writes it, every refusal a readable error string and quick."""
import json
import re
import time

import pytest

from nanoforge.chat.calculator import CALCULATOR_SCHEMA, MAX_LENGTH, evaluate, run_tool_call


@pytest.mark.parametrize("expression,want", [
    ("48/2", "24"), ("7/2", "3.5"), ("2.5*2", "5"), ("1+2*3", "7"), ("(1+2)*3", "9"), ("-3 + +4", "1"),
    ("17//5", "3"), ("17 % 5", "2"), ("2**10", "1024"), ("10/3", "3.33333333333"), ("0.1+0.2", "0.3"),
    ("sqrt(16)", "4"), ("abs(-2.5)", "2.5"), ("round(3.14159, 2)", "3.14"), ("round(2.6)", "3"),
    ("min(3, 1, 2)", "1"), ("max(3, 1, 2)", "3"), ("floor(2.7) + ceil(2.1)", "5"), ("round(pi, 4)", "3.1416"),
    ("log(e)", "1"), ("2**0.5", "1.41421356237"), ("10**99", "1" + "0" * 99), ("10**20/4", "25" + "0" * 18),
    (" 5 ", "5"),
])
def test_values(expression, want):
    assert evaluate(expression) == want


def test_gsm8k_annotations_evaluate_to_their_answers():
    # calculator annotations as GSM8K writes them: <<expression=result>>
    text = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May. 48+24 = <<48+24=72>>72 in total. "
            "<<12/60=0.2>> <<0.2*50=10>> <<5*3.5=17.5>> <<1000-800-150=50>> <<100*.8=80>> <<3/4*100=75>>")
    annotations = re.findall(r"<<([^=<>]+)=([^<>]+)>>", text)
    assert len(annotations) == 8
    for expression, result in annotations:
        assert evaluate(expression) == result, expression


@pytest.mark.parametrize("expression,why", [
    ("__import__('os')", "only the functions"), ("__import__('os').system('true')", "only the functions"),
    ("(1).real", "attribute access"), ("x + 1", "unknown name"), ("lambda: 1", "lambda"),
    ("[i for i in (1, 2)]", "comprehension"), ("(i for i in (1,))", "comprehension"), ("'a' * 3", "not a number"),
    ("1 < 2", "comparison"), ("True + 1", "not a number"), ("1j", "not a number"), ("2 ^ 3", "write **"),
    ("sqrt(x=4)", "plain arguments"), ("min()", "arguments"), ("round(1, 2, 3)", "arguments"),
    ("1/0", "division by zero"), ("5 // 0", "division by zero"), ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"), ("sqrt(-1)", "math domain"), ("(-8) ** (1/3)", "not a real number"),
    ("9**9**9", "digits"), ("2**1000", "the power has"), ("10**100", "digits"), ("0.5 ** -1000", "the power has"),
    ("99999999999**99999999999", "digits"), ("1e308 * 10", "digits"), ("1e99 * 1e99", "digits"), ("1" * 101, "digits"),
    ("round(1, 10**6)", "round's digits"), ("1,000", "thousands"), ("", "empty"), ("1 +", "not a valid"),
    ("1" + "+1" * MAX_LENGTH, "longer than"), ("(" * 150 + "1" + ")" * 150, "longer than"),
    ("(" * 99 + "1" + ")" * 99, ""), ("a.b[0]", "not allowed"), ("{1: 2}", "not allowed"),
])
def test_refusals_are_quick_error_strings(expression, why):
    started = time.perf_counter()
    result = evaluate(expression)
    assert time.perf_counter() - started < 0.5
    if expression.startswith("(" * 99):  # deep but short: a value or an error, never an exception
        assert result in ("1",) or result.startswith("Error: ")
        return
    assert result.startswith("Error: ") and why in result, result


def test_not_a_string():
    assert evaluate(12).startswith("Error: ")


def test_schema_is_openai_shaped():
    function = CALCULATOR_SCHEMA["function"]
    assert CALCULATOR_SCHEMA["type"] == "function" and function["name"] == "calculator"
    assert function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"
    json.dumps(CALCULATOR_SCHEMA)


def test_run_tool_call():
    openai = {"id": "call_0", "type": "function",
              "function": {"name": "calculator", "arguments": '{"expression": "48/2"}'}}
    assert run_tool_call(openai, {"calculator"}) == "24"
    assert run_tool_call({"name": "calculator", "arguments": {"expression": "2*3"}}, ["calculator"]) == "6"
    assert run_tool_call(openai, set()).startswith("Error: unknown tool 'calculator'")
    assert "unknown tool 'weather'" in run_tool_call({"name": "weather", "arguments": {}}, {"calculator"})
    assert "not valid JSON" in run_tool_call({"name": "calculator", "arguments": "{bad"}, {"calculator"})
    assert run_tool_call({"name": "calculator", "arguments": "[" * 1000}, {"calculator"}) == \
        "Error: the arguments of 'calculator' are not valid JSON (nested deeper than 100 levels)"
    assert "'expression'" in run_tool_call({"name": "calculator", "arguments": {"expr": "1"}}, {"calculator"})
    assert run_tool_call({"arguments": {}}, {"calculator"}).startswith("Error: ")
    assert run_tool_call({"name": "calculator", "arguments": {"expression": "1/0"}}, {"calculator"}) == \
        "Error: division by zero"
