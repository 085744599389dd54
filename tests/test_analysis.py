"""pbs.analysis: coverage-density curves, head statistics, attention maps, inputs and `pbs analyze`."""

from __future__ import annotations

import csv
import io
import json
import sys

import pytest
import torch

import pbs
from pbs.analysis import (
    BlockMassCache,
    ProgressBar,
    QKCapture,
    attention_maps,
    coverage_density_curves,
    head_statistics,
    load_capture,
    plot_attention_maps,
    plot_coverage_density,
    plot_head_statistics,
    save_capture,
    synthetic_capture,
    write_analysis,
)
from pbs.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def small_capture() -> QKCapture:
    return synthetic_capture(seq_len=1024, heads_q=4, heads_kv=2, head_dim=32)


@pytest.fixture(scope="module")
def workload_capture() -> QKCapture:
    # Long enough that the forced blocks (sink, diagonal segment) leave room for selection to differ.
    return synthetic_capture(seq_len=2048, heads_q=4, heads_kv=2, head_dim=32)


def assert_png(path) -> None:
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"


# -- coverage-density curves -------------------------------------------------------------------


def test_curves_are_monotone_and_reach_full_coverage_at_full_density(small_capture):
    curves = coverage_density_curves(small_capture, permuters=["identity", "random", "last_block"])
    assert curves.permuters == ["identity", "random", "last_block"]
    for curve in curves:
        assert curve.targets[-1] == 1.0 and list(curve.targets) == sorted(curve.targets)
        assert curve.density.shape == curve.coverage.shape == (4, len(curve.targets))
        assert (curve.density.diff(dim=-1) >= 0).all(), curve.permuter
        assert (curve.coverage.diff(dim=-1) >= -1e-6).all(), curve.permuter
        # The oracle reaches each target (up to float rounding) and full density means full coverage.
        targets = torch.tensor(curve.targets, dtype=torch.float64)
        assert (curve.coverage >= targets - 1e-5).all()
        assert torch.allclose(curve.density[:, -1], torch.ones(4, dtype=torch.float64))
        assert torch.allclose(curve.coverage[:, -1], torch.ones(4, dtype=torch.float64), atol=1e-5)
        assert (curve.density[:, 0] > 0).all()  # forced blocks are always there
        assert curve.coverage_at(1.0) == pytest.approx(1.0, abs=1e-5)


def test_last_block_reaches_coverage_at_lower_density_than_identity(workload_capture):
    curves = coverage_density_curves(workload_capture, permuters=["identity", "last_block"])
    identity, last_block = curves["identity"], curves["last_block"]
    assert last_block.density_at(0.95) < identity.density_at(0.95) - 0.05
    assert last_block.coverage_at(0.5) > identity.coverage_at(0.5) + 0.02
    assert "last_block" in curves.summary()
    with pytest.raises(KeyError, match="greedy"):
        curves["greedy"]


def test_densities_below_the_forced_blocks_are_unreachable_not_clamped(small_capture):
    # 1024 tokens, blocks of 128, segments of 256: the sink and diagonal blocks alone are density 0.55.
    curves = coverage_density_curves(small_capture, permuters=["identity", "last_block"])
    identity = curves["identity"]
    assert identity.min_density == pytest.approx(0.55)
    assert identity.forced_density.shape == identity.forced_coverage.shape == (4,)
    assert identity.coverage_at(0.3) is None and identity.coverage_at(0.5) is None
    assert not identity.reachable(0.5) and identity.reachable(0.55) and identity.reachable(0.7)
    # at the forced density the coverage is the forced blocks' own, not the next point's
    assert identity.coverage_at(0.55) == pytest.approx(float(identity.forced_coverage.mean()))
    assert identity.coverage_at(0.55) < float(identity.mean_coverage[0])
    summary = curves.summary(densities=(0.3, 0.7))
    assert "n/a (forced ≥ 0.550)" in summary and f"{identity.coverage_at(0.7):.3f}" in summary
    cells = {row["permuter"]: row["cells"] for row in curves.to_dict(summary_densities=(0.3, 0.7))["summary"]}
    assert cells["identity"][0] == {"density": 0.3, "coverage": None, "unreachable": True}
    assert cells["identity"][1]["unreachable"] is False and cells["identity"][1]["coverage"] > 0.9
    assert curves.to_dict()["curves"][0]["forced"]["density"] == pytest.approx(0.55)


