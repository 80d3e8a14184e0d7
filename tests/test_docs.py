"""The documentation stays true to the code: every `nanoforge ...` command line shown in README.md and
docs/*.md parses with the real argument parser, and every relative link resolves.

Lines in code blocks (fenced, or indented by four spaces) must parse whole: `...` stands for flags left out and
is dropped, `# comments` are ignored, `torchrun ... -m nanoforge` and `python -m nanoforge` count as
`nanoforge`. A line that shows a refused command on purpose ends with the comment `# refused`. Commands quoted
inline in the prose (`nanoforge eval RUN --gsm8k FILE [--think]`) are fragments: their command must exist and
every flag they name must belong to it. Parsing needs argparse only, never torch.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

from nanoforge.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REFUSED = "# refused"


def code_lines(text: str):
    """(line number, command line) for each line of a code block, backslash continuations joined."""
    fenced, pending, start = False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not (fenced or line.startswith("    ")):
            continue
        start = start or number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line.strip()
        pending, start = "", 0


def nanoforge_argv(line: str) -> list[str] | None:
    """The arguments of the `nanoforge` (or `-m nanoforge`) command in a shell line; None when it runs none."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    for i, word in enumerate(words):
        starts = i == 0 or words[i - 1] in ("-m", "|", "&&", ";") or "=" in words[i - 1]
        if starts and (word == "nanoforge" or word.endswith("/bin/nanoforge")):
            rest = words[i + 1:]
            end = next((j for j, w in enumerate(rest) if w in ("|", "&&", ";")), len(rest))
            return [w for w in rest[:end] if w != "..."]
    return None


def parse(argv: list[str]) -> str:
    """'' when the real parser accepts argv, else argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as stop:
        return "" if stop.code == 0 else err.getvalue().strip().splitlines()[-1]
    return ""


def subparser(argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser a fragment's leading command words name."""
    parser = build_parser()
    for word in argv:
        choices = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if not choices or word not in choices:
            break
        parser = choices[word]
    return parser


def all_commands():
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for number, line in code_lines(text):
            argv = nanoforge_argv(line)
            if argv is not None:
                yield f"{path.relative_to(ROOT)}:{number}", line, argv


def test_every_command_line_in_the_docs_parses():
    problems, seen = [], 0
    for where, line, argv in all_commands():
        seen += 1
        message = parse(argv)
        if line.rstrip().endswith(REFUSED):
            if not message:
                problems.append(f"{where}: marked {REFUSED!r} but parses: {line}")
        elif message:
            problems.append(f"{where}: {message}: {line}")
    assert seen > 50, f"only {seen} command lines found: is the extraction broken?"
    assert not problems, "\n".join(problems)


def test_parsing_needs_no_torch():
    import subprocess
    code = ("import sys; from nanoforge.cli import build_parser; build_parser().parse_args(['pretrain', '--out', 'RUN']); "
            "assert 'torch' not in sys.modules, 'the parser imported torch'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


INLINE = re.compile(r"`(nanoforge [^`]+)`")


def test_every_inline_command_names_real_flags():
    problems, seen = [], 0
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for fragment in INLINE.findall(line):
                argv = fragment.split()[1:]
                parser = subparser(argv)
                if parser.prog == "nanoforge" and not (argv and argv[0].startswith("-")):
                    problems.append(f"{path.relative_to(ROOT)}:{number}: no such command: {fragment}")
                    continue
                seen += 1
                known = {flag for action in parser._actions for flag in action.option_strings}
                for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", fragment):
                    if flag not in known:
                        problems.append(f"{path.relative_to(ROOT)}:{number}: {parser.prog} has no {flag}: {fragment}")
    assert seen > 10
    assert not problems, "\n".join(problems)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """The #anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_resolves():
    problems = []
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                linked = path.parent / file if file else path
                if not linked.exists():
                    problems.append(f"{path.relative_to(ROOT)}:{number}: {target} does not exist")
                elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                    problems.append(f"{path.relative_to(ROOT)}:{number}: {target}: no such heading")
    assert not problems, "\n".join(problems)


def test_nothing_points_outside_the_repository():
    for path in DOCS:
        assert "DESIGN.md" not in path.read_text(encoding="utf-8"), f"{path.name} points to notes no user has"
