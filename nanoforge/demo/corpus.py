"""The corpus of `nanoforge demo`: the documentation of 52 well-known pure-Python standard-library modules
(json, os, shutil, textwrap, statistics, ...), written by their authors, not by us: their docstrings, read with
`ast` from the .py files (nothing is imported). It becomes:

    pretraining  {"text": "textwrap.fill(text, width=70, **kwargs)\\n\\nFill a single paragraph of text, ..."}
    SFT          {"conversations": [{"role": "user", "content": "What does textwrap.fill do?"},
                                    {"role": "assistant", "content": "Fill a single paragraph of text, ..."}]}
                 {"conversations": [{"role": "user", "content": "How do I call textwrap.fill?"},
                                    {"role": "assistant", "content": "textwrap.fill(text, width=70, **kwargs)"}]}

and the questions asked at the end (IN_SET, HELD_OUT)."""
from __future__ import annotations

import ast
import json
import os
import re
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from nanoforge.core.errors import NanoforgeError

# Standard-library directories that are not library documentation: tests, the IDLE and turtle demo apps,
# pip's bundled wheels, installed third-party packages, build configuration.
STDLIB_SKIP_DIRS = {"test", "tests", "idlelib", "turtledemo", "ensurepip", "site-packages", "lib-dynload",
                    "lib2to3", "__pycache__"}
# The modules (with their submodules) whose docstrings are the corpus: ~450 KB, 1,430 documents, 2,038
# questions with answers on Python 3.11 (posixpath is os.path). The whole standard library (4.6 MB with the
# reference topics) is more than a million parameters take in within three minutes: read once, little sticks;
# read ten times over, the names, signatures and first sentences do, and SFT can ask for them.
DEMO_MODULES = ("json", "os", "posixpath", "shutil", "glob", "fnmatch", "tempfile", "pathlib", "textwrap",
                "string", "re", "difflib", "heapq", "bisect", "copy", "statistics", "fractions", "random",
                "calendar", "datetime", "base64", "csv", "gzip", "zipfile", "tarfile", "collections",
                "functools", "operator", "contextlib", "argparse", "subprocess", "html", "urllib", "logging",
                "typing", "inspect", "threading", "configparser", "traceback", "ipaddress", "uuid", "pprint",
                "enum", "dataclasses", "abc", "numbers", "socket", "queue", "shlex", "locale", "platform", "timeit")
MIN_ANSWER_CHARS, MAX_ANSWER_CHARS = 15, 160  # a first sentence outside these is not an SFT answer
MAX_SIGNATURE_CHARS = 100  # "How do I call X?" is asked only about functions with a signature this short

# Asked at the end: (name, "what" | "call"). IN_SET questions are in the SFT set, so the expected reply is
# their answer exactly. Nothing about a HELD_OUT name is in the SFT set (its docstring is in pretraining only):
# a reply shows what SFT taught the model to do with what pretraining put there.
IN_SET = (("json.loads", "what"), ("shutil.rmtree", "what"), ("os.walk", "what"), ("heapq.heappush", "what"),
          ("statistics.mean", "what"), ("textwrap.wrap", "what"), ("calendar.isleap", "what"),
          ("copy.deepcopy", "what"), ("textwrap.fill", "call"), ("bisect.bisect_left", "call"),
          ("tempfile.mkdtemp", "call"), ("difflib.get_close_matches", "call"), ("shutil.move", "call"))
HELD_OUT = (("json.dumps", "what"), ("textwrap.dedent", "what"), ("statistics.median", "what"),
            ("shutil.copyfile", "call"), ("heapq.nlargest", "call"), ("glob.glob", "call"))


@dataclass(frozen=True)
class DocEntry:
    """One documented thing: `name` is qualified (json.JSONEncoder.encode), `signature` the unparsed
    arguments without self/cls ("" for modules and properties), `doc` the cleaned docstring."""
    name: str
    kind: str  # module | class | function
    signature: str
    doc: str


