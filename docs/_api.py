"""The public surface of `mirrored`, read from the package itself, and the API reference pages made from it.

conf.py calls `write_reference(dir)` on every build and tests/test_docs.py calls `public_names()`, so a
name added to the package appears in the reference (and must have a docstring) without anyone editing
the docs. What counts as public, in order:

  1. `mirrored.__all__`. Its modules (mr.data, mr.losses, ...) are namespaces, documented under the
     name users write (`mirrored.losses`, not `mirrored.training.losses`); the rest are top-level names.
  2. A namespace's names: its `__all__`, or, where it has none, what its own source defines at top
     level or re-exports explicitly (`from x import y as y`), minus underscored names.
  3. A public submodule of `mirrored` or of a namespace package, or a module a namespace's `__all__`
     names, is a namespace of its own when its `__all__` names something no earlier namespace
     documents (mr.data.images, mr.distribute, mr.optimizers.schedules).

An object reachable under two names is documented once, under the first. Uses only the standard
library and the package; never imports Sphinx, so the test runs without it.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = "mirrored"


@dataclass
class Namespace:
    """One page of the reference: a public module path, the module behind it, and its new names."""

    path: str  # what users write, e.g. "mirrored.losses"
    module: ModuleType  # what it is, e.g. mirrored.training.losses
    names: list[str] = field(default_factory=list)  # documented here (not documented earlier)
    aliases: dict[str, str] = field(default_factory=dict)  # name -> where it is documented instead


def _declared_names(module: ModuleType) -> list[str]:
    """A module's public names: `__all__`, else its top-level definitions and explicit re-exports."""
    declared = getattr(module, "__all__", None)
    if declared is not None:
        return [n for n in declared if not isinstance(getattr(module, n, None), ModuleType)]
    source = inspect.getsource(module)
    names: list[str] = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            names += [a.asname for a in node.names if a.asname is not None and a.asname == a.name]
    return [n for n in dict.fromkeys(names) if not n.startswith("_") and hasattr(module, n)
            and not isinstance(getattr(module, n), ModuleType)]


def _identity(name: str, obj: Any) -> Any:
    """What makes two names the same documented object: classes and functions by identity, constants
    by name and value (AUTOTUNE and INFINITE_CARDINALITY are both -1, yet different names)."""
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return ("object", id(obj))
    return ("constant", name, repr(obj))


def _submodules(package: ModuleType) -> list[ModuleType]:
    if not hasattr(package, "__path__"):
        return []
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_") and info.name not in ("cli",):  # cli: a program, not an API
            found.append(importlib.import_module(f"{package.__name__}.{info.name}"))
    return found


def namespaces() -> list[Namespace]:
    """Every page of the reference, in order: `mirrored`, its namespaces, then sub-namespaces."""
    root = importlib.import_module(ROOT)
    pages = [Namespace(ROOT, root)]
    top_names = []
    for name in root.__all__:
        value = getattr(root, name)
        if isinstance(value, ModuleType):
            pages.append(Namespace(f"{ROOT}.{name}", value))
        else:
            top_names.append(name)
    seen: dict[Any, str] = {}
    modules_seen = {id(p.module) for p in pages}

    def fill(page: Namespace, names: list[str]) -> None:
        for name in names:
            key = _identity(name, getattr(page.module, name))
            if key in seen:
                page.aliases[name] = seen[key]
            else:
                seen[key] = f"{page.path}.{name}"
                page.names.append(name)

    fill(pages[0], top_names)
    for page in pages[1:]:
        fill(page, _declared_names(page.module))
    # Sub-namespaces that add names: public submodules of mirrored and of namespace packages, and
    # modules a namespace's `__all__` names (mr.optimizers.schedules).
    parents = [(ROOT, root)] + [(p.path, p.module) for p in pages[1:]]
    for parent_path, parent in parents:
        named = [getattr(parent, n) for n in getattr(parent, "__all__", ())
                 if isinstance(getattr(parent, n, None), ModuleType)]
        for sub in dict.fromkeys(_submodules(parent) + named):
            if id(sub) in modules_seen or getattr(sub, "__all__", None) is None:
                continue
            page = Namespace(f"{parent_path}.{sub.__name__.rsplit('.', 1)[1]}", sub)
            fill(page, _declared_names(sub))
            if page.names:
                modules_seen.add(id(sub))
                pages.append(page)
    return pages


