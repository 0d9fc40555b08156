"""The documentation (docs/) cannot drift from the code.

- Every public name (docs/_api.py enumerates them from the package: `mirrored.__all__`, its
  namespaces and the public submodules that add names) has a docstring and a place in the generated
  API reference.
- Every code block of the guides runs: the ```python blocks of a page run in order, in one fresh
  interpreter, as a reader would paste them. A block that cannot run in CI (a download, torchrun on
  GPUs, a long training run) carries the line `% ci: parse-only (why)` right above its fence, and is
  then compiled (Python) or checked with `bash -n` (shell). ```text blocks are output, not code. A
  page that needs an optional package says `% ci: needs <module>`; without it, its blocks are compiled.
- Every `{py:...}` cross-reference of the guides names an object that exists.
- Every promise of docs/guarantees.md names the tests that hold it, and each named test exists.

The site itself is built by `make docs` (Sphinx with -W: a broken reference or a malformed docstring
fails it); these tests need no Sphinx.
"""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
_PAGE_TIMEOUT_S = 100  # below pytest's 120 s: a hung block fails here, with its output

# Public names without a docstring today. The lead writes them; this list may only shrink (a name
# that gains a docstring must leave it: test_allowlist_is_current fails until it does).
UNDOCUMENTED: set[str] = set()


