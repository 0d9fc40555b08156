"""Layering and the source tree's rules, checked on the files.

The rule, and why, is docs/architecture.md, section "What may import what": imports only point down
the list models/, data/, datasets/, distribute/, training/, profiler.py, cli.py; training/ uses only
the public names of mirrored.distribute and mirrored.data (what their `__init__` exports). The import
of distribute/ is checked in a fresh interpreter, since this test process has imported everything by
now; the rest is a static scan of src/ (and of tests/, benchmarks/ and examples/ for where they
import a name from). Besides the layers, the scan refuses:

- a private name (`_x`) imported from another package of mirrored: it has no promise outside its
  package, so a package that needs it gets a public name for it;
- a compatibility re-export: a module that imports a name it does not use and does not list in its
  `__all__` (e.g. "kept here, where it was defined before the split"); and a name imported from a
  module that only imports it, instead of the module that defines it or a package's `__init__`;
- the tracker's history in src/ ("issue 27", "issues 24 x 26", "session"): comments say why, and
  history lives in git log. Test docstrings that pin a regression may name the issue.

Every offender is reported as file:line.
"""
from __future__ import annotations

import ast
import functools
import importlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
IMPORT_TIMEOUT_S = 60.0

# The layers, lowest first: a module may import its own layer and the ones before it. The helpers at
# the top of the package (_files.py, _strings.py, utils.py...) sit under every layer.
LAYERS = ("models", "data", "datasets", "distribute", "training", "profiler", "cli")
_ON_TOP = {"_bench": "cli", "__main__": "cli"}  # programs, on top as cli.py
_PUBLIC_ONLY = {  # importer's package -> packages it may reach only through their `__init__` exports
    "mirrored.training": ("mirrored.distribute", "mirrored.data"),
    "mirrored.profiler": ("mirrored.distribute",),
}
_HISTORY = re.compile(r"\bissues?\s+#?\d+|\bsessions?\b|before the split", re.IGNORECASE)

_PROBE = """
import json, sys
import {module}
print(json.dumps(sorted(m for m in sys.modules if m == "mirrored" or m.startswith("mirrored."))))
"""


# ---- the source tree, parsed ------------------------------------------------------------------------


@dataclass(frozen=True)
class Module:
    name: str  # mirrored.distribute.strategy
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]

    def where(self, node: ast.AST) -> str:
        return f"{self.path.relative_to(REPO)}:{node.lineno}"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def src_modules() -> dict[str, Module]:
    return {_module_name(p, SRC): Module(_module_name(p, SRC), p, ast.parse(p.read_text(), str(p)))
            for p in sorted((SRC / "mirrored").rglob("*.py"))}


def other_modules() -> list[Module]:
    """tests/, benchmarks/ and examples/: they import from src/ as a user does."""
    paths = [p for folder in ("tests", "benchmarks", "examples") for p in sorted((REPO / folder).rglob("*.py"))]
    return [Module(_module_name(p, REPO), p, ast.parse(p.read_text(), str(p))) for p in paths]


def imports(module: Module) -> Iterator[tuple[ast.stmt, str]]:
    """Every import statement (top level or inside a function) and the dotted name it imports:
    `from a.b import c` gives "a.b.c" (a name or a submodule); relative imports are resolved."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            base = node.module or ""
            if node.level:
                package = module.package.split(".")
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                yield node, f"{base}.{alias.name}"


def bound_modules(module: Module) -> dict[str, str]:
    """Names this module binds to a mirrored module by an import: {"md": "mirrored.distribute"}."""
    bound = {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name.startswith("mirrored"):
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("mirrored"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in src_modules():
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def package_of(name: str) -> str:
    """The package a dotted name lives in: itself for a package, else its parent's."""
    modules = src_modules()
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return modules[name].package if name else ""


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer_of(name: str) -> int | None:
    """The index in LAYERS of a module's layer; None for the package root and its helpers."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    top = _ON_TOP.get(parts[1], parts[1])
    return LAYERS.index(top) if top in LAYERS else None


def public_names(package: str) -> set[str]:
    return set(importlib.import_module(package).__all__)


def defined_names(module: Module) -> set[str]:
    """What a module's own top level defines (functions, classes, assignments), also under if/try."""
    names: set[str] = set()
    body = list(module.tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *[s for handler in getattr(node, "handlers", []) for s in handler.body]]
    return names


def declared_all(module: Module) -> set[str]:
    for node in module.tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {elt.value for elt in ast.walk(node.value) if isinstance(elt, ast.Constant)}
    return set()


