"""Multiple-choice benchmarks: does the model pick the right answer? Accuracy per subject, 95% CI, chance.

Multiple choice is scored the way small base models are usually scored (lm-evaluation-harness's
"acc"/"acc_norm"; GPT-3 paper, arXiv 2005.14165, sec. 2.4): each option's text is appended to a plain-text
prompt and its log-likelihood under the model is computed; the option with the highest one is the model's
answer. See docs/evaluation.md for the formats and why length-normalised scoring is the headline number."""
from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from nanoforge.data.batches import IGNORE
from nanoforge.data.jsonl import DataError, check_input_file
from nanoforge.core.device import autocast_context, eval_mode, resolve_precision
from nanoforge.core.errors import NanoforgeError
from nanoforge.eval.common import Progress, format_table, json_lines, load_run

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
Z95 = 1.959963984540054  # two-sided 95% normal quantile


@dataclass
class Question:
    question: str
    choices: list[str]
    answer: int  # index into choices
    subject: str = "all"
    where: str = ""  # file:line, for messages


def _answer_index(value, n_choices: int, path, line: int, letters_only: bool, name: str = "answer") -> int:
    """An answer as a 0-based index (JSONL only) or a letter A, B, ... -> index; else a DataError naming `name`."""
    if isinstance(value, bool):
        value = None
    if isinstance(value, int) and not letters_only:
        if not 0 <= value < n_choices:
            raise DataError(f"index {value} is out of range for {n_choices} choices (0..{n_choices - 1})",
                            path, line, name)
        return value
    if isinstance(value, str) and len(value.strip()) == 1 and value.strip().upper() in LETTERS[:n_choices]:
        return LETTERS.index(value.strip().upper())
    allowed = ", ".join(LETTERS[:n_choices])
    if letters_only and value == "":
        raise DataError(f"is empty; it must be one of {allowed} (C-Eval's test split has no public answers: "
                        "evaluate its val split)", path, line, name)
    raise DataError(f"{value!r} is not one of {allowed}" + ("" if letters_only else f" or an index 0..{n_choices - 1}"),
                    path, line, name)


def read_choices_jsonl(path) -> list[Question]:
    """`{"question": str, "choices": [str, ...], "answer": index or letter, "subject"?: str}` per line."""
    path = check_input_file(path)
    out = []
    for line_no, obj in json_lines(path):
        if not isinstance(obj, dict):
            raise DataError("a record must be a JSON object", path, line_no)
        q, choices = obj.get("question"), obj.get("choices")
        if not isinstance(q, str) or not q.strip():
            raise DataError("missing or not a non-empty string", path, line_no, '"question"')
        if not isinstance(choices, list) or len(choices) < 2:
            raise DataError("must be a list of at least 2 strings", path, line_no, '"choices"')
        for i, c in enumerate(choices):
            if not isinstance(c, str) or not c.strip():
                raise DataError("must be a non-empty string", path, line_no, f'"choices"[{i}]')
        if "answer" not in obj:
            raise DataError("missing", path, line_no, '"answer"')
        answer = _answer_index(obj["answer"], len(choices), path, line_no, letters_only=False, name='"answer"')
        subject = obj.get("subject", "all")
        if not isinstance(subject, str) or not subject:
            raise DataError("must be a non-empty string", path, line_no, '"subject"')
        out.append(Question(q, list(choices), answer, subject, f"{path}:{line_no}"))
    if not out:
        raise DataError("has no questions", path)
    return out


def read_choices_csv(path) -> list[Question]:
    """One C-Eval / CMMLU subject file: a header naming question, A, B, C, D and answer (any case; other
    columns such as id or explanation are ignored), one question per row. Subject = file stem without a
    _dev/_val/_test suffix."""
    path = Path(path)
    subject = re.sub(r"_(dev|val|test)$", "", path.stem)
    out = []
    try:
        f = open(path, encoding="utf-8-sig", newline="")
    except OSError as e:
        raise DataError(f"cannot be read: {e.strerror}", path) from None
    with f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None:
                raise DataError("is empty (expected a header row: id,question,A,B,C,D,answer)", path, 1)
            names = [h.strip().lower() for h in header]
            need = ["question", "a", "b", "c", "d", "answer"]
            if missing := [n for n in need if n not in names]:
                raise DataError(f"header {header} lacks column(s) {', '.join(missing)}; expected "
                                "id,question,A,B,C,D,answer", path, 1, "header")
            col = {n: names.index(n) for n in need}
            start = reader.line_num + 1
            for row in reader:
                line, start = start, reader.line_num + 1
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != len(header):
                    raise DataError(f"has {len(row)} columns but the header has {len(header)} "
                                    f"({','.join(header)}); is a comma inside a field not quoted?",
                                    path, line, "columns")
                q = row[col["question"]].strip()
                if not q:
                    raise DataError("is empty", path, line, "question")
                choices = [row[col[k]].strip() for k in "abcd"]
                for k, c in zip("ABCD", choices):
                    if not c:
                        raise DataError("is empty", path, line, k)
                answer = _answer_index(row[col["answer"]].strip(), 4, path, line, letters_only=True)
                out.append(Question(q, choices, answer, subject, f"{path}:{line}"))
        except csv.Error as e:
            raise DataError(f"malformed CSV: {e}", path, reader.line_num) from None
        except UnicodeDecodeError as e:
            raise DataError(f"not UTF-8 text: {e}", path) from None
    if not out:
        raise DataError("has no questions", path)
    return out