def _load_docs_module(name: str):
    spec = importlib.util.spec_from_file_location(f"_mirrored_docs_{name}", DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


api = _load_docs_module("_api")


# ---- the API reference ---------------------------------------------------------------------------------

def test_every_public_name_has_a_docstring():
    missing = sorted(name for name, obj in api.public_names().items()
                     if api.kind(obj) != "data" and api.own_docstring(obj) is None and name not in UNDOCUMENTED)
    assert not missing, (f"public names without a docstring: {missing}. Write one (what and why in a line or "
                         "two, STYLE.md); the API reference is made from it.")


def test_allowlist_is_current():
    names = api.public_names()
    gone = sorted(UNDOCUMENTED - set(names))
    documented = sorted(n for n in UNDOCUMENTED & set(names) if api.own_docstring(names[n]) is not None)
    assert not gone and not documented, (f"remove from UNDOCUMENTED: {gone + documented} (no longer public, or "
                                         "documented now). The list may only shrink.")


def _own_members(cls: type) -> dict[str, tuple[type, object]]:
    """The public methods and properties `cls` shows that our package defines: name -> (the class
    that defines it, the function or property). Members of torch's or Python's classes (nn.Module's
    `train`, object's) are left out; those of our private bases (a shared `_GetNext`) are in, since
    the reference shows them on the public class."""
    found = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
        if owner is None or not (owner.__module__ or "").startswith(api.ROOT + "."):
            continue
        raw = owner.__dict__[name]
        member = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
        if inspect.isfunction(member) or isinstance(member, (property, functools.cached_property)):
            found[name] = (owner, member)
    return found


def _public_members() -> dict[str, object]:
    """Every public method and property of the public classes, once each, as "module.Class.name"."""
    members = {}
    for obj in api.public_names().values():
        if inspect.isclass(obj):
            for name, (owner, member) in _own_members(obj).items():
                members[f"{owner.__module__}.{owner.__qualname__}.{name}"] = member
    return members


def test_every_public_method_and_property_has_a_docstring():
    """The reference lists the members of each class (autodoc's :members:), and a member without its own
    docstring shows a bare signature there (autodoc_inherit_docstrings is off)."""
    members = _public_members()
    # The enumeration sees what it must: a method, a property made by property(), a classmethod, and a
    # method of a private base that a public class shows.
    assert {"mirrored.training.metrics.Metric.update_state", "mirrored.distribute.variables.Variable.name",
            "mirrored.training.metrics.Metric.from_config", "mirrored.distribute.input._GetNext.get_next"
            } <= set(members), "the member enumeration misses members"
    missing = sorted(path for path, member in members.items()
                     if not (isinstance(member.__doc__, str) and member.__doc__.strip()))
    assert not missing, (f"public methods/properties without a docstring: {missing}. Write one (what and why in a "
                         "line or two, STYLE.md); the API reference shows it under its class.")


_CODE_SPAN = re.compile(r"``.+?``|`[^`]*`")


def test_returns_sections_do_not_start_with_a_type():
    """napoleon reads a Returns section's first line "X: Y" as the type X and the description Y, so "The
    History callback: `.history` maps ..." rendered "Return type: The History callback". Ours name the
    type in the annotation; the first line is prose without a colon (outside `code`)."""
    docs = {path: obj.__doc__ for path, obj in api.public_names().items() if api.kind(obj) != "data"}
    docs.update({path: member.__doc__ for path, member in _public_members().items()})
    typed = []
    for path, doc in docs.items():
        lines = inspect.cleandoc(doc or "").splitlines()
        for i, line in enumerate(lines[:-1]):
            if re.fullmatch(r"\s*Returns?:\s*", line):
                first = next((n for n in lines[i + 1:] if n.strip()), "")
                if re.search(r"(?<!:):(?!:)", _CODE_SPAN.sub("", first)):
                    typed.append(f"{path}: {first.strip()!r}")
    assert any("Returns:" in (doc or "") for doc in docs.values()), "no Returns: section found: the scan is broken"
    assert not typed, f"Returns sections whose first line has a colon, which napoleon shows as the type: {typed}"


def test_a_property_docstring_keeps_its_first_line_in_order():
    """napoleon once read "How copies combine: NONE, SUM, ..." as "type: description" and showed "NONE,
    SUM, ... Type: How copies combine"; conf.py's hook keeps the sentence whole (Sphinx's own parser)."""
    napoleon = pytest.importorskip("sphinx.ext.napoleon")
    conf = _load_docs_module("conf")
    doc = ["How copies combine: NONE, SUM, MEAN or ONLY_FIRST_REPLICA.", "A second line: still prose."]
    for what in ("property", "attribute"):
        lines = list(doc)
        conf._process_docstring(None, what, "mirrored.Variable.aggregation", None, {}, lines)
        out = napoleon.docstring.GoogleDocstring(lines, napoleon.Config(napoleon_numpy_docstring=False), what=what,
                                                 name="mirrored.Variable.aggregation").lines()
        assert not any(":type:" in line for line in out), out
        assert [line for line in out if line.strip() not in ("", "..")] == doc, out


def test_every_public_name_is_in_the_reference(tmp_path):
    written = api.write_reference(tmp_path, lambda lines: lines)
    text = {f: (tmp_path / f).read_text() for f in written}
    for page in api.namespaces():
        page_text = text[api.page_filename(page)]
        for name in page.names:
            assert re.search(rf"^\.\. auto(class|function|data):: {re.escape(page.path)}\.{name}$", page_text,
                             re.M), f"{page.path}.{name} is missing from {api.page_filename(page)}"
        assert f"   {api.page_filename(page)[:-4]}" in text["index.rst"], f"{page.path} is not in the index"


def test_reference_covers_every_namespace_of_the_package():
    import mirrored

    paths = {page.path for page in api.namespaces()}
    namespaces = [n for n in mirrored.__all__ if type(getattr(mirrored, n)).__name__ == "module"]
    assert namespaces, "mirrored.__all__ names no namespace: the enumeration is looking in the wrong place"
    assert {f"mirrored.{n}" for n in namespaces} <= paths
    assert {"mirrored", "mirrored.data", "mirrored.losses", "mirrored.distribute"} <= paths


def test_a_name_reachable_twice_is_documented_once():
    seen: dict[int, str] = {}
    for path, obj in api.public_names().items():
        if api.kind(obj) != "data":
            assert id(obj) not in seen, f"{path} and {seen[id(obj)]} are one object documented twice"
            seen[id(obj)] = path


# ---- code blocks ------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^(`{3,})(\S*).*$")
_MARK = re.compile(r"^% ci: parse-only \((.+)\)\s*$")
# A page whose blocks need an optional package (an extra that `make test-min` cannot install) says so once:
# without the package its blocks are compiled, not run.
_NEEDS = re.compile(r"^% ci: needs (\S+)", re.M)
_LANGUAGES = {"python": "python", "py": "python", "sh": "sh", "bash": "sh", "text": "text", "diff": "text"}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the first line of code
    language: str
    code: str
    parse_only: str | None  # the reason, when marked


def guide_pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if not any(part.startswith("_") for part in
                                                            p.relative_to(DOCS).parts))


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence or fence.group(2).startswith("{"):  # a MyST directive (toctree, include): not code
            if fence:  # skip to its closing fence
                i += 1
                while i < len(lines) and lines[i].rstrip() != fence.group(1):
                    i += 1
            i += 1
            continue
        ticks, info = fence.group(1), fence.group(2)
        mark = _MARK.match(lines[i - 1]) if i else None
        end = next(j for j in range(i + 1, len(lines)) if lines[j].rstrip() == ticks)
        language = _LANGUAGES.get(info)
        assert language, f"{page}:{i + 1}: code block language {info!r}; use one of {sorted(_LANGUAGES)}"
        found.append(Block(page, i + 2, language, "\n".join(lines[i + 1:end]) + "\n",
                           mark.group(1) if mark else None))
        i = end + 1
    return found


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def _pages_with_runnable_python() -> list[Path]:
    return [p for p in guide_pages() if any(b.language == "python" and not b.parse_only for b in blocks_of(p))]


_RUNNER = """
import json, sys
namespace = {"__name__": "__main__"}
for filename, line, code in json.load(sys.stdin):
    exec(compile("\\n" * (line - 1) + code, filename, "exec"), namespace)
"""


@pytest.mark.parametrize("page", _pages_with_runnable_python(), ids=_rel)
def test_python_blocks_of_a_page_run(page, tmp_path):
    """The page's blocks in order, in one fresh interpreter, working in an empty directory; a
    traceback names the page and its line."""
    blocks = [(_rel(b.page), b.line, b.code) for b in blocks_of(page) if b.language == "python" and not b.parse_only]
    missing = [m for m in _NEEDS.findall(page.read_text()) if importlib.util.find_spec(m) is None]
    if missing:
        for name, line, code in blocks:
            compile("\n" * (line - 1) + code, name, "exec")
        pytest.skip(f"{_rel(page)} needs {', '.join(missing)}, which is not installed (its blocks were compiled)")
    done = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(blocks), capture_output=True, text=True,
                          cwd=tmp_path, timeout=_PAGE_TIMEOUT_S)
    assert done.returncode == 0, f"{_rel(page)}: a code block failed\n{done.stdout}\n{done.stderr}"