def test_curves_reject_bad_arguments(small_capture):
    with pytest.raises(ValueError, match="coverage_targets"):
        coverage_density_curves(small_capture, permuters=["identity"], coverage_targets=[0.5, 1.5])
    with pytest.raises(ValueError, match="permuters"):
        coverage_density_curves(small_capture, permuters=[])
    with pytest.raises(ValueError, match="unknown permuter 'no_such_permuter'"):
        coverage_density_curves(small_capture, permuters=["no_such_permuter"])


# -- head statistics ---------------------------------------------------------------------------


def test_head_statistics_counts_add_up_and_agree_with_per_head_numbers(workload_capture):
    cache = BlockMassCache(workload_capture)
    stats = head_statistics(workload_capture, coverage_target=0.975, tolerance=0.01, cache=cache)
    assert len(stats.heads) == 4
    assert sum(stats.counts.values()) == len(stats.heads)
    for h in stats.heads:
        assert h.gain == pytest.approx(h.density_baseline - h.density_permuted)
        expected = "helped" if h.gain > 0.01 else "harmed" if h.gain < -0.01 else "unchanged"
        assert h.category == expected
        assert h.coverage_baseline >= 0.975 - 1e-5 and h.coverage_permuted >= 0.975 - 1e-5
    assert stats.counts["helped"] >= 2  # the heavy-hitter heads
    assert stats.mean_gain == pytest.approx(sum(h.gain for h in stats.heads) / 4)
    # The same densities as the curves' per-head points at that target (same cache, same oracle).
    curves = coverage_density_curves(workload_capture, ["identity", "last_block"], [0.975], cache=cache)
    at = curves["identity"].targets.index(0.975)
    assert [h.density_baseline for h in stats.heads] == pytest.approx(curves["identity"].density[:, at].tolist())
    assert [h.density_permuted for h in stats.heads] == pytest.approx(curves["last_block"].density[:, at].tolist())
    summary = stats.summary()
    assert "helped" in summary and "harmed" in summary and "0.975" in summary
    everything_unchanged = head_statistics(workload_capture, tolerance=1.0, cache=cache)
    assert everything_unchanged.counts == {"helped": 0, "unchanged": 4, "harmed": 0}


def test_block_mass_is_computed_once_per_layer_and_permuter(small_capture, monkeypatch):
    import pbs.analysis.mass as mass_module

    cache = BlockMassCache(small_capture)
    coverage_density_curves(small_capture, permuters=["identity", "last_block"], cache=cache)

    def fail(*args, **kwargs):
        raise AssertionError("block mass recomputed")

    monkeypatch.setattr(mass_module, "permuted_block_mass", fail)
    head_statistics(small_capture, cache=cache)  # identity and last_block come from the cache


def test_head_statistics_reject_bad_arguments(small_capture):
    with pytest.raises(ValueError, match="coverage_target"):
        head_statistics(small_capture, coverage_target=0.0)
    with pytest.raises(ValueError, match="tolerance"):
        head_statistics(small_capture, tolerance=-0.1)


# -- attention maps ----------------------------------------------------------------------------


def test_attention_maps_match_the_plan_of_the_same_config(small_capture):
    maps = attention_maps(small_capture, head=1, selector={"name": "mean_pool", "threshold": 0.9})
    assert [p.permuter for p in maps.panels] == ["identity", "last_block"]
    q, k = small_capture.queries[0], small_capture.keys[0]
    for panel in maps.panels:
        tq = tk = 1024 // 128
        assert panel.mass.shape == panel.selected.shape == panel.allowed.shape == (tq, tk)
        assert not (panel.selected & ~panel.allowed).any()
        assert torch.allclose(panel.mass.sum(-1), torch.ones(tq), atol=1e-4)
        assert 0 < panel.coverage <= 1 + 1e-6
        plan = pbs.plan(q, k, {"permuter": panel.permuter, "selector": {"name": "mean_pool", "threshold": 0.9}})
        assert panel.density == pytest.approx(float(plan.mask.density_per_head()[0, 1]))
        assert torch.equal(panel.selected, plan.mask.to_dense()[0, 1])
    assert maps.selector == "mean_pool(threshold=0.9)"


def test_attention_maps_reject_bad_head_and_layer(small_capture):
    with pytest.raises(ValueError, match="head must be in"):
        attention_maps(small_capture, head=4)
    with pytest.raises(ValueError, match="layer 3"):
        attention_maps(small_capture, head=0, layer=3)


# -- pictures and data files -------------------------------------------------------------------


