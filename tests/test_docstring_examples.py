"""Every fenced ```python block in a public docstring runs (the examples the API page renders)."""

from __future__ import annotations

import inspect
import re
import textwrap

import pytest

import pbs
import pbs.analysis
import pbs.distributed
import pbs.integrations.dispatch

FENCE = re.compile(r"```python\n(.*?)^\s*```", re.S | re.M)


def _documented():
    objects = {"pbs": pbs, "PBSConfig.from_preset": pbs.PBSConfig.from_preset,
               "PBSIntegrationConfig": pbs.integrations.dispatch.PBSIntegrationConfig,
               "PBSIntegrationConfig.by_depth": pbs.integrations.dispatch.PBSIntegrationConfig.by_depth}
    for name in pbs.__all__:
        objects[f"pbs.{name}"] = getattr(pbs, name)
    for name in getattr(pbs.analysis, "__all__", []):
        objects[f"pbs.analysis.{name}"] = getattr(pbs.analysis, name)
    for name in pbs.distributed.__all__:
        objects[f"pbs.distributed.{name}"] = getattr(pbs.distributed, name)
    for label, obj in objects.items():
        for i, block in enumerate(FENCE.findall(inspect.getdoc(obj) or "")):
            yield pytest.param(textwrap.dedent(block), id=f"{label}[{i}]")


@pytest.mark.parametrize("code", list(_documented()))
def test_docstring_example_runs(code):
    exec(compile(code, "<docstring>", "exec"), {})


def test_examples_were_found():
    assert len(list(_documented())) >= 4
