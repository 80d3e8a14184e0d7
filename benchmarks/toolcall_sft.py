"""Teach a tiny model to call the calculator, on CPU in minutes, and measure it (docs/tools.md has the results).

Data (written to WORK/data):
  - GSM8K's training problems ($NANOFORGE_DATA/gsm8k/train.jsonl, benchmarks/data_dir.py) as calculator conversations: every
    `<<48/2=24>>` annotation of a worked answer becomes a call `calculator {"expression": "48/2"}`, the tool's
    reply "24", and the assistant going on from there; the last turn ends with the `#### N` line. Problems
    whose annotations our calculator does not reproduce exactly are left out (and counted).
  - synthetic arithmetic "What is A op B?": with the calculator declared, the model calls it and answers
    "The answer is R."; without tools declared (a share of the records), it answers directly.
  - held-out synthetic prompts from another seed, both as SFT-shaped records (for `eval --toolcall`) and as
    {"question", "answer": "#### R"} (for `eval --gsm8k`, with and without `--tools calculator`).
Then: a tokenizer trained on the rendered training conversations (so the tools system turn is short), a
short pretraining of a 4-layer model on 40,000 copy texts (the question, the call's JSON, the result and the
answer, one per line: copying numbers in the contexts the conversations use; --pretrain-steps), `nanoforge sft`
for --sft-steps, and the evaluations (`--eval-only` runs just those, on WORK/run); docs/tools.md has the
figures (about 10 minutes on a 2-core CPU).

    python benchmarks/toolcall_sft.py --work /tmp/toolcall [--pretrain-steps 1500] [--sft-steps 600]
"""
from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from nanoforge.chat.template import THINKING_TOOLS_TEMPLATE, compile_template
from nanoforge.chat.calculator import CALCULATOR_SCHEMA, evaluate

from data_dir import data_path  # benchmarks/data_dir.py: NANOFORGE_DATA

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "You are a helpful assistant."
ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]+)>>")
OPS = ["+", "-", "*", "/"]


def gsm8k_conversation(question: str, answer: str) -> list[dict] | None:
    """A worked GSM8K answer as a calculator conversation, or None when an annotation does not reproduce."""
    turns = []
    messages = [{"role": "system", "content": SYSTEM, "tools": [CALCULATOR_SCHEMA]},
                {"role": "user", "content": question}]
    for match in ANNOTATION.finditer(answer):
        expression, expected = match.group(1).strip(), match.group(2).strip()
        result = evaluate(expression)
        if result.startswith("Error") or _number(result) != _number(expected):
            return None
        turns.append((match.start(), match.end(), expression, result))
    if not turns:
        return None
    start = 0
    for begin, end, expression, result in turns:  # the text up to the call, the call, its result
        messages.append({"role": "assistant", "content": answer[start:begin].rstrip(" "), "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]})
        messages.append({"role": "tool", "content": result})
        start = end
    messages.append({"role": "assistant", "content": answer[start:]})
    return messages


def _number(text: str) -> float | None:
    try:
        return round(float(text.replace(",", "")), 6)
    except ValueError:
        return None


def arithmetic(rng: random.Random) -> tuple[str, str]:
    """(expression, result) of a random two-operand problem; divisions are exact."""
    op = rng.choice(OPS)
    a, b = rng.randint(10, 999), rng.randint(2, 99)
    if op == "/":
        a = b * rng.randint(2, 99)
    expression = f"{a} {op} {b}"
    return expression, evaluate(expression)


def synthetic_conversation(expression: str, result: str, with_tools: bool) -> list[dict]:
    question = {"role": "user", "content": f"What is {expression}?"}
    answer = {"role": "assistant", "content": f"The answer is {result}."}
    if not with_tools:
        return [{"role": "system", "content": SYSTEM}, question, answer]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]}
    return [{"role": "system", "content": SYSTEM, "tools": [CALCULATOR_SCHEMA]}, question, call,
            {"role": "tool", "content": result}, answer]


def copy_texts(n: int, seed: int):
    """Short pretraining texts that teach copying numbers in the very contexts of the tool conversation: the
    question's operands into the call's JSON, the tool's result into the answer (digits are single tokens, so
    a copy is the same tokens again). A tiny model learns this induction far sooner from 40-token texts than
    from the 250-token tool conversations, whose system turn is the same every time."""
    rng = random.Random(seed)
    for _ in range(n):
        expression, result = arithmetic(rng)
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        yield {"text": f"What is {expression}?\n{call}\n{result}\nThe answer is {result}."}


def write_jsonl(path: Path, records) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
    return n