def test_blocks_marked_parse_only_parse():
    blocks = [b for p in guide_pages() for b in blocks_of(p) if b.parse_only]
    assert blocks, "no parse-only block found: the marker or the page list is broken"
    bash = shutil.which("bash")
    for b in blocks:
        where = f"{_rel(b.page)}:{b.line}"
        if b.language == "python":
            compile(b.code, where, "exec")
        elif b.language == "sh" and bash:
            done = subprocess.run([bash, "-n"], input=b.code, capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, f"{where}: {done.stderr}"


def test_shell_blocks_are_marked():
    """Shell commands (make, torchrun, a benchmark) do not run in the test: each says why."""
    unmarked = [f"{_rel(b.page)}:{b.line}" for p in guide_pages() for b in blocks_of(p)
                if b.language == "sh" and not b.parse_only]
    assert not unmarked, f"shell blocks without `% ci: parse-only (why)` above them: {unmarked}"


def test_readme_python_blocks_parse():
    """The README's example is included in Getting started; it needs the Cassava download."""
    for b in blocks_of(REPO / "README.md"):
        if b.language == "python":
            compile(b.code, f"README.md:{b.line}", "exec")


def test_generated_benchmark_commands_parse():
    generated = _load_docs_module("_generated").benchmark_commands(REPO / "benchmarks")
    assert generated.count("### `benchmarks/") == len(list((REPO / "benchmarks").glob("*.py")))
    bash = shutil.which("bash")
    for code in re.findall(r"```sh\n(.*?)```", generated, re.S):
        if bash:
            done = subprocess.run([bash, "-n"], input=code, capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr


# ---- cross-references and the architecture page -----------------------------------------------------

_ROLE = re.compile(r"\{py:(?:class|func|meth|attr|mod|obj|data|exc)\}`(?:[^`<]*<)?~?([\w.]+)>?`")


def _resolve(path: str) -> object:
    parts = path.split(".")
    obj = importlib.import_module(parts[0])
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj


def test_cross_references_of_the_guides_name_real_objects():
    broken = []
    for page in guide_pages():
        for target in _ROLE.findall(page.read_text()):
            try:
                _resolve(target)
            except (AttributeError, ImportError):
                broken.append(f"{_rel(page)}: {target}")
    assert not broken, f"cross-references to names that do not exist: {broken}"


def test_layering_test_cites_the_architecture_page():
    """The import rule lives in docs/architecture.md; the test that enforces it points there."""
    page = (DOCS / "architecture.md").read_text()
    assert "## What may import what" in page
    layering = (REPO / "tests" / "test_layering.py").read_text()
    assert "docs/architecture.md" in layering


# ---- the guarantees page ------------------------------------------------------------------------------

_TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:::(\w+))?`")


def _test_names(path: Path) -> set[str]:
    """The tests a file defines, as pytest names them: `test_x` and `TestClass::test_x` (read with ast,
    without importing the file)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names.update(f"{node.name}::{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"))
    return names


def _guarantees() -> dict[str, list[tuple[str, str]]]:
    """Each `## ` section of docs/guarantees.md and the (file, test) pairs it names."""
    sections: dict[str, list[tuple[str, str]]] = {}
    title = None
    for line in (DOCS / "guarantees.md").read_text().splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
            sections[title] = []
        elif title is not None:
            sections[title] += [(f, "::".join(p for p in rest if p)) for f, *rest in _TEST_REF.findall(line)]
    return sections


def test_every_guarantee_names_tests_that_exist():
    """A promise on the Guarantees page is only as good as its tests: each section names at least one,
    and a renamed or deleted test fails here until the page follows."""
    sections = _guarantees()
    assert len(sections) >= 10, f"docs/guarantees.md: expected its promises as `## ` sections, found {list(sections)}"
    unbacked = [title for title, refs in sections.items() if not refs]
    assert not unbacked, f"docs/guarantees.md: sections that name no test: {unbacked}"
    missing = []
    for title, refs in sections.items():
        for file, name in refs:
            path = REPO / file
            if not path.is_file() or name not in _test_names(path):
                missing.append(f"{title!r}: {file}::{name}")
    assert not missing, f"docs/guarantees.md names tests that do not exist: {missing}"


def test_the_guarantees_check_sees_a_missing_test():
    """The check above fails for a name that is not there (it cannot pass by finding nothing)."""
    names = _test_names(REPO / "tests" / "test_docs.py")
    assert "test_every_guarantee_names_tests_that_exist" in names
    assert "test_no_such_test" not in names
    assert _TEST_REF.findall("`tests/a/b.py::TestX::test_y`") == [("tests/a/b.py", "TestX", "test_y")]