def load_benchmark(bench_path, fmt: str = "auto", dev_path=None) -> tuple[list[Question], list[Question]]:
    """(questions, dev examples for k-shot) from a JSONL file, a CSV file, or a C-Eval/CMMLU directory.

    Directories: CSV files directly inside are one subject each; otherwise the benchmark's layout is used,
    C-Eval `val/` (its `test/` has no public answers) and CMMLU `test/`, with `dev/` beside them for shots."""
    bench_path = Path(bench_path)
    if fmt not in ("auto", "jsonl", "ceval", "cmmlu", "csv"):
        raise NanoforgeError(f"--format {fmt!r} must be one of auto, jsonl, ceval, cmmlu, csv")
    if not bench_path.exists():
        raise NanoforgeError(f"{bench_path}: no such benchmark file or directory")
    if fmt == "auto":
        fmt = "jsonl" if bench_path.is_file() and bench_path.suffix == ".jsonl" else "csv"

    def read_any(path: Path) -> list[Question]:
        if path.is_file():
            return read_choices_jsonl(path) if path.suffix == ".jsonl" else read_choices_csv(path)
        files = sorted(path.glob("*.csv"))
        if not files:
            raise NanoforgeError(f"{path}: no .csv files in this directory")
        return [q for p in files for q in read_choices_csv(p)]

    if fmt == "jsonl":
        if bench_path.is_dir():
            raise NanoforgeError(f"{bench_path}: a directory; --format jsonl takes one .jsonl file")
        return read_choices_jsonl(bench_path), (read_choices_jsonl(dev_path) if dev_path else [])
    if bench_path.is_file() or any(bench_path.glob("*.csv")):
        questions_dir, dev_dir = bench_path, None
    else:
        wanted = {"ceval": ["val"], "cmmlu": ["test"]}.get(fmt, ["val", "test"])
        found = [bench_path / w for w in wanted if (bench_path / w).is_dir()]
        if not found:
            raise NanoforgeError(f"{bench_path}: no CSV files and no {' or '.join(w + '/' for w in wanted)} "
                                 f"subfolder (C-Eval: dev/ val/ test/; CMMLU: dev/ test/)")
        questions_dir = found[0]
        dev_dir = bench_path / "dev" if (bench_path / "dev").is_dir() else None
    dev_source = Path(dev_path) if dev_path else dev_dir
    return read_any(questions_dir), (read_any(dev_source) if dev_source else [])


def build_prompt(question: str, shots: Sequence[Question] = ()) -> str:
    """Plain-text continuation prompt (no chat template: the format a base model can complete), which the
    option being scored follows as " <option text>":

        Question: <shot question>
        Answer: <shot's correct option>

        Question: <question>
        Answer:"""
    parts = [f"Question: {s.question}\nAnswer: {s.choices[s.answer]}" for s in shots]
    parts.append(f"Question: {question}\nAnswer:")
    return "\n\n".join(parts)


def pick_shots(q: Question, dev: Sequence[Question], shots: int) -> list[Question]:
    """The first `shots` dev examples of the question's subject (or of any subject when the dev set has none
    for it), never the question itself."""
    if shots <= 0 or not dev:
        return []
    same = [d for d in dev if d.subject == q.subject and d.question != q.question]
    return (same or [d for d in dev if d.question != q.question])[:shots]


def padded_batch(rows: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), both (B, T), of (input ids, label ids) rows right-padded to the longest with 0 and IGNORE."""
    T = max(len(x) for x, _ in rows)
    inputs = torch.zeros(len(rows), T, dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for r, (x, y) in enumerate(rows):
        inputs[r, :len(x)] = torch.as_tensor(x)
        labels[r, :len(y)] = torch.as_tensor(y)
    return inputs.to(device), labels.to(device)


def _option_logprobs(model, sequences: list[tuple[list[int], list[int]]], batch_size: int, device,
                     precision: str, progress: Progress) -> list[float]:
    """Sum of log p(option tokens | context) for each (context ids, option ids). Sequences longer than the
    model's window lose their oldest context tokens (the option is always kept whole when it fits)."""
    window = model.context_length  # the most positions the model attends over
    prepared = []
    for ctx, opt in sequences:
        opt = opt[:window - 1]
        ctx = ctx[-(window - len(opt)):]
        prepared.append((ctx + opt[:-1], [IGNORE] * (len(ctx) - 1) + opt))  # only the option's tokens are scored
    order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0]))  # similar lengths together
    out = [0.0] * len(prepared)
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        inputs, labels = padded_batch([prepared[i] for i in idx], device)
        with torch.no_grad(), autocast_context(device, precision):
            logits = model(inputs)  # (B, T, V)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
        picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
        sums = (picked * (labels != IGNORE)).sum(dim=1).double().cpu().tolist()
        for r, i in enumerate(idx):
            out[i] = sums[r]
        progress.update(b + len(idx))
    return out


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (Wilson 1927): unlike p +- z*sqrt(p(1-p)/n) it stays
    inside [0, 1] and is honest for small n and for p near 0 or 1, which small benchmarks often are."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _summary(items: list[dict]) -> dict:
    n = len(items)
    correct = sum(i["correct_norm"] for i in items)
    correct_sum = sum(i["correct_sum"] for i in items)
    return {"n": n, "acc": correct / n, "ci95": list(wilson_interval(correct, n)),
            "acc_sum": correct_sum / n, "ci95_sum": list(wilson_interval(correct_sum, n)),
            "chance": sum(1 / i["n_choices"] for i in items) / n}