def python_files(root: Path, package: str, skip_dirs: set[str]) -> Iterator[tuple[str, Path]]:
    """(dotted module name, path) of every public .py file under root, in sorted order (deterministic)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith((".", "_"))
                             and not d.startswith("config-"))
        rel = Path(dirpath).relative_to(root).parts
        for filename in sorted(filenames):
            if not filename.endswith(".py") or (filename.startswith("_") and filename != "__init__.py"):
                continue
            stem = filename[:-3]
            parts = ([package] if package else []) + list(rel) + ([] if stem == "__init__" else [stem])
            if parts:
                yield ".".join(parts), Path(dirpath) / filename


def module_docs(module: str, source: str) -> list[DocEntry]:
    """Docstrings of a module, its public classes and functions, and their public methods (not nested
    functions: those are implementation details). Source that does not parse gives nothing."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # e.g. files written for another Python version
        return []
    doc = ast.get_docstring(tree)
    out = [DocEntry(module, "module", "", doc)] if doc else []
    for node in tree.body:
        out.extend(_definition_docs(node, module, in_class=False))
    return out


def _definition_docs(node: ast.AST, prefix: str, in_class: bool) -> list[DocEntry]:
    if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
        return []
    name = f"{prefix}.{node.name}"
    out = []
    doc = ast.get_docstring(node)
    if isinstance(node, ast.ClassDef):
        if doc:
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            out.append(DocEntry(name, "class", _signature(init, True) if init else "", doc))
        for child in node.body:
            out.extend(_definition_docs(child, name, in_class=True))
    elif doc:
        out.append(DocEntry(name, "function", _signature(node, in_class), doc))
    return out


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef, in_class: bool) -> str:
    decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
    if "property" in decorators:
        return ""
    args = node.args
    if in_class and "staticmethod" not in decorators:
        positional = args.posonlyargs + args.args
        if positional and positional[0].arg in ("self", "cls", "mcls", "metacls"):
            args = ast.arguments(posonlyargs=args.posonlyargs[1:],
                                 args=args.args[1:] if not args.posonlyargs else args.args,
                                 vararg=args.vararg, kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults,
                                 kwarg=args.kwarg, defaults=args.defaults)
    return f"({ast.unparse(args)})"


def argument_names(signature: str) -> list[str]:
    """["src", "dst", "follow_symlinks"] for "(src, dst, *, follow_symlinks=True)"."""
    if not signature:
        return []
    args = ast.parse(f"def f{signature}: pass").body[0].args
    return [a.arg for a in args.posonlyargs + args.args + [args.vararg] + args.kwonlyargs + [args.kwarg] if a]