def fail_with(offenders: list[str], why: str) -> None:
    assert not offenders, f"{why}:\n" + "\n".join(offenders)


# ---- distribute/ knows nothing of training/ ---------------------------------------------------------


def loaded_after_import(module: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", _PROBE.format(module=module)], capture_output=True, text=True,
                          timeout=IMPORT_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_distribute_does_not_import_training():
    """`import mirrored.distribute` runs `mirrored/__init__.py` too, so this covers `import mirrored`."""
    loaded = loaded_after_import("mirrored.distribute")
    assert "mirrored.distribute" in loaded
    assert not [m for m in loaded if m == "mirrored.training" or m.startswith("mirrored.training.")], loaded


def test_distribute_modules_import_nothing_above_them():
    """No module of distribute/ imports training/, cli or profiler, even lazily in a function body."""
    offenders = [f"{m.where(node)}: imports {name}" for m in src_modules().values()
                 if within(m.name, "mirrored.distribute") for node, name in imports(m)
                 if re.match(r"mirrored\.(training|cli|profiler)\b", name)]
    fail_with(offenders, "distribute/ imports a layer above it")


def test_distribute_names_neither_training_nor_keras():
    """Issue 23: distribute/modules.py imported training/'s Keras adapter by name through importlib,
    which the import check above does not see. The loader is registered from above now; no module of
    distribute/ names "mirrored.training" or imports keras, in any form."""
    banned = re.compile(r"[\"']mirrored\.training\b|^\s*(?:from|import)\s+keras\b|import_module\([\"']keras",
                        re.MULTILINE)
    offenders = [f"{m.path.relative_to(REPO)}:{m.path.read_text()[:found.start()].count(chr(10)) + 1}: "
                 f"{found.group(0).strip()}" for m in src_modules().values() if within(m.name, "mirrored.distribute")
                 for found in banned.finditer(m.path.read_text())]
    fail_with(offenders, "distribute/ names training/ or keras")


# ---- every layer ------------------------------------------------------------------------------------


def test_imports_point_down_the_layers():
    """models/ imports no other layer, data/ only models/..., even lazily in a function body; the
    helpers at the package's top import no layer at all."""
    offenders = []
    for m in src_modules().values():
        mine = layer_of(m.name)
        for node, name in imports(m):
            theirs = layer_of(name) if name.startswith("mirrored.") else None
            if theirs is None or m.name == "mirrored":
                continue
            if mine is None or theirs > mine:
                offenders.append(f"{m.where(node)}: {m.name} imports {name}")
    fail_with(offenders, f"imports that point up the layers {LAYERS}")


def test_no_private_name_is_imported_from_another_package():
    """`from mirrored.data import _distribute` in distribute/ or `from mirrored.data.tfrecord import
    _field` in training/: a private name belongs to its package (and the packages inside it)."""
    offenders = []
    for m in src_modules().values():
        for node, name in imports(m):
            if not name.startswith("mirrored."):
                continue
            parts = name.split(".")
            private = next((i for i, part in enumerate(parts) if part.startswith("_") and not part.startswith("__")),
                           None)
            if private is None:
                continue
            owner = package_of(".".join(parts[:private]))
            if not within(m.package, owner):
                offenders.append(f"{m.where(node)}: imports {name}, private to {owner}")
    fail_with(offenders, "private names imported from another package")


def test_training_uses_only_the_public_names_of_distribute_and_data():
    """training/ (and profiler.py) reach mirrored.distribute and mirrored.data through what their
    `__init__` exports: by import (`from mirrored.distribute.random import ...` is refused), by
    attribute (`md.values.map_structure`) or by name (`sys.modules["mirrored.distribute.context"]`)."""
    offenders = []
    for m in src_modules().values():
        guarded = next((pkgs for importer, pkgs in _PUBLIC_ONLY.items() if within(m.name, importer)), ())
        for package in guarded:
            exported = public_names(package)

            def internal(name: str) -> bool:
                rest = name[len(package) + 1:].split(".")[0] if name.startswith(package + ".") else None
                return rest is not None and rest not in exported

            offenders += [f"{m.where(node)}: imports {name}" for node, name in imports(m) if internal(name)]
            aliases = {alias for alias, target in bound_modules(m).items() if target == package}
            offenders += [f"{m.where(node)}: uses {node.value.id}.{node.attr}" for node in ast.walk(m.tree)
                          if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                          and node.value.id in aliases and node.attr not in exported]
            offenders += [f"{m.where(node)}: names {node.value!r}" for node in ast.walk(m.tree)
                          if isinstance(node, ast.Constant) and isinstance(node.value, str)
                          and re.fullmatch(r"mirrored(\.\w+)+", node.value) and internal(node.value)]
    fail_with(offenders, "training/ reaches into distribute/ or data/ past their public names")


# ---- no compatibility re-exports ---------------------------------------------------------------------


def _used_names(module: Module) -> set[str]:
    """Names a module reads: in code, and in string annotations."""
    used = {n.id for n in ast.walk(module.tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store)}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            used.add(node.value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                expression = ast.parse(node.value, mode="eval")
            except SyntaxError:
                continue
            used |= {n.id for n in ast.walk(expression) if isinstance(n, ast.Name)}
    return used


def test_no_module_reexports_a_name_it_does_not_use():
    """A module of src/ (not a package's `__init__`) imports only what it uses or lists in `__all__`:
    an import kept for others is a re-export from where the name no longer lives."""
    offenders = []
    for m in src_modules().values():
        if m.is_package:
            continue
        used, exported = _used_names(m), declared_all(m)
        for node in m.tree.body:
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                offenders += [f"{m.where(node)}: {m.name} imports {a.asname or a.name} and does not use it"
                              for a in node.names if (a.asname or a.name) not in used | exported]
    fail_with(offenders, "imports a module does not use (re-exports)")


def test_names_are_imported_from_the_module_that_defines_them():
    """src/, tests/, benchmarks/ and examples/ import a name from the module that defines it (or lists
    it in `__all__`), or from a package's `__init__`; never from a module that only imports it."""
    modules = src_modules()
    offenders = []
    for m in [*modules.values(), *other_modules()]:
        for node, name in imports(m):
            source, _, attr = name.rpartition(".")
            if isinstance(node, ast.ImportFrom) and source in modules and not modules[source].is_package:
                if name not in modules and attr not in defined_names(modules[source]) | declared_all(modules[source]):
                    offenders.append(f"{m.where(node)}: imports {attr} from {source}, which does not define it")
        for alias, target in bound_modules(m).items():
            if target not in modules or modules[target].is_package:
                continue
            known = defined_names(modules[target]) | declared_all(modules[target])
            offenders += [f"{m.where(node)}: reads {alias}.{node.attr}, which {target} does not define"
                          for node in ast.walk(m.tree) if isinstance(node, ast.Attribute)
                          and isinstance(node.value, ast.Name) and node.value.id == alias
                          and not node.attr.startswith("__") and node.attr not in known]
    fail_with(offenders, "names imported from a module that does not define them")


# ---- history lives in git log -------------------------------------------------------------------------


def test_src_narrates_no_tracker_history():
    """No issue number or session in src/'s comments, docstrings or messages: they say why, and the
    history of a line is `git log -L`."""
    offenders = [f"{m.path.relative_to(REPO)}:{number}: {line.strip()}" for m in src_modules().values()
                 for number, line in enumerate(m.path.read_text().splitlines(), start=1) if _HISTORY.search(line)]
    fail_with(offenders, "src/ lines that narrate the tracker's history")


def test_the_scan_sees_what_it_refuses():
    """The checks above are only as good as their parsing: each sees its offence in a made-up module."""
    probe = Module("mirrored.training.probe", SRC / "mirrored" / "training" / "probe.py", ast.parse(
        "import mirrored.distribute as md\n"
        "from mirrored.data.tfrecord import _field\n"
        "from mirrored.distribute.random import watched_step\n"
        "from mirrored.distribute.strategy import map_structure\n"
        "def f():\n    return md.values.flatten\n"))
    names = [name for _, name in imports(probe)]
    assert names == ["mirrored.distribute", "mirrored.data.tfrecord._field", "mirrored.distribute.random.watched_step",
                     "mirrored.distribute.strategy.map_structure"]
    assert package_of("mirrored.data.tfrecord._field") == "mirrored.data"
    assert bound_modules(probe) == {"md": "mirrored.distribute"}
    assert "map_structure" not in defined_names(src_modules()["mirrored.distribute.strategy"])
    assert "map_structure" in defined_names(src_modules()["mirrored.distribute.values"])
    assert layer_of("mirrored.data.dataset") < layer_of("mirrored.distribute.input") < layer_of("mirrored.cli")
    assert layer_of("mirrored._files") is None
    assert _HISTORY.search("# (issues 24 x 26)") and _HISTORY.search("see issue 27.") and not _HISTORY.search(
        "pytorch/pytorch#135712")
