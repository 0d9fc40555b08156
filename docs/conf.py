"""Sphinx configuration of the `mirrored` documentation site (`make docs`; CI builds it with -W).

Guides are Markdown (MyST); the API reference is reST generated on every build by `_api.py` from the
package itself, so it lists exactly what the package exports. Docstrings are written as plain text
with `code` in backticks and Google-style `Args:` sections; `docstring_to_rst` turns the plain-text
habits that reST would misread (an indented example after a paragraph, a list right under a line)
into reST before napoleon reads the sections.
"""
from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(DOCS))

import _api  # noqa: E402  (docs/_api.py: the public surface)
import _generated  # noqa: E402  (docs/_generated.py: pages made from files of the repository)

project = "mirrored"
author = "the mirrored authors"
copyright = "the mirrored authors"  # noqa: A001 - Sphinx's name
release = version = __import__("mirrored").__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_build_inputs", "README.md"]
templates_path: list[str] = []

html_theme = "furo"
html_title = f"mirrored {release}"
html_static_path = ["_static"]
html_css_files = ["mirrored.css"]  # tables that fit the column, coloured diff additions

# `x` in a docstring is code, as in the Markdown guides.
default_role = "code"
# Text as written: smart quotes made an en dash of the "--budget-s" that benchmark descriptions name in prose.
smartquotes = False
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_inherit_docstrings = False  # a method without its own docstring shows its signature, not torch's text
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Every cross-reference to a `mirrored` name must resolve (a broken one fails the -W build). Names of
# other projects (torch, numpy, typing) are left as text: the build has no network for their indexes.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(?!mirrored(\.|$)).*")]
# Private classes that public signatures or bases name, so their references cannot resolve. Each is a
# gap (document the type, or keep it out of the signature); this list may only shrink.
UNDOCUMENTED_TYPES = [
    "mirrored.data._pipeline.Node",  # Dataset's constructor argument
    "mirrored.data._tfds_splits.ReadInstruction",  # parse_split's result
    "mirrored.datasets.registry.Builder",  # what mr.datasets.builder() returns
    "mirrored.distribute.cross_device_ops.Disagreement",  # CrossDeviceOps.all_reduce's result
    "mirrored.distribute.replicas.Rendezvous",  # CrossDeviceOps.all_reduce's argument
    "mirrored.distribute.strategy.StrategyExtended",  # strategy.extended
]
nitpick_ignore = [("py:class", name) for name in UNDOCUMENTED_TYPES]

suppress_warnings: list[str] = []

# ---- plain-text docstrings -> reST ----------------------------------------------------------------------

_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Other Parameters|Returns?|"
                      r"Raises|Yields?|Attributes|Examples?|Notes?|Warnings?|See Also|References|Todo|Methods)"
                      r":\s*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def docstring_to_rst(lines: list[str]) -> list[str]:
    """Makes a plain-text docstring valid reST without changing what it says:

    - a more-indented block after a paragraph is a literal block (an example, a command, a
      list of cases), set off by a blank line and `::` as reST needs;
    - a change of indentation between two lines outside a Google section gets the blank line
      reST requires there, except a "- " list item's lines lined up under its text;
    - `*` and `|` outside code are literal characters (`**kwargs`, `a | b`), not markup."""
    out: list[str] = []
    in_section_at: int | None = None  # indentation of the Google section header we are inside
    in_literal_at: int | None = None  # indentation of the paragraph that introduced a literal block
    item_at: int | None = None  # where the text of the "- " list item we are in starts
    for line in lines:
        blank = not line.strip()
        if blank:
            out.append("")
            continue
        ind = _indent(line)
        if in_literal_at is not None:
            if ind > in_literal_at:
                out.append(line)
                continue
            in_literal_at = None
            if out and out[-1].strip():
                out.append("")
        if in_section_at is not None and ind <= in_section_at:
            in_section_at = None
        if in_section_at is None and _SECTION.match(line):
            in_section_at = ind
            if out and out[-1].strip():
                out.append("")
            out.append(line)
            continue
        if in_section_at is None:
            if line.lstrip().startswith("- "):
                item_at = ind + 2
            elif ind == item_at:  # a list item's next line, lined up under its text
                out.append(_escape_markup(line))
                continue
            else:
                item_at = None
            previous = next((p for p in reversed(out) if p.strip()), None)
            if previous is not None and ind > _indent(previous) and not previous.rstrip().endswith("::"):
                # An indented block after a paragraph: an example or a list of cases, shown as written.
                out.append("")
                out.append(" " * _indent(previous) + "::")
                out.append("")
                out.append(line)
                in_literal_at = _indent(previous)
                continue
            if previous is not None and ind < _indent(previous) and out[-1].strip():
                out.append("")
        out.append(_escape_markup(line))
    return out


