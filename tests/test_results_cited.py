"""The results policy of ``benchmarks/results/README.md``: a result is kept only while a page cites it.

Every file under ``benchmarks/results/`` (the index itself and git-ignored files aside) lives in a topic
folder, is listed in the index and is named by its file name in ``README.md`` or ``docs/*.md``
(``name.json``, or ``name.*`` for a ``.json`` / ``.md`` pair); every ``benchmarks/results/...`` path those
pages name exists; and the index's links and "cited in" column hold.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "README.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def result_files() -> list[str]:
    """Files under benchmarks/results, relative to it; git-ignored ones and the index left out."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", "."],
            cwd=RESULTS, capture_output=True, text=True, check=True, timeout=60,
        ).stdout.split("\0")
    except (OSError, subprocess.SubprocessError):  # a copy of the tree without .git
        listed = [str(path.relative_to(RESULTS)) for path in RESULTS.rglob("*")]
    return sorted(name for name in listed if name and name != "README.md" and (RESULTS / name).is_file())


def words(text: str) -> set[str]:
    """File-name-like words of a text (``a/b/foo.json`` gives ``foo.json``; sentence dots dropped)."""
    return {word.rstrip(".") for word in re.findall(r"[\w.*-]+", text)}


def cites(page_words: set[str], name: str) -> bool:
    stem = Path(name).stem
    return name in page_words or f"{stem}.*" in page_words


@pytest.fixture(scope="module")
def files() -> list[str]:
    found = result_files()
    assert found, "no result files found"
    return found


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in PAGES}


def test_every_result_is_in_a_topic_folder(files):
    loose = [name for name in files if "/" not in name]
    assert not loose, f"results outside a topic folder of benchmarks/results: {loose}"


def test_every_result_is_listed_in_the_index(files):
    index = INDEX.read_text(encoding="utf-8")
    missing = [name for name in files if f"]({name})" not in index]
    assert not missing, f"not listed in benchmarks/results/README.md: {missing}"


def test_every_result_is_cited_by_a_page(files, pages):
    page_words = [words(text) for text in pages.values()]
    uncited = [name for name in files if not any(cites(w, Path(name).name) for w in page_words)]
    assert not uncited, f"cited by no page (README.md, docs/*.md), so not kept: {uncited}"


def test_every_results_path_the_pages_name_exists(pages):
    missing = []
    for page, text in pages.items():
        for path in set(re.findall(r"benchmarks/results/[\w./<>*-]*", text)):
            path = path.rstrip(".")
            pattern = re.sub(r"<[^>]*>", "*", path)
            if "*" in pattern:
                found = glob.glob(pattern, root_dir=ROOT)
            else:
                found = (ROOT / pattern).exists()
            if not found:
                missing.append(f"{page}: {path}")
    assert not missing, f"results paths that do not exist: {missing}"


def test_the_index_links_and_cited_in_column_hold(pages):
    page_words = {page: words(text) for page, text in pages.items()}
    bad = []
    for line in INDEX.read_text(encoding="utf-8").splitlines():
        for target in re.findall(r"\]\(([^)#\s]+)", line):
            if not (RESULTS / target).exists():
                bad.append(f"link to a missing file: {target}")
        if not line.startswith("| [`"):
            continue
        cells = line.strip().strip("|").split("|")
        listed = [Path(target).name for target in re.findall(r"\]\(([^)]+)\)", cells[0])]
        for target in re.findall(r"\]\(([^)]+)\)", cells[-1]):
            page = os.path.normpath(os.path.relpath(RESULTS / target, ROOT))
            bad += [f"{name}: the index says {page} cites it" for name in listed
                    if page not in page_words or not cites(page_words[page], name)]
    assert not bad, bad


def test_the_index_counts_each_folders_files(files):
    counted = {}
    for line in INDEX.read_text(encoding="utf-8").splitlines():
        row = re.match(r"\| \[`(\w+)/`\]\(#\w+\) \|.*\| (\d+) \|$", line)
        if row:
            counted[row.group(1)] = int(row.group(2))
    actual = {}
    for name in files:
        actual[name.split("/")[0]] = actual.get(name.split("/")[0], 0) + 1
    assert counted == actual, f"the folder table of benchmarks/results/README.md says {counted}, the folders hold {actual}"
