"""The docs site builds with ``mkdocs build --strict`` (broken links, missing pages and bad
docstring references fail the build), so the site cannot rot unnoticed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


import re

import pytest


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("docs") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    return site, result


def test_mkdocs_build_strict(built_site):
    site, result = built_site
    assert result.returncode == 0, result.stdout + result.stderr
    assert (site / "index.html").exists()
    assert (site / "api" / "index.html").exists()


def test_api_page_renders_docstrings(built_site):
    """mkdocstrings renders Google-style docstrings; the build does not catch these mistakes."""
    site, result = built_site
    assert result.returncode == 0, result.stdout + result.stderr
    html = (site / "api" / "index.html").read_text()
    # Sphinx roles are not understood and would show as literal text.
    roles = re.findall(r":(?:class|func|meth|data|attr|mod|obj):`", html)
    assert not roles, f"{len(roles)} literal Sphinx roles on the API page"
    # Doctest prompts render as nested quotes: examples are fenced code blocks instead.
    assert "&gt;&gt;&gt;" not in html
    # Every Example section of the public API holds a code block.
    examples = html.split(">Example")[1:]
    assert examples, "no Example section found on the API page"
    for section in examples:
        assert "<code" in section.split("doc-heading")[0], "an Example section without a code block"
    # The Returns section of pbs.plan is a description, not a mis-parsed name/type row.
    plan = html.split('id="pbs.plan"')[1].split('id="pbs.run"')[0]
    assert "<code>A</code>" not in plan


def _returns_rows(html: str) -> dict[str, int]:
    """Rows of the Returns table of every documented object on the API page, by its id."""
    rows = {}
    anchors = list(re.finditer(r'id="(pbs[\w.]*)"', html))
    for anchor, following in zip(anchors, anchors[1:] + [None]):
        section = html[anchor.end():following.start() if following else len(html)]
        start = section.find(">Returns")
        if start < 0:
            continue
        table = section[start:].split("</table>")[0]
        rows[anchor.group(1)] = len(re.findall(r"<tr\b", table.split("</thead>")[-1]))
    return rows


def test_a_returns_section_renders_as_one_row(built_site):
    """Google-style docstrings parse a Returns line "x: y" as a new item: without
    ``returns_multiple_items: false`` in mkdocs.yml, the one sentence of ``pbs.attention``'s Returns
    rendered as five table rows, each repeating the type."""
    site, result = built_site
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _returns_rows((site / "api" / "index.html").read_text())
    for name in ("pbs.attention", "pbs.kernels.block_sparse_attn.block_sparse_attention",
                 "pbs.integrations.ttft.measure_ttft"):
        assert rows.get(name) == 1, f"the Returns table of {name} has {rows.get(name)} rows"
    split = {name: n for name, n in rows.items() if n != 1}
    assert not split, f"Returns tables of more than one row: {split}"
