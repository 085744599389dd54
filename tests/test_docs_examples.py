"""README.md and docs/*.md: every example runs, and every output a page shows is what the code prints now.

The pages are read by Sybil (https://sybil.readthedocs.io), not by a comparer of our own:

* A ```python block runs. One that starts with ``>>>`` is a doctest: the output it shows under each
  statement is compared with what the statement prints.
* A ```console block is a command (``$ pbs ...``, the first line) and the output it shows. The command
  runs on the CPU (``CUDA_VISIBLE_DEVICES`` empty) and what it writes to stdout is compared with the
  block; when it exits with an error, what it writes to stderr.
* ``<!-- skip: next -->`` (an HTML comment, not rendered) before a block skips it: code that needs a
  GPU, a network or a model file.

The blocks of one page run in order in one namespace (a later block may use names from an earlier
one) and in a temporary working directory, with the environment a user has: ``TRITON_INTERPRET`` is
unset (conftest sets it on CPU-only machines). Permuters and selectors that a page registers are
unregistered afterwards, so they do not leak into other tests.

**Tolerance.** Numbers are compared to the precision the page writes them with (Sybil's ``NUMBER``
option: a page may show ``0.39`` for a printed ``0.3915``; where the code rounds, as every
``f"{x:.3f}"`` here does, the shown digits must be the printed ones). ``...`` stands for any text
(doctest's ``ELLIPSIS``), used for what is not the library's (a pydantic version in a URL). Times are
not compared: in a command's table the cells of a column whose header ends in ``ms`` or ``(s)`` are
masked, since times on a shared CPU vary by up to 3x between runs. Everything else must match.
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.evaluators.doctest import NUMBER, OutputChecker
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPTIONFLAGS = NUMBER | doctest.ELLIPSIS
COMMAND_TIMEOUT_S = 120

# A header cell that names a time: "plan ms", "total ms", "TTFT (s)", "min (s)".
_TIME_HEADER = re.compile(r"(?<!\S)(?:[\w.]+ )?(?:ms|\(s\))(?=\s|$)")
_TOKEN = re.compile(r"\S+")
_TIME_CELL = re.compile(r"-|[\d.]+(?:e[-+]?\d+)?")


def mask_times(text: str) -> str:
    """``text`` with every cell of a time column replaced by ``~``.

    A time column is one whose header ends in ``ms`` or ``(s)``; its cells, up to the next blank
    line, are right-aligned to the header's last character.
    """
    out, columns = [], set()
    for line in text.splitlines():
        if not line.strip():
            columns = set()
        elif _TIME_HEADER.search(line) and not re.search(r"\d\s*(?:ms|\(s\))", line):
            columns = {m.end() for m in _TIME_HEADER.finditer(line)}
        elif columns:
            chars = list(line)
            for m in _TOKEN.finditer(line):
                if m.end() in columns and _TIME_CELL.fullmatch(m.group()):
                    chars[m.start():m.end()] = "~".rjust(len(m.group()))
            line = "".join(chars)
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def run_command(example) -> str | None:
    """Sybil evaluator of a ```console block: run its ``$ pbs ...`` line, compare what it prints."""
    text = str(example.parsed)
    first, _, want = text.partition("\n")
    if not first.startswith("$ "):
        return f"a console block starts with '$ <command>', not {first!r}"
    argv = shlex.split(first[2:])
    if argv[0] == "pbs":
        argv = [sys.executable, "-m", "pbs", *argv[1:]]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=COMMAND_TIMEOUT_S)
    got = result.stdout if result.returncode == 0 else result.stderr
    checker = OutputChecker()
    if checker.check_output(mask_times(want), mask_times(got), OPTIONFLAGS):
        return None
    shown = doctest.Example(first[2:], mask_times(want))
    return (f"`{first[2:]}` (exit status {result.returncode}) printed something else; times masked as ~:\n"
            + checker.output_difference(shown, mask_times(got), OPTIONFLAGS | doctest.REPORT_NDIFF))


SYBIL = Sybil(
    parsers=[
        PythonCodeBlockParser(doctest_optionflags=OPTIONFLAGS),
        CodeBlockParser(language="console", evaluator=run_command),
        SkipParser(),
    ],
    path=str(ROOT),
)


def _examples(path: Path) -> list:
    return list(SYBIL.parse(path).examples())


FILES_WITH_EXAMPLES = [p for p in DOC_FILES if p.exists() and _examples(p)]


def test_readme_has_examples():
    assert ROOT / "README.md" in FILES_WITH_EXAMPLES


@pytest.mark.parametrize("path", FILES_WITH_EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_examples_run_and_print_what_they_show(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pbs.components import permuter_registry, selector_registry

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.chdir(tmp_path)
    registries = (permuter_registry, selector_registry)
    before = [set(r.names()) for r in registries]
    document = SYBIL.parse(path)
    # A real module in sys.modules, as for a script: pydantic resolves a model's annotations
    # (e.g. ``Literal``) through the module its class was defined in.
    module = types.ModuleType(f"docs_example_{path.stem.replace('-', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    document.namespace = module.__dict__
    try:
        for example in document.examples():
            example.evaluate()
    finally:
        for registry, names in zip(registries, before):
            for name in set(registry.names()) - names:
                registry.unregister(name)


def _python_blocks(path: Path):
    parser = CodeBlockParser(language="python", evaluator=lambda example: None)
    text = path.read_text(encoding="utf-8")
    for region in parser(SYBIL.parse(path)):
        yield text.count("\n", 0, region.start) + 1, str(region.parsed)


def test_a_block_that_prints_shows_what_it_prints():
    """A ```python block that prints is a doctest, so its output is on the page and checked."""
    silent = [f"{path.relative_to(ROOT)}:{line}" for path in DOC_FILES if path.exists()
              for line, code in _python_blocks(path)
              if not code.startswith(">>>") and re.search(r"(?<![\w.])print\(", code)]
    assert not silent, f"python blocks that print without showing it (write them as >>> doctests): {silent}"


def test_mask_times_masks_only_time_columns():
    table = ("method        tau  density   plan ms  total ms\n"
             "dense           -    1.000         -    3819.5\n"
             "PBS         0.900    0.391      12.5    1636.9\n"
             "\n"
             "attention    TTFT (s)  runs\n"
             "sdpa           0.0103     5\n")
    masked = mask_times(table).splitlines()
    assert masked[1] == "dense           -    1.000         ~         ~"
    assert masked[2] == "PBS         0.900    0.391         ~         ~"
    assert masked[5] == "sdpa                ~     5"
    assert mask_times("density 0.391, 12 ms\n") == "density 0.391, 12 ms\n"  # prose, not a header


def test_a_wrong_number_fails():
    """The comparison is not vacuous: a changed digit in a shown output fails."""
    checker = OutputChecker()
    assert checker.check_output("density 0.39\n", "density 0.3915\n", OPTIONFLAGS)  # fewer digits shown
    assert checker.check_output("density 0.391\n", "density 0.391\n", OPTIONFLAGS)
    assert not checker.check_output("density 0.391\n", "density 0.392\n", OPTIONFLAGS)
    assert not checker.check_output("identity density 0.465 coverage 0.876\n",
                                    "identity density 0.733 coverage 0.988\n", OPTIONFLAGS)



def test_an_example_may_import_gluon_after_tests_imported_triton_under_the_interpreter():
    # The examples above unset TRITON_INTERPRET. A process that had imported triton.language under
    # the interpreter (any Triton test) and then imported Gluon for the first time failed Gluon's
    # own assert: every example after tests/test_hopper_attn.py in one process did. The conftest
    # imports Gluon while the interpreter is on; this replays that order in a fresh process.
    pytest.importorskip("triton.experimental.gluon")
    code = ("import os, tests.conftest, triton.language; os.environ.pop('TRITON_INTERPRET', None); "
            "import pbs.kernels.hopper_attn")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