def collect_docs(modules: tuple[str, ...] = DEMO_MODULES) -> list[DocEntry]:
    """Every documented entry of the standard-library `modules` (and their submodules), in walk order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    entries, seen = [], set()
    for module, path in python_files(stdlib, "", STDLIB_SKIP_DIRS):
        if module.split(".")[0] not in modules:
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for entry in module_docs(module, source):
            if (entry.name, entry.doc) not in seen:  # the same module found twice
                seen.add((entry.name, entry.doc))
                entries.append(entry)
    return entries


def pretrain_text(entry: DocEntry) -> str:
    """How an entry reads in pretraining: the name as one would call it, a blank line, the documentation."""
    head = {"module": f"module {entry.name}", "class": f"class {entry.name}{entry.signature}"}.get(
        entry.kind, f"{entry.name}{entry.signature}")
    return f"{head}\n\n{entry.doc}"


def first_sentence(doc: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """The docstring's first sentence on one line, if it makes a short prose answer; else None.

    A sentence ends at a period before a capital letter or the paragraph's end ("e.g." ends none). One that
    is a signature ("makedirs(name [, mode=0o777])"), a doctest or reST markup answers no "what does it do?"."""
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    end = re.search(r"(?<!\be\.g)(?<!\bi\.e)\.(?=\s+[A-Z(`'\"]|$)", paragraph)
    sentence = paragraph[:end.end()] if end else ""
    if not MIN_ANSWER_CHARS <= len(sentence) <= max_chars or not sentence[0].isalpha():
        return None
    if any(mark in sentence for mark in (">>>", "::", "|", "{", "==")) or re.match(r"[\w.]+\(", sentence):
        return None
    return sentence


_WHAT = {"function": "What does {} do?", "class": "What is {}?", "module": "What is the {} module?"}


def qa_pairs(entry: DocEntry) -> dict[str, tuple[str, str]]:
    """The questions about one entry, by kind, each with its answer: "what" answered by the docstring's first
    sentence, and for a function with a short signature, "call" ("How do I call X?") answered by it."""
    out = {}
    if answer := first_sentence(entry.doc):
        out["what"] = (_WHAT[entry.kind].format(entry.name), answer)
    if entry.kind == "function" and 2 < len(entry.signature) <= MAX_SIGNATURE_CHARS:
        out["call"] = (f"How do I call {entry.name}?", entry.name + entry.signature)
    return out


def build_demo_corpus(out_dir: str | os.PathLike, sft_size: int = 1000,
                      modules: tuple[str, ...] = DEMO_MODULES) -> tuple[Path, Path, list[dict]]:
    """Write pretrain.jsonl and sft.jsonl into out_dir; return their paths and the questions to ask at the end
    (asked_questions). The SFT set is the asked IN_SET pairs plus a fixed choice of others, sft_size in all,
    none about a HELD_OUT name. The asked names' documents and conversations come first in their files:
    `prepare` sends records 49, 99, ... to validation, and these must be trained on. The output is identical
    on every run on the same machine (sorted walk, no randomness)."""
    entries = collect_docs(modules)
    if not entries:
        raise NanoforgeError(f"found no documentation in {sysconfig.get_paths()['stdlib']}; the demo needs the "
                             "Python standard library sources (.py files), which this installation lacks")
    by_name = {e.name: e for e in entries}
    questions = asked_questions(by_name)
    asked = [by_name[q["name"]] for q in questions]
    held_names = {q["name"] for q in questions if q["held_out"]}
    chosen = [(q["question"], q["expected"]) for q in questions if not q["held_out"]]
    others = [pair for e in entries if e.name not in held_names for pair in qa_pairs(e).values() if pair not in chosen]
    others.sort(key=lambda pair: zlib.crc32(pair[0].encode("utf-8")))  # a fixed, well-mixed choice
    chosen += others[:max(0, sft_size - len(chosen))]

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pretrain_path, sft_path = out_dir / "pretrain.jsonl", out_dir / "sft.jsonl"
    documents = list(dict.fromkeys(asked)) + [e for e in entries if e not in asked]
    _write_jsonl(pretrain_path, [{"text": pretrain_text(e)} for e in documents])
    _write_jsonl(sft_path, [{"conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                            for q, a in chosen])
    return pretrain_path, sft_path, questions


def asked_questions(by_name: dict[str, DocEntry]) -> list[dict]:
    """IN_SET then HELD_OUT as {"name", "kind", "question", "expected", "held_out", "keywords"} (keywords: what
    a reply that knows the thing names, see held_out_hit). A Python whose docstring of a name changed shape (no
    first sentence, say) asks one question fewer."""
    questions = []
    for (name, kind), held_out in [(q, False) for q in IN_SET] + [(q, True) for q in HELD_OUT]:
        pair = qa_pairs(by_name[name]).get(kind) if name in by_name else None
        if pair:
            keywords = [a for a in argument_names(by_name[name].signature) if len(a) > 1 and a[0] != "_"]
            keywords += [name.split(".")[0]] if kind == "what" else []
            questions.append({"name": name, "kind": kind, "question": pair[0], "expected": pair[1],
                              "held_out": held_out, "keywords": keywords})
    return questions


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)

