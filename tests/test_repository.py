"""The repository's own rules: import layers without cycles, settings in one place, no development history.

These read the source tree (not the installed package), so they hold for what a clone contains.
"""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ouro_fast"

# What each layer must never import: kernels are tensors in, tensors out; the model knows no engine;
# the engine knows no HTTP.
FORBIDDEN = {
    "ouro_fast.kernels": ("ouro_fast.model", "ouro_fast.engine", "ouro_fast.server"),
    "ouro_fast.model": ("ouro_fast.engine", "ouro_fast.server"),
    "ouro_fast.engine": ("ouro_fast.server",),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every ouro_fast module that `path` imports, at any depth of its code (lazy imports count too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m.startswith("ouro_fast")}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in files and m != name} for name, path in files.items()}


def test_import_graph_reads_the_package():
    graph = _graph()
    assert (
        "ouro_fast.engine.engine" in graph
        and "ouro_fast.engine.scheduler" in graph["ouro_fast.engine.engine"]
    )


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(layer):
    bad = [
        f"{mod} imports {dep}"
        for mod, deps in _graph().items()
        if mod == layer or mod.startswith(layer + ".")
        for dep in deps
        if dep.startswith(FORBIDDEN[layer])
    ]
    assert not bad, bad


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    # A package's __init__ re-exporting its modules is not a cycle of design; drop those edges.
    graph = {
        m: {d for d in deps if not (m.startswith(d + ".") and d != "ouro_fast")}
        for m, deps in _graph().items()
    }
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_names_across_modules():
    """No module imports another module's private names, or reaches into another object's private
    attributes: only `self._x` and `cls._x` (and third-party modules' own internals) are private access."""
    bad = []
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").startswith("ouro_fast")
            ):
                parts = (node.module or "").split(".") + [a.name for a in node.names]
                bad += [f"{where}: import {p}" for p in parts if _private(p)]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if isinstance(owner, ast.Call) and getattr(owner.func, "id", "") == "super":
                    continue
                bad.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_environment_is_read_in_one_place():
    """Settings are documented options; the server's configuration reads their OURO_FAST_* variables
    (by name, from the option's field), and the checkpoint cache its folder. No module reads another."""
    readers = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if re.search(r"environ(\.get)?\s*[\[(]\s*f?[\"']OURO_FAST_", text):
            readers.append(str(path.relative_to(PACKAGE)))
    assert set(readers) <= {"model/checkpoints.py", "server/config.py"}, readers
    assert "ENV_PREFIX" in (PACKAGE / "server/config.py").read_text()


# ---- no development history in the repository ----

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth|fortieth|"
    "twenty-\\w+|thirty-\\w+|forty-\\w+|\\d+(st|nd|rd|th)"
)
HISTORY = [
    re.compile(r"\bsessions? \d+", re.I),  # "session 33", "sessions 28-33"
    re.compile(rf"\b({_ORDINALS}) (work )?sessions?\b", re.I),  # "the twenty-eighth session"
    re.compile(r"\bs\d{1,3}[ _-]?call ?\d+", re.I),  # "s32 call04"
    re.compile(r"\bcall ?0\d\b", re.I),  # "call02"
    re.compile(r"\bissues? #?\d+", re.I),  # "issue 5", "issue #8"
    # "#8" as a reference to a tracker entry: "(#8)", "blocked on #8", "#8 is ..." at a line's start
    re.compile(r"\(#\d+\)|\b(closes|fixes|resolves|see|on|by|in)\s+#\d+\b", re.I),
    re.compile(r"^\s*[-*]?\s*\**#\d+\b", re.M),
    re.compile(r"\.\./shared\b"),  # paths outside the repository
    re.compile(r"\banchors\.md\b"),
    re.compile(r"(?<![\w.])/work/\w+"),  # this workplace's checkouts
    re.compile(r"h200-20\d\d-\d\d-\d\d-s\d+", re.I),  # per-period result folders
]
# Binary and vendored files, and this file (it spells the patterns out).
SKIP_SUFFIXES = {".json", ".txt", ".png", ".safetensors"}
SKIP_FILES = {"tests/test_repository.py"}


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    files = []
    for rel in out.stdout.splitlines():
        path = ROOT / rel
        if rel in SKIP_FILES or path.suffix in SKIP_SUFFIXES or not path.is_file():
            continue
        files.append(path)
    return files


def history_words(text: str) -> list[str]:
    """The development-history phrases in `text`."""
    return [m.group(0).strip() for pattern in HISTORY for m in pattern.finditer(text)]


@pytest.mark.parametrize(
    "phrase",
    [
        "as measured in session 33",
        "sessions 28-33",
        "(docs/benchmarks.md, twenty-sixth session)",
        "the 16th session",
        "s32 call04",
        "see call02",
        "fixes issue 5",
        "blocked on #8",
        "**#8 (GPU) is marked blocked.**",
        "the fix (#12)",
        "see ../shared/docs/ouro-spec.md",
        "from /work/shared/docs/ouro-spec.md",
        "vLLM's figures (docs/anchors.md)",
        "bench/results/gpu/h200-2026-12-03-s33/",
    ],
)
def test_history_words_are_caught(phrase):
    assert history_words(phrase)


@pytest.mark.parametrize(
    "phrase",
    [
        "an aiohttp ClientSession",
        "the first token",
        "call 3 times",
        "HTTP/1.1",
        "color: #fff",
        "x = a[0]  # 8 rows",
    ],
)
def test_ordinary_words_pass(phrase):
    assert not history_words(phrase)


def test_repository_speaks_of_the_present():
    found = []
    for path in _tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}: {w}" for w in history_words(text)]
    assert not found, "\n".join(found[:50])
