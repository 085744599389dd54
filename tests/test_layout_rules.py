"""Rules of the package layout that a newcomer relies on.

A permuter or selector file holds its config and reference implementation; the math they share
(grouped logits, block means, the cumulative threshold, forced blocks, seeded draws) lives in
`pbs.reference`, so no component imports another component package or the planning module.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pbs"
COMPONENT_PACKAGES = {"permuters": "pbs.selectors", "selectors": "pbs.permuters"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(COMPONENT_PACKAGES))
def test_components_import_neither_the_other_package_nor_planning(package):
    offenders = {}
    for path in sorted((PACKAGE / package).glob("*.py")):
        bad = {
            name for name in _imports(path)
            if name.startswith(COMPONENT_PACKAGES[package]) or name == "pbs.planning"
        }
        if bad:
            offenders[path.name] = sorted(bad)
    assert not offenders, f"move the shared code to pbs.reference: {offenders}"


def test_kernels_with_an_eager_twin_in_reference_share_its_stem():
    twins = {"block_means", "threshold_select", "density_probe", "block_sets", "block_sparse_attn", "gather", "pad_rows"}
    for stem in twins:
        assert (PACKAGE / "kernels" / f"{stem}.py").exists()
        assert (PACKAGE / "reference" / f"{stem}.py").exists(), f"pbs/reference/{stem}.py is missing"


def test_every_kernel_module_has_its_test_file():
    tests = Path(__file__).resolve().parent
    missing = [
        path.name for path in sorted((PACKAGE / "kernels").glob("*.py"))
        if path.stem != "__init__"
        and not (tests / f"test_{path.stem}.py").exists()
        and not (tests / f"test_kernel_{path.stem.lstrip('_')}.py").exists()
    ]
    assert not missing, f"kernels without a test file of their own: {missing}"


def test_the_command_line_is_one_package_with_a_module_per_subcommand():
    import pbs.cli

    cli = PACKAGE / "cli"
    assert (cli / "__init__.py").exists()
    modules = {path.stem for path in cli.glob("*.py")} - {"__init__", "common"}
    assert modules == set(pbs.cli.SUBCOMMANDS), "each subcommand's module is named after the command"
    strays = [
        str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*cli*.py")
        if cli not in path.parents
    ]
    assert not strays, f"command-line code outside pbs/cli/: {strays}"


BENCHMARKS = PACKAGE.parent / "benchmarks"


def test_benchmark_scripts_share_only_benchmarks_common_and_public_pbs_names():
    """Scripts do not import one another (what they share is in benchmarks/common.py) nor private
    names of pbs, and write results only through ``benchmarks.common.save`` (which records the
    command and the git revision)."""
    scripts = {path.stem for path in BENCHMARKS.glob("*.py")} - {"__init__", "common"}
    offenders: dict[str, list[str]] = {}
    for path in sorted([*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("cpu/*.py")]):
        bad = []
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules, names = [node.module], [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                modules, names = [alias.name for alias in node.names], []
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if parts[0] in scripts or (parts[0] == "benchmarks" and module != "benchmarks.common"):
                    bad.append(f"imports {module}")
                if parts[0] == "pbs" and any(part.startswith("_") for part in parts):
                    bad.append(f"imports the private module {module}")
                if parts[0] == "pbs":
                    bad += [f"imports the private name {module}.{name}" for name in names if name.startswith("_")]
        if path.stem != "common" and ("json.dump(" in source or "write_text(json.dumps(" in source):
            bad.append("writes JSON itself instead of through benchmarks.common.save")
        if bad:
            offenders[str(path.relative_to(BENCHMARKS.parent))] = bad
    assert not offenders, offenders


def test_benchmark_results_hold_no_pytest_logs():
    """Test runs are summarised in the docs ("81 passed"), not stored as logs beside the results."""
    import re

    pytest_output = re.compile(r"^\.+\s*\[\s*\d+%\]|\b\d+ (passed|failed)\b", re.MULTILINE)
    logs = [
        str(path.relative_to(BENCHMARKS)) for path in sorted((BENCHMARKS / "results").rglob("*.log"))
        if path.name.startswith("gpu_tests") or pytest_output.search(path.read_text(errors="replace"))
    ]
    assert not logs, f"pytest logs in benchmarks/results: {logs}"


def test_benchmark_results_take_the_revision_passed_in_over_a_copied_git(monkeypatch):
    from benchmarks.common import git_revision

    monkeypatch.setenv("PBS_GIT_REVISION", "0123abcd")
    assert git_revision() == ("0123abcd", None)
    monkeypatch.delenv("PBS_GIT_REVISION")
    revision, _ = git_revision()
    assert revision != "0123abcd"


def test_the_defaults_plot_draws_every_protocol_of_a_result(tmp_path):
    # benchmarks/plot_defaults.py turns a bench_defaults.py result into the docs' picture; each of
    # its protocols must be a line (a result without one of them simply has no such line).
    import matplotlib

    matplotlib.use("Agg")
    import subprocess
    import sys

    from benchmarks.plot_defaults import PROTOCOLS, series

    result = json.loads((BENCHMARKS / "results" / "defaults" / "defaults_h100_launch_first.json").read_text())
    for kind in ("flat", "structured"):
        for key in PROTOCOLS:
            lengths, ratios = series(result["rows"], kind, key)
            assert lengths == sorted(lengths) and len(lengths) == 7 and all(0.5 < x < 1.5 for x in ratios)
    out = tmp_path / "plot.png"
    subprocess.run([sys.executable, str(BENCHMARKS / "plot_defaults.py"),
                    str(BENCHMARKS / "results" / "defaults" / "defaults_h100_launch_first.json"), "--out", str(out)], check=True)
    assert out.stat().st_size > 10_000


def test_the_fp8_plot_draws_every_precision_on_each_kernel_of_a_result(tmp_path):
    # benchmarks/plot_fp8.py turns a bench_fp8.py result into docs/fp8.md's picture: each precision
    # the file times on each kernel is a line, with its speed-up over the bf16 Gluon kernel.
    import subprocess
    import sys

    from benchmarks.plot_fp8 import paths, series

    path = BENCHMARKS / "results" / "kernel" / "fp8_int8_gluon_h200_aad513e.json"
    points = json.loads(path.read_text())["points"]
    assert [label for _, label in paths(points)] == [
        "fp8, Gluon", "int8_qk, Gluon", "int8_qk_fp8_pv, Gluon", "fp8, Triton", "int8_qk, Triton", "int8_qk_fp8_pv, Triton"]
    densities, speedups, tflops = series(points, 131072, "fp8_hopper")
    assert densities == sorted(densities) and len(densities) == 4
    assert abs(speedups[-1] - 225.4786 / 175.2583) < 1e-3 and abs(tflops[-1] - 804.6) < 0.1  # 128K, density 1.0
    out = tmp_path / "plot.png"
    subprocess.run([sys.executable, str(BENCHMARKS / "plot_fp8.py"), str(path), "--out", str(out)], check=True)
    assert out.stat().st_size > 10_000



def test_the_sustained_plot_draws_each_call_over_the_first_and_the_clock(tmp_path):
    # benchmarks/plot_sustained.py turns a bench_sustained.py result into docs/benchmarks.md's picture.
    import subprocess
    import sys

    from benchmarks.plot_sustained import relative

    assert relative([10.0, 11.0, 9.0]) == [1.0, 1.1, 0.9]
    path = BENCHMARKS / "results" / "defaults" / "sustained_h200_46eff0f.json"
    point = json.loads(path.read_text())["points"][1]
    steady = relative(point["pbs_run"]["calls_ms"])[-5:]
    assert point["seq_len"] == 65536 and all(1.1 < r < 1.25 for r in steady)  # the 64K kernel at the cap
    out = tmp_path / "plot.png"
    subprocess.run([sys.executable, str(BENCHMARKS / "plot_sustained.py"), str(path), "--out", str(out)], check=True)
    assert out.stat().st_size > 10_000

# -- the floors of the package: every import looks down -------------------------------------------
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("values", ("pbs.layout", "pbs.ragged_layout", "pbs.config_view", "pbs.types", "pbs.registry", "pbs.validation", "pbs.components", "pbs.config")),
    ("eager twins and shared math", ("pbs.reference",)),
    ("kernel launchers", ("pbs.kernels",)),
    ("components", ("pbs.permuters", "pbs.selectors")),
    ("dispatch", ("pbs.backends",)),
    ("planning and the dense policy", ("pbs.planning", "pbs.dense")),
    ("entry points", ("pbs.api", "pbs.ops", "pbs.testing", "pbs.serving", "pbs.distributed")),
    ("users of the entry points", ("pbs.integrations", "pbs.cli", "pbs.analysis", "pbs.demo", "pbs.__main__", "pbs")),
)
"""Floors from the bottom up (docs/contributing.md draws them): a module imports only modules of its
own floor or of floors below. ``pbs`` itself (the package's public names) is the top floor."""

KERNEL_FORBIDDEN = ("pbs.planning", "pbs.selectors", "pbs.permuters", "pbs.api", "pbs.dense", "pbs.integrations",
                    "pbs.backends", "pbs.components", "pbs.config")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _pbs_imports(path: Path) -> set[str]:
    """The pbs modules ``path`` imports: at module level, inside functions, and under ``if
    TYPE_CHECKING:`` (an import for annotations is still an edge of the drawing)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {name for name in found if name in MODULES}


def _floor(module: str) -> int:
    best = None
    for index, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is on no floor: add it to FLOORS in tests/test_layout_rules.py"
    return best[0]


def test_every_import_looks_down_the_floors():
    offenders = []
    for module, path in sorted(MODULES.items()):
        for imported in sorted(_pbs_imports(path) - {module}):
            if imported == "pbs" and module != "pbs":
                if _floor(module) < len(FLOORS) - 1:
                    offenders.append(f"{module} imports the package root pbs")
            elif _floor(imported) > _floor(module):
                offenders.append(f"{module} ({FLOORS[_floor(module)][0]}) imports {imported} "
                                 f"({FLOORS[_floor(imported)][0]})")
    assert not offenders, "\n".join(offenders)


def test_kernel_launchers_import_no_floor_above_them():
    offenders = {
        module: sorted(name for name in _pbs_imports(path)
                       if any(name == f or name.startswith(f + ".") for f in KERNEL_FORBIDDEN))
        for module, path in MODULES.items() if module.startswith("pbs.kernels")
    }
    offenders = {module: names for module, names in offenders.items() if names}
    assert not offenders, f"kernels take tensors, a Layout and plain arguments: {offenders}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_no_import_circle_even_through_function_level_or_type_checking_imports():
    """Imports inside functions and under ``if TYPE_CHECKING:`` count: they hide a circle, they do
    not remove it (the drawing of the package from its imports still shows it). A lower module
    that must name a higher one's type names a protocol below both (`pbs.config_view`)."""
    graph = {module: _pbs_imports(path) - {module} for module, path in MODULES.items()}
    assert not _cycles(graph)


def test_the_config_view_protocol_names_the_fields_of_pbs_config():
    # pbs.types and pbs.components name the config through ConfigView (the values floor imports
    # one way); a field added to PBSConfig and not to the protocol would be invisible below it.
    from pbs.config import PBSConfig
    from pbs.config_view import ConfigView

    members = {name for name in vars(ConfigView) if isinstance(vars(ConfigView)[name], property)}
    assert members == set(PBSConfig.model_fields)


def test_the_circle_finder_finds_circles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_parallel_gpu_script_runs_every_file_with_gpu_tests():
    # scripts/gpu_tests_parallel.sh lists its test files by hand in groups: a file with GPU tests
    # that no group names would never run there.
    import re

    root = PACKAGE.parent
    script = (root / "scripts" / "gpu_tests_parallel.sh").read_text()
    grouped = set(re.findall(r"tests/test_\w+\.py", script))
    with_gpu_tests = {f"tests/{path.name}" for path in (root / "tests").glob("test_*.py")
                      if re.search(r"^\s*@pytest\.mark\.gpu\b|^pytestmark\s*=.*\bgpu\b", path.read_text(), re.M)}
    assert with_gpu_tests, "no GPU tests found"
    assert with_gpu_tests <= grouped, f"not in any group: {sorted(with_gpu_tests - grouped)}"
    assert grouped <= {f"tests/{path.name}" for path in (root / "tests").glob("test_*.py")}


# -- one policy, one dispatch layer (issue 36) --------------------------------------------------------
DENSE_RULE_FIELDS = {"min_seq_len", "max_density", "max_planned_density"}


def _decisions_on_dense_rule_fields(path: Path) -> list[str]:
    """Comparisons that read a ``dense_fallback`` rule's field, and reason strings (f-strings)
    that say a call went dense because of one: what only `pbs.dense.DensePolicy` may do."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and not all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            sides = [node.left, *node.comparators]
            names = {s.attr for s in sides if isinstance(s, ast.Attribute)} & DENSE_RULE_FIELDS
            if names:
                found.append(f"line {node.lineno}: compares {', '.join(sorted(names))}")
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
            if any(f"dense_fallback.{field}" in text for field in DENSE_RULE_FIELDS) and (
                    "above" in text or "below" in text):
                found.append(f"line {node.lineno}: writes a dense-fallback reason")
    return found


def test_only_the_dense_policy_decides_dense_or_writes_its_reasons():
    """No path keeps a private copy of a dense-fallback rule: they call `pbs.dense.DensePolicy`
    (``too_short``, ``probe_reason``, ``sequence_decisions``...). The config validates its own
    fields, and the integrations only pass ``min_seq_len`` on."""
    allowed = {"pbs.dense", "pbs.config", "pbs.integrations.dispatch"}
    offenders = {module: found for module, path in MODULES.items()
                 if module not in allowed and (found := _decisions_on_dense_rule_fields(path))}
    assert not offenders, offenders


def test_the_dense_rule_finder_finds_a_copied_rule(tmp_path):
    copied = tmp_path / "copied.py"
    copied.write_text('def f(n, config):\n    if n < config.dense_fallback.min_seq_len:\n'
                      '        return f"Nk = {n} is below dense_fallback.min_seq_len"\n')
    assert len(_decisions_on_dense_rule_fields(copied)) == 2


def test_only_the_dispatch_layer_launches_kernels():
    """Attention, planning and probe kernels are launched from `pbs.backends` (and the launchers
    call each other): no path above it imports `pbs.kernels` to launch around the registry."""
    offenders = {module: sorted(name for name in _pbs_imports(path) if name.startswith("pbs.kernels"))
                 for module, path in MODULES.items()
                 if not module.startswith(("pbs.kernels", "pbs.backends"))}
    offenders = {module: names for module, names in offenders.items() if names}
    assert not offenders, offenders


def test_no_path_keeps_a_private_list_of_component_names():
    """What a path runs is a capability (a registered planner, a declared flag), not a tuple of
    selector or permuter names kept in the path (``SUPPORTED_SELECTORS``, ``CAPTURABLE_BACKENDS``)."""
    import pbs

    names = set(pbs.list_selectors()) | set(pbs.list_permuters()) | set(pbs.list_backends())
    offenders = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List, ast.Set)):
                items = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
                if len(items) >= 2 and all(isinstance(i, str) and i in names for i in items):
                    offenders.append(f"{module} line {node.lineno}: {items}")
    assert not offenders, offenders