def build_data(out: Path, gsm8k_limit: int, synthetic: int, no_tool_share: float, held_out: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    conversations, dropped = [], 0
    with open(data_path("gsm8k/train.jsonl"), encoding="utf-8") as f:
        for line in f:
            if len(conversations) >= gsm8k_limit:
                break
            record = json.loads(line)
            conversation = gsm8k_conversation(record["question"], record["answer"])
            if conversation is None:
                dropped += 1
            else:
                conversations.append(conversation)
    rng = random.Random(0)
    for _ in range(synthetic):
        conversations.append(synthetic_conversation(*arithmetic(rng), with_tools=rng.random() >= no_tool_share))
    random.Random(1).shuffle(conversations)
    write_jsonl(out / "train.jsonl", ({"conversations": c} for c in conversations))
    write_jsonl(out / "copy.jsonl", copy_texts(40000, seed=2))
    template = compile_template(THINKING_TOOLS_TEMPLATE)  # the rendered text, for the tokenizer to learn
    write_jsonl(out / "rendered.jsonl", ({"text": template.render(messages=c, tools=c[0].get("tools"))}
                                         for c in conversations))
    held = random.Random(12345)
    problems = [arithmetic(held) for _ in range(held_out)]
    write_jsonl(out / "heldout_tools.jsonl", ({"conversations": synthetic_conversation(e, r, True)}
                                              for e, r in problems))
    write_jsonl(out / "heldout_gsm8k.jsonl", ({"question": f"What is {e}?", "answer": f"#### {r}"}
                                              for e, r in problems))
    return {"gsm8k": len(conversations) - synthetic, "gsm8k_dropped": dropped, "synthetic": synthetic}


def nanoforge(*args: str) -> str:
    started = time.time()
    print("$ nanoforge " + " ".join(args), flush=True)
    result = subprocess.run([sys.executable, "-m", "nanoforge.cli", *args], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    print(f"  ({time.time() - started:.0f} s)", flush=True)
    return result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/toolcall")
    parser.add_argument("--gsm8k-limit", type=int, default=300)
    parser.add_argument("--synthetic", type=int, default=4000)
    parser.add_argument("--no-tool-share", type=float, default=0.3)
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--d-model", default="128")
    parser.add_argument("--n-layers", default="4", help="induction (copying) wants more than the preset's 2")
    parser.add_argument("--seq-len", default="512")
    parser.add_argument("--pretrain-steps", type=int, default=1500)
    parser.add_argument("--pretrain-batch", default="16", help="copy texts: 16 x 256 tokens a step")
    parser.add_argument("--eval-only", action="store_true")
    args = parser.parse_args()
    work = Path(args.work)
    if not args.eval_only:
        train(work, args)
    run_evals(work)


def train(work: Path, args) -> None:
    counts = build_data(work / "data", args.gsm8k_limit, args.synthetic, args.no_tool_share, args.held_out)
    print("data:", counts, flush=True)
    data = work / "data"
    nanoforge("tokenizer", "train", "--data", str(data / "rendered.jsonl"), "--vocab-size", str(args.vocab_size),
              "--out", str(work / "tok"))
    nanoforge("prepare", "--kind", "sft", "--data", str(data / "train.jsonl"), "--tokenizer", str(work / "tok"),
              "--out", str(work / "sft"))
    nanoforge("prepare", "--kind", "pretrain", "--data", str(data / "copy.jsonl"), "--tokenizer",
              str(work / "tok"), "--out", str(work / "pre"))
    nanoforge("pretrain", "--preset", args.preset, "--data", str(work / "pre"), "--out", str(work / "init"),
              "--max-steps", str(args.pretrain_steps), "--seq-len", "256", "--max-seq-len", args.seq_len,
              "--batch-size", args.pretrain_batch, "--d-model", args.d_model, "--n-layers", args.n_layers,
              "--eval-every", "0", "--save-every", "0", "--sample-every", "0")
    nanoforge("sft", "--init", str(work / "init"), "--data", str(work / "sft"), "--out", str(work / "run"),
              "--max-steps", str(args.sft_steps), "--lr", "3e-3", "--warmup-steps", "50", "--seq-len", args.seq_len,
              "--batch-size", "8", "--eval-every", "0", "--save-every", "0", "--sample-every", "0")


def run_evals(work: Path) -> None:
    run, data = str(work / "run"), work / "data"
    short = ["--max-new-tokens", "64"]  # room in the 512-token context for the tool result's round
    print(nanoforge("eval", run, "--toolcall", str(data / "heldout_tools.jsonl"), *short))
    print(nanoforge("eval", run, "--gsm8k", str(data / "heldout_gsm8k.jsonl"), "--tools", "calculator", *short))
    print(nanoforge("eval", run, "--gsm8k", str(data / "heldout_gsm8k.jsonl"), *short))


if __name__ == "__main__":
    main()