def test_write_analysis_writes_valid_pictures_and_data(small_capture, tmp_path):
    report = write_analysis(small_capture, tmp_path / "out", permuters=["identity", "last_block"], head=2)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted(report.files) == sorted([
        "coverage_density.png", "coverage_density.json", "coverage_density.csv",
        "head_stats.png", "head_stats.json", "head_stats.csv",
        "attention_map.png", "attention_map.json",
    ])
    for path in report.files.values():
        if path.suffix == ".png":
            assert_png(path)
    curves = json.loads(report.files["coverage_density.json"].read_text())
    assert [c["permuter"] for c in curves["curves"]] == ["identity", "last_block"]
    assert len(curves["curves"][0]["heads"]) == 4
    rows = list(csv.DictReader(report.files["coverage_density.csv"].open()))
    n_targets = len(curves["curves"][0]["targets"])
    assert len(rows) == 2 * (1 + 4) * n_targets
    assert {r["scope"] for r in rows} == {"mean", "head"}
    heads = json.loads(report.files["head_stats.json"].read_text())
    assert sum(heads["counts"].values()) == len(heads["heads"]) == 4
    head_rows = list(csv.DictReader(report.files["head_stats.csv"].open()))
    assert [r["category"] for r in head_rows] == [h["category"] for h in heads["heads"]]
    maps = json.loads(report.files["attention_map.json"].read_text())
    assert maps["meta"]["head"] == 2 and len(maps["panels"]) == 2


def test_attention_map_marks_each_selected_block_and_leaves_holes_unmarked():
    from pbs.analysis.plotting import attention_map_figure, selection_squares

    # a selected ring around an unselected hole: the hole gets no square (a region outline would
    # have drawn around it)
    ring = torch.ones(3, 3, dtype=torch.bool)
    ring[1, 1] = False
    squares = selection_squares(ring, inset=0.1)
    assert len(squares) == 8
    assert all(not (x < 1 < x + w and y < 1 < y + h) for x, y, w, h in squares)
    assert squares[0] == pytest.approx((-0.4, -0.4, 0.8, 0.8))

    # two blocks per axis: matplotlib's default ticks would fall at half blocks (-0.5, 0, 0.5, ...)
    maps = attention_maps(synthetic_capture(seq_len=256, heads_q=2, heads_kv=1, head_dim=32), 0)
    fig = attention_map_figure(maps)
    fig.canvas.draw()
    for ax, panel in zip(fig.axes, maps.panels):
        (selection,) = [c for c in ax.collections if c.get_gid() == "selection"]
        assert len(selection.get_paths()) == int(panel.selected.sum())
        for ticks in (ax.get_xticks(), ax.get_yticks()):
            assert all(float(t).is_integer() for t in ticks)


def test_multi_layer_pictures(tmp_path):
    layers = [synthetic_capture(512, 2, 1, 32, seed=s) for s in (0, 1)]
    capture = QKCapture.from_tensors([c.queries[0] for c in layers], [c.keys[0] for c in layers], layer_ids=[3, 7])
    stats = head_statistics(capture)
    assert sorted({(h.layer, h.head) for h in stats.heads}) == [(3, 0), (3, 1), (7, 0), (7, 1)]
    assert_png(plot_head_statistics(stats, tmp_path / "heads.png"))  # the layer-by-head heat map
    curves = coverage_density_curves(capture, permuters=["identity"])
    assert len(curves["identity"].heads) == 4
    assert_png(plot_coverage_density(curves, tmp_path / "curves.png", show_heads=True))
    assert_png(plot_attention_maps(attention_maps(capture, 1, layer=7), tmp_path / "map.png"))