def public_names() -> dict[str, Any]:
    """Every documented public name (its path as users write it) and its object."""
    return {f"{page.path}.{name}": getattr(page.module, name) for page in namespaces() for name in page.names}


def kind(obj: Any) -> str:
    """How the reference documents `obj`: "class", "function" or "data" (a constant)."""
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        return "function"
    return "data"


def own_docstring(obj: Any) -> str | None:
    """`obj`'s own docstring: not inherited from a base class, not the one dataclasses, NamedTuple or
    Enum write for a class that has none. None for a constant (it cannot carry one)."""
    if kind(obj) == "data":
        return None
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if not isinstance(doc, str) or not doc.strip():
        return None
    if inspect.isclass(obj) and (doc.startswith(f"{obj.__name__}(") or doc == "An enumeration."):
        return None  # generated by @dataclass / NamedTuple / Enum
    return doc


# ---- the reference pages --------------------------------------------------------------------------------

def _title(text: str, char: str = "=") -> str:
    return f"{text}\n{char * len(text)}\n"


# ---- what a page opens with, and its order ---------------------------------------------------------------
# A page opens with "At a glance": the names a reader looks for first, each with the first sentence of its
# docstring. Pages not listed here open with all their names (up to _GLANCE_MAX), in the page's order.
GLANCE: dict[str, list[str]] = {
    "mirrored": ["MirroredStrategy", "Strategy.scope", "Strategy.run", "Strategy.reduce",
                 "Strategy.experimental_distribute_dataset", "Strategy.num_replicas_in_sync",
                 "Strategy.mirror", "Strategy.mirror_optimizer", "Model", "get_replica_context",
                 "ReduceOp"],
}
_GLANCE_MAX = 14

# A page's names grouped by use, in the order a program meets them. Names a page has that no group lists
# follow under "Other" (so a new name still appears); a page not listed keeps its own order (`__all__`, or
# the source's) instead of the alphabet's.
GROUPS: dict[str, list[tuple[str, list[str]]]] = {
    "mirrored": [
        ("Strategies", ["MirroredStrategy", "Strategy", "OneDeviceStrategy", "MultiWorkerMirroredStrategy",
                        "CommunicationOptions"]),
        ("Training with fit", ["Model"]),
        ("Custom training loops", ["MirroredModule", "MirroredOptimizer", "get_replica_context",
                                   "ReplicaContext", "ReduceOp", "get_strategy", "has_strategy",
                                   "in_cross_replica_context"]),
        ("Distributed values and variables", ["DistributedValues", "PerReplica", "Mirrored", "Variable",
                                              "MirroredVariable", "SyncOnReadVariable",
                                              "VariableSynchronization", "VariableAggregation"]),
        ("Distributed input", ["InputContext", "InputOptions", "ValueContext"]),
        ("Cross-device ops", ["CrossDeviceOps", "InMemoryAllReduce", "NcclAllReduce",
                              "HierarchicalCopyAllReduce", "ReductionToOneDevice", "CollectiveAllReduce"]),
        ("Errors", ["OutOfSyncError", "CollectiveMismatchError", "CollectiveTimeoutError"]),
        ("Process setup", ["tune_allocator"]),
    ],
}

