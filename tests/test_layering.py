"""Layering: `mirrored.distribute` knows nothing of `mirrored.training`.

The rule, and why, is docs/architecture.md, section "What may import what": imports only point down
the list models/, data/, datasets/, distribute/, training/, profiler.py, cli.py. This file checks
its core for distribute/. Checked in a fresh interpreter, since this test process has imported
everything by now.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys


IMPORT_TIMEOUT_S = 60.0

_PROBE = """
import json, sys
import {module}
print(json.dumps(sorted(m for m in sys.modules if m == "mirrored" or m.startswith("mirrored."))))
"""


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
    import mirrored.distribute as md_pkg
    from pathlib import Path

    banned = re.compile(r"^\s*(?:from|import)\s+mirrored\.(?:training|cli|profiler)\b", re.MULTILINE)
    pkg_dir = Path(md_pkg.__file__).parent
    offenders = [f"{path.name}: {m.group(0).strip()}" for path in sorted(pkg_dir.glob("*.py"))
                 for m in banned.finditer(path.read_text())]
    assert not offenders


def test_distribute_names_neither_training_nor_keras():
    """Issue 23: distribute/modules.py imported training/'s Keras adapter by name through importlib,
    which the import check above does not see. The loader is registered from above now; no module of
    distribute/ names "mirrored.training" or imports keras, in any form."""
    import mirrored.distribute as md_pkg
    from pathlib import Path

    banned = re.compile(r"[\"']mirrored\.training\b|^\s*(?:from|import)\s+keras\b|import_module\([\"']keras",
                        re.MULTILINE)
    pkg_dir = Path(md_pkg.__file__).parent
    offenders = [f"{path.name}: {m.group(0).strip()}" for path in sorted(pkg_dir.glob("*.py"))
                 for m in banned.finditer(path.read_text())]
    assert not offenders