def test_missing_matplotlib_names_the_extra(small_capture, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pbs-attn\[analysis\]"):
        write_analysis(small_capture, tmp_path)
    assert main(["analyze", "--seq-len", "512", "--out", str(tmp_path), "--quiet"]) == 2


# -- inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_capture_round_trips_through_files(tmp_path, suffix):
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    q0, k0, _ = pbs.testing.make_qkv(seq_len=256, heads_q=4, heads_kv=2, head_dim=16, seed=1)
    q1, k1, _ = pbs.testing.make_qkv(seq_len=256, heads_q=4, heads_kv=2, head_dim=16, seed=2)
    for capture in (
        QKCapture.from_tensors(q0, k0),
        QKCapture.from_tensors([q0, q1], [k0, k1], layer_ids=[5, 12], source="two layers"),
    ):
        path = save_capture(capture, tmp_path / f"qk{capture.num_layers}{suffix}")
        loaded = load_capture(path)
        assert loaded.layer_ids == capture.layer_ids
        for a, b in zip(loaded.queries + loaded.keys, capture.queries + capture.keys):
            assert torch.equal(a, b)


def test_pt_files_in_the_documented_shapes_load(tmp_path):
    q, k, _ = pbs.testing.make_qkv(seq_len=256, heads_q=4, heads_kv=2, head_dim=16)
    torch.save({"q": q[0], "k": k[0]}, tmp_path / "rank3.pt")  # (H, N, D): batch of one
    loaded = load_capture(tmp_path / "rank3.pt")
    assert loaded.queries[0].shape == (1, 4, 256, 16) and loaded.layer_ids == (0,)
    torch.save({"q": [q, q], "k": [k, k], "layers": [2, 9]}, tmp_path / "lists.pt")
    assert load_capture(tmp_path / "lists.pt").layer_ids == (2, 9)


def test_bad_inputs_give_clear_errors(tmp_path):
    q, k, _ = pbs.testing.make_qkv(seq_len=256, heads_q=4, heads_kv=2, head_dim=16)
    with pytest.raises(FileNotFoundError, match="path: no such file"):
        load_capture(tmp_path / "missing.pt")
    torch.save({"query": q, "k": k}, tmp_path / "keys.pt")
    with pytest.raises(ValueError, match=r"keys 'q' and 'k'.*missing \['q'\].*found keys \['k', 'query'\]"):
        load_capture(tmp_path / "keys.pt")
    torch.save([q, k], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="must hold a dict"):
        load_capture(tmp_path / "list.pt")
    torch.save({"q": q[0, 0], "k": k}, tmp_path / "rank2.pt")
    with pytest.raises(ValueError, match=r"q must have rank 4 \(B, Hq, Nq, D\) or rank 3"):
        load_capture(tmp_path / "rank2.pt")
    torch.save({"q": [q, q[0, 0]], "k": [k, k]}, tmp_path / "rank_layer.pt")
    with pytest.raises(ValueError, match=r"q\[1\] must have rank 4"):
        load_capture(tmp_path / "rank_layer.pt")
    torch.save({"q": q[:, :3], "k": k}, tmp_path / "heads.pt")
    with pytest.raises(ValueError, match="multiple of"):
        load_capture(tmp_path / "heads.pt")
    torch.save({"q": [q, q], "k": [k]}, tmp_path / "layers.pt")
    with pytest.raises(ValueError, match="one entry per layer"):
        load_capture(tmp_path / "layers.pt")
    (tmp_path / "qk.npz").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"unsupported file type '\.npz'"):
        load_capture(tmp_path / "qk.npz")
    with pytest.raises(TypeError, match="QKCapture or a \\(q, k\\) pair"):
        coverage_density_curves(q)


def test_safetensors_errors(tmp_path, monkeypatch):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    q, k, _ = pbs.testing.make_qkv(seq_len=256, heads_q=4, heads_kv=2, head_dim=16)
    safetensors_torch.save_file({"q.0": q.contiguous()}, str(tmp_path / "half.safetensors"))
    with pytest.raises(ValueError, match=r"'q\.<layer>' and 'k\.<layer>'"):
        load_capture(tmp_path / "half.safetensors")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"pbs-attn\[analysis\]"):
        load_capture(tmp_path / "half.safetensors")


# -- progress bar ------------------------------------------------------------------------------


def test_progress_bar_writes_one_line_per_step_off_a_terminal_and_nothing_when_disabled():
    stream = io.StringIO()
    bar = ProgressBar(total=3, label="work", stream=stream)
    for name in ("a", "b", "c"):
        bar.advance(name)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and lines[-1].startswith("work [") and "3/3" in lines[-1] and lines[-1].endswith("c")
    quiet = io.StringIO()
    ProgressBar(total=2, stream=quiet, enabled=False).advance("x")
    assert quiet.getvalue() == ""


# -- command line ------------------------------------------------------------------------------