# A class's members grouped by use (the class as its page documents it, e.g. "mirrored.Strategy"); members
# no group lists follow under "Other members", in source order. Classes not listed show theirs in source order.
MEMBER_GROUPS: dict[str, list[tuple[str, list[str]]]] = {
    "mirrored.Strategy": [
        ("Running a step", ["scope", "run", "reduce", "num_replicas_in_sync", "experimental_local_results",
                            "gather", "extended"]),
        ("Input", ["experimental_distribute_dataset", "distribute_datasets_from_function",
                   "experimental_distribute_values_from_function"]),
        ("Mirrored modules and optimizers", ["mirror", "mirror_optimizer", "gradient_reductions",
                                             "check_in_sync"]),
        ("Across workers", ["num_workers", "first_replica_id", "has_peers", "all_reduce_tensors",
                            "sum_over_workers"]),
    ],
    "mirrored.Model": [
        ("Training", ["compile", "fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
                      "predict_on_batch", "summary", "metrics", "reset_metrics"]),
        ("The steps (a subclass overrides them; they run on every replica)",
         ["train_step", "test_step", "predict_step", "compute_loss", "compute_metrics", "get_metrics_result",
          "zero_grad", "build_optimizer"]),
        ("Saving and loading", ["save", "load", "save_weights", "load_weights", "get_weights",
                                "set_weights"]),
        ("Replicas", ["module", "replicas", "mirrored_optimizer", "check_in_sync", "jit_compile",
                      "loss_scale"]),
    ],
}


def _inherited_members(cls: type, documented: set[int]) -> str:
    """Members inherited from our own private bases are shown; those of torch's (nn.Module) are not, nor
    those of a base the reference documents itself (MirroredStrategy links to Strategy's, rather than
    repeating them: the repeats made pages of half a megabyte)."""
    stop = [b.__name__ for b in cls.__mro__[1:] if not b.__module__.startswith(ROOT) or id(b) in documented]
    return ", ".join(dict.fromkeys(stop)) or "object"


def _member_directive(cls: type, name: str) -> str:
    raw = next(c.__dict__[name] for c in cls.__mro__ if name in c.__dict__)
    if isinstance(raw, property) or type(raw).__name__ == "cached_property":
        return "autoproperty"
    if inspect.isroutine(raw) or isinstance(raw, (staticmethod, classmethod)):
        return "automethod"
    return "autoattribute"


def _source_order_members(cls: type) -> list[str]:
    """The public members `cls` defines itself or takes from a private base of ours (a part of the class
    in a file of its own, as Model's steps and loops), in the order their sources define them."""
    parts = [cls] + [b for b in cls.__mro__[1:] if b.__name__.startswith("_") and b.__module__.startswith(ROOT)]
    return list(dict.fromkeys(n for part in parts for n in part.__dict__ if not n.startswith("_")))


def _grouped_class(path: str, obj: Any, groups: list[tuple[str, list[str]]]) -> str:
    out = [f".. autoclass:: {path}\n   :show-inheritance:\n"]
    listed = [n for _, names in groups for n in names]
    rest = [n for n in _source_order_members(obj) if n not in listed]
    for title, names in groups + ([("Other members", rest)] if rest else []):
        out.append(f"   .. rubric:: {title}\n")
        out += [f"   .. {_member_directive(obj, n)}:: {path}.{n}\n" for n in names]
    return "\n".join(out)


def _entry(path: str, obj: Any, documented: set[int] = frozenset()) -> str:
    what = kind(obj)
    if what == "class":
        if path in MEMBER_GROUPS:
            return _grouped_class(path, obj, MEMBER_GROUPS[path])
        return (f".. autoclass:: {path}\n   :members:\n   :undoc-members:\n   :show-inheritance:\n"
                f"   :inherited-members: {_inherited_members(obj, documented)}\n")
    if what == "function":
        return f".. autofunction:: {path}\n"
    return f".. autodata:: {path}\n"