_CODE = re.compile(r"(``.*?``|`[^`]*`)")


def _escape_markup(line: str) -> str:
    """Outside backticks, `*`, `|` and a word's trailing `_` are literal characters (`**kwargs`, `a | b`,
    `val_` of val_loss) rather than reST markup; code touching a letter (`.grad`s) gets the escaped
    space reST needs to see where the code ends."""
    parts = _CODE.split(line)
    for i in range(0, len(parts), 2):
        text = re.sub(r"(?<!\\)([*|])", r"\\\1", parts[i])
        text = re.sub(r"(?<=\w)_(?!\w)", r"\\_", text)
        if i > 0 and text[:1].isalnum():
            text = "\\ " + text
        if i + 1 < len(parts) and text[-1:].isalnum():
            text = text + "\\ "
        parts[i] = text
    return "".join(parts)


def _process_docstring(app, what, name, obj, options, lines: list[str]) -> None:  # noqa: ANN001 - Sphinx's hook
    lines[:] = docstring_to_rst(lines)
    if what in _ATTRIBUTE_KINDS and lines:
        lines[:0] = _PROSE_FIRST_LINE


# napoleon reads the first line of an attribute's or property's docstring as "type: description", so
# "How copies combine: NONE, SUM, ..." rendered as "NONE, SUM, ... Type: How copies combine". Ours are
# prose (the type is the annotation), so they start with an empty reST comment, which napoleon takes
# for that first line and reST shows as nothing.
_ATTRIBUTE_KINDS = ("attribute", "property", "data")
_PROSE_FIRST_LINE = ["..", ""]


def _write_generated_pages(app) -> None:  # noqa: ANN001 - Sphinx's hook
    _api.write_reference(DOCS / "reference", docstring_to_rst)
    _generated.write_benchmark_commands(REPO / "benchmarks", DOCS / "_build_inputs" / "benchmark_commands.md")
    _generated.write_example_pages(REPO / "examples", DOCS / "examples")


def _public_bases(bases: list) -> list:
    """A class's bases as the reference shows them: a private base of ours (a shared implementation
    such as schedules._StepRatioDecay) is replaced by its own public bases, since it has no page."""
    shown: list = []
    for base in bases:
        private = base.__name__.startswith("_") and base.__module__.startswith("mirrored")
        shown += _public_bases(list(base.__bases__)) if private else [base]
    return list(dict.fromkeys(shown))


def _process_bases(app, name, obj, options, bases: list) -> None:  # noqa: ANN001 - Sphinx's hook
    bases[:] = _public_bases(bases)


def _factory_default(factory) -> str:  # noqa: ANN001 - any zero-argument callable
    """What a dataclass field's default_factory makes, as a reader would write it: `{}` for dict, `[]`
    for list, else `Name()`."""
    made = {dict: "{}", list: "[]", tuple: "()"}.get(factory)
    return made or f"{getattr(factory, '__qualname__', 'factory')}()"


def _readable_signature(app, what, name, obj, options, signature, return_annotation):  # noqa: ANN001 - Sphinx's hook
    """A dataclass's signature shows `args: dict[str, Any] = {}` where inspect writes `= <factory>`,
    which is not Python: Sphinx then could not parse the signature and printed `~typing.Any` raw."""
    if not signature or "<factory>" not in signature or not dataclasses.is_dataclass(obj):
        return None
    for f in dataclasses.fields(obj):
        if f.init and f.default_factory is not dataclasses.MISSING:
            signature = signature.replace("<factory>", _factory_default(f.default_factory), 1)
    return signature, return_annotation


def _purge_outdated_first(app, env, docnames: list[str]) -> None:  # noqa: ANN001 - Sphinx's hook
    """Forgets every outdated page's objects before any is read again, as Sphinx's parallel reader does.
    The serial reader purges one page just before reading it, so a name that moved to an earlier page
    of the reference (mr.distribute.X now documented as mr.X) met its old entry and failed an
    incremental -W build with "duplicate object description", though a fresh build passed."""
    for docname in docnames:
        app.emit("env-purge-doc", env, docname)
        env.clear_doc(docname)


def setup(app) -> dict:  # noqa: ANN001 - Sphinx's hook
    app.connect("builder-inited", _write_generated_pages)
    app.connect("autodoc-process-bases", _process_bases)
    app.connect("autodoc-process-signature", _readable_signature)
    app.connect("env-before-read-docs", _purge_outdated_first)
    app.connect("autodoc-process-docstring", _process_docstring, priority=400)  # before napoleon (500)
    return {"parallel_read_safe": True}