def test_cli_end_to_end_on_a_tiny_workload(tmp_path, capsys):
    out = tmp_path / "analysis"
    args = ["analyze", "--seq-len", "512", "--heads-q", "2", "--heads-kv", "1", "--head-dim", "32",
            "--permuters", "identity", "last_block", "--coverage-target", "0.95", "--head", "1", "--out", str(out)]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "head statistics: last_block vs identity at coverage 0.95, 2 heads" in captured.out
    assert "wrote 8 files" in captured.out and str(out / "coverage_density.png") in captured.out
    assert "n/a (forced ≥" in captured.out  # 512 tokens: densities 0.3 and 0.5 are below the forced blocks
    assert "pbs analyze [" in captured.err  # the progress bar
    assert_png(out / "coverage_density.png")
    assert json.loads((out / "attention_map.json").read_text())["meta"]["head"] == 1


def test_cli_reads_an_input_file(tmp_path, capsys):
    capture = synthetic_capture(512, 2, 1, 32)
    path = save_capture(capture, tmp_path / "qk.pt")
    assert main(["analyze", "--input", str(path), "--permuters", "identity", "--out", str(tmp_path / "o"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert str(path) in out and "wrote 8 files" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--input", "does/not/exist.pt"], "--input: no such file"),
        (["--head", "9"], "--head must be in [0, 2)"),
        (["--layer", "4"], "--layer must be one of the captured layers [0]"),
        (["--prompt-file", "p.txt"], "--prompt-file is only used with --model"),
        (["--model", "some/dir"], "--model needs --prompt-file"),
        (["--heads-kv", "3"], "--heads-q (2) must be a multiple of --heads-kv (3)"),
        (["--selector", "oracle", "--threshold", "0.8"], "--threshold: selector 'oracle' has no threshold"),
    ],
)
def test_cli_errors_name_the_argument(tmp_path, capsys, extra, message):
    base = ["analyze", "--seq-len", "256", "--heads-q", "2", "--heads-kv", "1", "--head-dim", "16",
            "--permuters", "identity", "--out", str(tmp_path), "--quiet"]
    assert main(base + extra) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_wrong_keys_in_input_file(tmp_path, capsys):
    torch.save({"x": torch.zeros(1)}, tmp_path / "bad.pt")
    assert main(["analyze", "--input", str(tmp_path / "bad.pt"), "--out", str(tmp_path), "--quiet"]) == 2
    assert "--input:" in capsys.readouterr().err


# -- transformers capture ----------------------------------------------------------------------


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=101, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_capture_from_a_tiny_llama_gives_post_rope_qk_and_leaves_the_model_alone():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from pbs.analysis import capture_qk

    model = tiny_llama()
    implementation = model.config._attn_implementation
    ids = torch.randint(0, 101, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits
    capture = capture_qk(model, ids)
    with torch.no_grad():
        after = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(before, after) and model.config._attn_implementation == implementation
    assert capture.layer_ids == (0, 1)
    assert capture.queries[0].shape == (1, 4, 300, 16) and capture.keys[0].shape == (1, 2, 300, 16)
    with torch.no_grad():  # layer 0's q/k recomputed by hand: projection, then RoPE
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        attn = model.model.layers[0].self_attn
        q = attn.q_proj(x).view(1, 300, 4, 16).transpose(1, 2)
        k = attn.k_proj(x).view(1, 300, 2, 16).transpose(1, 2)
        cos, sin = model.model.rotary_emb(x, torch.arange(300)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.allclose(capture.queries[0], q, atol=1e-6) and torch.allclose(capture.keys[0], k, atol=1e-6)
    only_second = capture_qk(model, ids, layers=[1])
    assert only_second.layer_ids == (1,) and torch.equal(only_second.keys[0], capture.keys[1])
    with pytest.raises(ValueError, match="layers"):
        capture_qk(model, ids, layers=[5])
    assert head_statistics(capture).heads  # the capture feeds the analyses


def test_capture_from_a_saved_model_directory(tmp_path):
    from pbs.analysis import capture_qk_from_pretrained

    model = tiny_llama()
    model.save_pretrained(tmp_path / "tiny")
    ids = torch.randint(0, 101, (1, 300), generator=torch.Generator().manual_seed(0))
    capture = capture_qk_from_pretrained(tmp_path / "tiny", input_ids=ids, seq_len=256, layers=[0])
    assert capture.queries[0].shape == (1, 4, 256, 16) and capture.layer_ids == (0,)
    with pytest.raises(FileNotFoundError, match="model_path"):
        capture_qk_from_pretrained(tmp_path / "nope", input_ids=ids)
    with pytest.raises(ValueError, match="seq_len"):
        capture_qk_from_pretrained(tmp_path / "tiny", input_ids=ids, seq_len=400)