def first_sentence(obj: Any) -> str:
    """The first sentence of `obj`'s own docstring, on one line ("" without one)."""
    doc = inspect.getdoc(obj) if kind(obj) != "data" else None
    paragraph = " ".join((doc or "").split("\n\n", 1)[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[:end + 1]


def glance(page: Namespace) -> list[tuple[str, str]]:
    """(full path, first sentence) of the names a page opens with."""
    names = GLANCE.get(page.path) or [n for _, group in _ordered(page) for n in group][:_GLANCE_MAX]
    found = []
    for name in names:
        obj: Any = page.module
        for part in name.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, property):
            obj = obj.fget
        found.append((f"{page.path}.{name}", first_sentence(obj)))
    return found


def _ordered(page: Namespace) -> list[tuple[str | None, list[str]]]:
    """The page's names in groups (title, names): GROUPS' for the page, else one untitled group per kind."""
    if page.path in GROUPS:
        listed = [n for _, names in GROUPS[page.path] for n in names]
        rest = [n for n in page.names if n not in listed]
        groups = [(title, [n for n in names if n in page.names]) for title, names in GROUPS[page.path]]
        return [g for g in groups + [("Other", rest)] if g[1]]
    by_kind = {"class": [], "function": [], "data": []}
    for name in page.names:
        by_kind[kind(getattr(page.module, name))].append(name)
    titles = {"class": "Classes", "function": "Functions", "data": "Constants"}
    return [(titles[k], names) for k, names in by_kind.items() if names]


def page_filename(page: Namespace) -> str:
    return page.path + ".rst"


GLANCE_TITLE = "At a glance"


def render(page: Namespace, docstring_to_rst: Any, documented: set[int] = frozenset()) -> str:
    """The reST of one reference page: its title, "At a glance" (the most used names, one line each), the
    module's docstring, then every name in groups by use. `docstring_to_rst` turns docstrings into reST;
    `documented` holds the ids of the classes the reference documents (their members are not repeated
    on subclasses)."""
    out = [_title(f"``{page.path}``"), f".. py:module:: {page.path}\n", f".. rubric:: {GLANCE_TITLE}\n"]
    for path, sentence in glance(page):
        text = " ".join(docstring_to_rst([sentence])).strip()
        out.append(f"* :py:obj:`{path.removeprefix(page.path + '.')} <{path}>`" + (f" - {text}" if text else ""))
    out.append("")
    intro = inspect.getdoc(page.module)
    if intro:
        out.append("\n".join(docstring_to_rst(intro.splitlines())) + "\n")
    if page.path != page.module.__name__:
        out.append(f"(Defined in ``{page.module.__name__}``.)\n")
    if page.aliases:
        also = ", ".join(f"``{name}`` (:py:obj:`{target}`)" for name, target in sorted(page.aliases.items()))
        out.append(f"Also exports {also}.\n")
    for title, names in _ordered(page):
        out.append(_title(title, "-"))
        out += [_entry(f"{page.path}.{name}", getattr(page.module, name), documented) for name in names]
    return "\n".join(out)


def render_index(pages: list[Namespace]) -> str:
    lines = [_title("API reference"),
             "Generated on every build from the package itself (``docs/_api.py``): every name in "
             "``mirrored.__all__``, every name of its namespaces, and of the public submodules that add names. "
             "A name added to the package appears here by itself; ``tests/test_docs.py`` fails when one has no "
             "docstring.\n",
             ".. toctree::\n   :maxdepth: 1\n"]
    lines += [f"   {page_filename(p)[:-4]}" for p in pages]
    lines.append("")
    lines.append(_title("Namespaces", "-"))
    for p in pages:
        summary = (inspect.getdoc(p.module) or "").split("\n\n", 1)[0].replace("\n", " ")
        lines.append(f"* :py:mod:`{p.path}` - {len(p.names)} names. {_escape(summary)}")
    return "\n".join(lines) + "\n"


def _escape(text: str) -> str:
    return text.replace("*", r"\*").replace("|", r"\|")


def write_reference(directory: Path, docstring_to_rst: Any) -> list[str]:
    """Writes the reference pages into `directory` and removes pages of names that are gone; returns
    the files. A page whose text did not change is left alone, so Sphinx does not read it again."""
    directory.mkdir(parents=True, exist_ok=True)
    pages = namespaces()
    documented = {id(obj) for obj in public_names().values() if inspect.isclass(obj)}
    texts = {page_filename(page): render(page, docstring_to_rst, documented) for page in pages}
    texts["index.rst"] = render_index(pages)
    for stale in set(p.name for p in directory.glob("*.rst")) - set(texts):
        (directory / stale).unlink()
    for name, text in texts.items():
        path = directory / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return list(texts)


def dedent_docstring(doc: str) -> list[str]:
    return textwrap.dedent(doc).splitlines()
