"""The code's shape, checked: imports point down the pipeline, no cycles, imports at the top, and no function
or module past the sizes docs/design.md sets; the docs state that layer order; no test imports a benchmark, and
no benchmark is past the module size or puts the checkout on sys.path. Parsed with `ast`; nothing is imported."""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanoforge"

# The pipeline, bottom to top: a module may import from its own layer or any below it, never above.
LAYERS = [
    ["core"],
    ["chat"],
    ["data"],
    ["model"],
    ["weights"],
    ["infer"],
    ["train"],
    ["rl"],
    ["report", "eval", "serve"],
    ["recipes"],
    ["demo"],
    ["cli", "commands", "__main__"],
]
# Imports inside a function, each for a stated reason: `--help` must not load torch; and commands.py, the
# dispatcher, imports the module a command runs inside that command (one recipe per run, never all of them).
LAZY_IMPORTS = {("cli", "nanoforge.commands")}
LAZY_MODULES = {"commands"}
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 500


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    top = module.split(".")[0] if module else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names or top == "__init__":
            return i if top != "__init__" else 0
    raise AssertionError(f"nanoforge/{module.replace('.', '/')}: its package {top!r} has no layer in LAYERS")


def imports(module: str):
    """(imported module, line, at top level) for every `nanoforge.*` import of a module."""
    tree = ast.parse(MODULES[module].read_text())
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nanoforge"):
            # `from nanoforge.train import checkpoint` imports the module nanoforge.train.checkpoint
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}"[10:] in MODULES else node.module
                     for a in node.names]
        for name in names:
            if name.startswith("nanoforge"):
                yield name[len("nanoforge."):] if name != "nanoforge" else "", node.lineno, id(node) in top_level


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_pipeline_and_sit_at_the_top(module):
    for target, line, top in imports(module):
        where = f"nanoforge/{module.replace('.', '/')}.py:{line}"
        assert layer_of(target) <= layer_of(module), f"{where}: imports nanoforge.{target}, a layer above it"
        lazy_ok = (module, f"nanoforge.{target}") in LAZY_IMPORTS or module in LAZY_MODULES
        assert top or lazy_ok, f"{where}: an import inside a function"


def test_the_dispatcher_loads_no_recipe_until_its_command_runs():
    import subprocess
    import sys
    code = ("import sys, nanoforge.commands; print(sorted(m for m in sys.modules if m.startswith(('nanoforge.recipes.',"
            " 'nanoforge.eval.run', 'nanoforge.demo.')) and m != 'nanoforge.recipes.options'))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", f"importing nanoforge.commands loads {loaded}"


def test_no_import_cycles():
    graph = {m: {t for t, _, _ in imports(m) if t in MODULES and t != m} for m in MODULES}
    state = {}

    def visit(m, path):
        state[m] = "open"
        for t in graph[m]:
            assert state.get(t) != "open", "import cycle: " + " -> ".join(path + [m, t])
            if t not in state:
                visit(t, path + [m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_functions_and_modules_fit_on_a_screen(module):
    source = MODULES[module].read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{MODULES[module]}: over {MAX_MODULE_LINES} lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, (f"{MODULES[module]}:{node.lineno}: {node.name} is {length} lines "
                                                  f"(at most {MAX_FUNCTION_LINES})")


def test_the_checks_can_fail():
    """The rules above catch what they are for: an upward import and an unknown package are refused."""
    assert layer_of("train.loop") > layer_of("data.batches")
    with pytest.raises(AssertionError):
        layer_of("utils.misc")


def test_the_top_of_the_package_holds_only_the_entry_points():
    """The tree shows the pipeline: every module lives in its part's package, but the command line's own."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "cli.py", "commands.py"], loose


# ---------------------------------------------------------------------------------------------- docs, benchmarks

ROOT = PACKAGE.parent
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))


def stated_layers(text: str) -> list[list[str]]:
    """The layer order a page states as `core/ -> chat/ (a note) -> ... -> report/, eval/, serve/ -> ... -> the
    CLI`: parenthetical notes dropped, a layer's packages split at commas."""
    flat = " ".join(re.sub(r"\([^)]*\)", "", text).split())
    chain = re.search(r"core/ ->.*?-> the CLI", flat)
    assert chain, "no `core/ -> ... -> the CLI` line"
    return [[name.strip().strip("/") for name in part.split(",")] for part in chain.group(0).split("->")]


@pytest.mark.parametrize("doc", ["docs/architecture.md", "docs/design.md"])
def test_the_docs_state_the_layer_order_that_is_checked(doc):
    stated = stated_layers((ROOT / doc).read_text())
    assert stated[-1] == ["the CLI"] and stated[:-1] + [LAYERS[-1]] == LAYERS, f"{doc}: {stated}"
    with pytest.raises(AssertionError):  # the parse can fail: a page with another order is caught
        assert stated_layers("core/ -> data/ -> chat/ -> the CLI")[:3] == LAYERS[:3]


def benchmark_imports(tree: ast.AST) -> list[str]:
    """What a test takes from benchmarks/: imports of a benchmark module's name, and benchmarks/ put on sys.path
    or loaded by file (spec_from_file_location)."""
    names = {p.stem for p in BENCHMARKS}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in names:
            found.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("insert", "append",
                                                                                "spec_from_file_location"):
            if "benchmarks" in ast.unparse(node):
                found.append(ast.unparse(node))
    return found


@pytest.mark.parametrize("test_file", sorted((ROOT / "tests").rglob("*.py")), ids=lambda p: p.name)
def test_no_test_imports_a_benchmark(test_file):
    """Benchmarks are scripts: a test runs one as a subprocess, never imports it, so that editing a benchmark
    cannot break the suite through its internals."""
    found = benchmark_imports(ast.parse(test_file.read_text()))
    assert not found, f"{test_file}: takes from benchmarks/: {found}"


def test_the_benchmark_scan_can_fail():
    assert benchmark_imports(ast.parse("import vs_minimind\nsys.path.insert(0, str(ROOT / 'benchmarks'))"))


def path_edits(tree: ast.AST) -> list[str]:
    """sys.path.insert/append calls: how a script puts a folder (the checkout, benchmarks/) on the import path."""
    return [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == "sys.path"]


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmarks_fit_the_module_size_and_import_nanoforge_as_installed(script):
    """A benchmark runs as `python benchmarks/NAME.py` (its folder is then on the path, for what the scripts
    share) and imports nanoforge as the installed package (the venv has it editable)."""
    source = script.read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{script}: over {MAX_MODULE_LINES} lines"
    assert not path_edits(ast.parse(source)), f"{script}: edits sys.path: {path_edits(ast.parse(source))}"
    assert path_edits(ast.parse("sys.path.insert(0, str(REPO))"))  # the check can fail