def evaluate_choices(run, bench_path, fmt: str = "auto", shots: int = 0, dev_path=None, batch_size: int = 16,
                     limit: int | None = None, precision: str = "fp32", device: str = "auto",
                     progress: bool = True, log: Callable[[str], None] = print, return_items: bool = False) -> dict:
    """Accuracy of `run` (or a loaded (model, tokenizer) pair) on a multiple-choice benchmark, per subject and
    overall, with 95% Wilson intervals. Each option is scored by its log-likelihood after `build_prompt(question,
    shots)`: "acc" (the primary rule) picks the highest per UTF-8 byte of the option text, "acc_sum" the highest
    total. Per byte, because a total favours short options (every extra token costs probability) and bytes,
    unlike tokens, do not depend on the tokenizer (lm-evaluation-harness's acc_norm). shots > 0 prepends that
    many solved examples of the same subject from the dev split (C-Eval/CMMLU dev/, or `dev_path`). limit keeps
    the first N questions (a quick look)."""
    precision = resolve_precision(precision, device)  # a bad one fails before the model loads
    questions, dev = load_benchmark(bench_path, fmt, dev_path)
    if shots and not dev:
        raise NanoforgeError(f"--shots {shots} needs solved examples: a dev/ folder beside the benchmark's "
                             f"questions, or --dev FILE")
    questions = questions[:limit]  # limit None: all
    model, tokenizer, dev_device, ckpt = load_run(run, device)

    prompts = [build_prompt(q.question, pick_shots(q, dev, shots)) for q in questions]
    sequences, spans = [], []  # (context ids, option ids) per option; each question's options' [start, end)
    cap = (model.context_length + 1) * tokenizer.max_token_chars  # more characters: more tokens than the window
    for q, prompt in zip(questions, prompts):
        ctx = tokenizer.encode(prompt[-cap:])  # whose oldest would be cut anyway: memory bounded by the window
        spans.append((len(sequences), len(sequences) + len(q.choices)))
        # the separating space goes with the option: byte-level BPE attaches a space to the following
        # word, so "Answer:" + " Paris" tokenizes as the model saw such text in training
        sequences += [(ctx, tokenizer.encode((" " + c)[:cap])) for c in q.choices]
    bar = Progress(progress, "options scored", len(sequences))
    with eval_mode(model):
        logprobs = _option_logprobs(model, sequences, batch_size, dev_device, precision, bar)
    bar.close()

    items = []
    for q, (a, b) in zip(questions, spans):
        lp = logprobs[a:b]
        per_byte = [v / max(len(c.encode("utf-8")), 1) for v, c in zip(lp, q.choices)]
        pred_norm, pred_sum = int(np.argmax(per_byte)), int(np.argmax(lp))
        items.append({"where": q.where, "subject": q.subject, "answer": q.answer, "n_choices": len(q.choices),
                      "logprob": lp, "pred": pred_norm, "pred_sum": pred_sum,
                      "correct_norm": pred_norm == q.answer, "correct_sum": pred_sum == q.answer})
    subjects = {s: _summary([i for i in items if i["subject"] == s]) for s in sorted({i["subject"] for i in items})}
    overall = _summary(items)
    result = {"benchmark": str(bench_path), "format": fmt, "shots": shots, "primary": "acc (log-likelihood per byte)",
              "checkpoint": str(ckpt) if ckpt else None, "overall": overall, "subjects": subjects,
              "prompt_example": prompts[0] + " " + questions[0].choices[questions[0].answer]}
    if return_items:
        result["items"] = items

    def row(name, s):
        return [name, s["n"], f"{s['acc']:.3f}", f"[{s['ci95'][0]:.3f}, {s['ci95'][1]:.3f}]",
                f"{s['acc_sum']:.3f}", f"{s['chance']:.3f}"]
    table = [row(k, v) for k, v in subjects.items()]
    if len(subjects) > 1:
        table.append(row("overall", overall))
    log(format_table(["subject", "n", "acc", "95% CI", "acc_sum", "chance"], table))
    return result
