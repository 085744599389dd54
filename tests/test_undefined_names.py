"""Every name a module reads is bound somewhere: a module-level name, an import or a builtin.

The benchmarks and scripts run on the GPU machine only, so a name a refactor removed from them
(as `PRECISIONS` from benchmarks/bench_fp8.py once) would surface there, after the device time is
spent. The compiler's own symbol tables find such names here without running anything.
"""

from __future__ import annotations

import builtins
import subprocess
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_ALWAYS_BOUND = set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__package__", "__spec__", "__loader__",
                                      "__builtins__", "__path__", "__annotations__"}


def unbound_names(source: str, filename: str = "<source>") -> list[tuple[str, str]]:
    """(scope, name) for each name read in ``source`` that no assignment, import, definition,
    ``global`` assignment or builtin binds. A module with ``import *`` is taken as binding all."""
    top = symtable.symtable(source, filename, "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    if "*" in bound:
        return []

    def bound_by_global_statements(table):
        for child in table.get_children():
            bound.update(s.get_name() for s in child.get_symbols() if s.is_declared_global() and s.is_assigned())
            bound_by_global_statements(child)

    bound_by_global_statements(top)
    unbound = []

    def check(table):
        at_module = table.get_type() == "module"
        for symbol in table.get_symbols():
            name = symbol.get_name()
            reads_a_global = symbol.is_referenced() and (at_module or symbol.is_global())
            if reads_a_global and name not in bound and name not in _ALWAYS_BOUND:
                unbound.append((table.get_name(), name))
        for child in table.get_children():
            check(child)

    check(top)
    return unbound


def _python_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [line for line in listed.stdout.splitlines() if (ROOT / line).is_file()]


def test_the_check_finds_a_removed_module_constant():
    source = "def speed_point():\n    for p in PRECISIONS:\n        pass\n"
    assert unbound_names(source) == [("speed_point", "PRECISIONS")]
    assert unbound_names("PRECISIONS = []\n" + source) == []


@pytest.mark.parametrize("path", _python_files())
def test_every_name_read_is_bound(path):
    assert unbound_names((ROOT / path).read_text(), path) == []
