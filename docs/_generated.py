"""Pages of the site made from files of the repository at build time, so they cannot drift from them.

`write_benchmark_commands` turns the docstring of each benchmarks/*.py (a summary line, the commands
that run it, what it measures) into the "How to rerun" part of the Benchmarks page. Standard library
only.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path


def _split_docstring(doc: str) -> tuple[str, list[str], str]:
    """(summary line, the indented command lines after it, the prose after those)."""
    lines = doc.splitlines()
    summary = lines[0].strip()
    rest = lines[1:]
    while rest and not rest[0].strip():
        rest.pop(0)
    commands = []
    while rest and (rest[0].startswith("    ") or not rest[0].strip()):
        if rest[0].strip():
            commands.append(rest[0].strip())
        rest.pop(0)
        if commands and rest and rest[0].strip() and not rest[0].startswith("    "):
            break
    return summary, commands, textwrap.dedent("\n".join(rest)).strip()


CODE_LINE_MAX = 88  # what the site's code column shows without scrolling (tests/test_docs_layout.py)


def _fit(command: str) -> str:
    """A command whose side comment would run past CODE_LINE_MAX, with the comment on its own line
    above it, so the page shows both without a sideways scroll."""
    code, sep, comment = command.partition("  #")
    if len(command) <= CODE_LINE_MAX or not sep:
        return command
    return f"# {comment.strip()}\n{code.rstrip()}"


def benchmark_commands(benchmarks: Path) -> str:
    """Markdown: one section per benchmark script, with its commands and what it measures."""
    parts = []
    for script in sorted(benchmarks.glob("*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text()))
        if not doc:
            raise ValueError(f"{script}: a benchmark needs a module docstring that says how to run it "
                             "(the Benchmarks page is made from it).")
        summary, commands, prose = _split_docstring(doc)
        parts.append(f"### `benchmarks/{script.name}`\n\n{summary}\n")
        if commands:
            parts.append("% ci: parse-only (a benchmark takes minutes and wants an idle machine)\n"
                         "```sh\n" + "\n".join(_fit(c) for c in commands) + "\n```\n")
        if prose:
            parts.append(prose + "\n")
    return "\n".join(parts)


def write_benchmark_commands(benchmarks: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(benchmark_commands(benchmarks))


def example_pages(examples: Path) -> dict[str, str]:
    """Markdown pages that show each examples/*.py on the site (its docstring's first line, then the
    file), and an index of them: {relative file name: text}. Guides link to them, so a reader of the
    site can open a file that a guide names."""
    pages, rows = {}, []
    for script in sorted(examples.glob("*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        summary = doc.splitlines()[0].strip() if doc else ""
        pages[f"{script.stem}.md"] = (f"# `examples/{script.name}`\n\n{summary}\n\n"
                                      f"```{{literalinclude}} ../../examples/{script.name}\n"
                                      ":language: python\n:class: repo-file\n```\n")
        rows.append(f"- [`examples/{script.name}`]({script.stem}.md): {summary}")
    pages["index.md"] = ("# Examples\n\nThe programs of the repository's `examples/` folder, as they stand; "
                         "each file's docstring says how to run it. The test suite runs every one.\n\n"
                         + "\n".join(rows) + "\n\n```{toctree}\n:hidden:\n\n"
                         + "\n".join(p[:-3] for p in pages if p != "index.md") + "\n```\n")
    return pages


def write_example_pages(examples: Path, target: Path) -> None:
    """Writes example_pages() into `target` (docs/examples/, ignored by git); a page whose text did not
    change is left alone, so Sphinx does not read it again."""
    target.mkdir(parents=True, exist_ok=True)
    pages = example_pages(examples)
    for stale in {p.name for p in target.glob("*.md")} - set(pages):
        (target / stale).unlink()
    for name, text in pages.items():
        if not (target / name).exists() or (target / name).read_text() != text:
            (target / name).write_text(text)
