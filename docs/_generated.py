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
                         "```sh\n" + "\n".join(commands) + "\n```\n")
        if prose:
            parts.append(prose + "\n")
    return "\n".join(parts)


def write_benchmark_commands(benchmarks: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(benchmark_commands(benchmarks))
