"""Every ```python block in README.md and docs/*.md runs, so the docs cannot rot.

The blocks of one file run in order in one namespace (a later block may use names from an earlier
one). A block whose first line is ``# not-run`` is skipped: use it for code that needs a GPU, a
network or a model. Examples run with the environment a user has: ``TRITON_INTERPRET`` is unset
(conftest sets it on CPU-only machines, which would route ``backend="auto"`` through the Triton
interpreter), and in a temporary working directory. Permuters and selectors that a file registers
are unregistered afterwards, so they do not leak into other tests.
"""

from __future__ import annotations

import re
import sys
import textwrap
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
SKIP_MARKER = "# not-run"


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """``(line number, code)`` of every ```python block of ``path`` that is meant to run."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for m in _FENCE.finditer(text):
        if m.group("lang").strip().split(" ")[0] not in ("python", "py"):
            continue
        code = textwrap.dedent(m.group("body"))
        first = code.lstrip("\n").split("\n", 1)[0].strip()
        if first == SKIP_MARKER:
            continue
        line = text.count("\n", 0, m.start("body")) + 1
        blocks.append((line, code))
    return blocks


FILES_WITH_EXAMPLES = [p for p in DOC_FILES if p.exists() and python_blocks(p)]


def test_readme_has_examples():
    assert ROOT / "README.md" in FILES_WITH_EXAMPLES


@pytest.mark.parametrize("path", FILES_WITH_EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_examples_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pbs.components import permuter_registry, selector_registry

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.chdir(tmp_path)
    registries = (permuter_registry, selector_registry)
    before = [set(r.names()) for r in registries]
    # A real module in sys.modules, as for a script: pydantic resolves a model's annotations
    # (e.g. ``Literal``) through the module its class was defined in.
    module = types.ModuleType(f"docs_example_{path.stem.replace('-', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    try:
        for line, code in python_blocks(path):
            rel = path.relative_to(ROOT)
            compiled = compile("\n" * (line - 1) + code, str(rel), "exec")
            try:
                exec(compiled, namespace)
            except Exception as exc:
                raise AssertionError(f"the example at {rel}:{line} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        for registry, names in zip(registries, before):
            for name in set(registry.names()) - names:
                registry.unregister(name)
