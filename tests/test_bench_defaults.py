"""`benchmarks/bench_defaults.py` names the path the defaults took by the rule the plan records, and
times the config it is given (``--preset``, ``--config``)."""

from __future__ import annotations

import dataclasses

import pytest

import pbs
from benchmarks import bench_defaults


@pytest.mark.parametrize("rule, label", [("length", "dense (length)"), ("probe", "dense (probe, SDPA)"),
                                         ("planned_density", "dense (density)"), (None, "sparse (density")])
def test_the_path_label_follows_the_plan_s_dense_rule(monkeypatch, rule, label):
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=256, head_dim=32)
    attention = pbs.attention

    def attention_with_rule(*args, **kwargs):
        out, plan = attention(*args, **kwargs)
        reason = None if rule is None else "a reason"
        return out, dataclasses.replace(plan, fallback=reason, dense_rule=rule)

    monkeypatch.setattr(pbs, "attention", attention_with_rule)
    # on the CPU the probe's dense path is SDPA
    assert bench_defaults.path_of(q, k, v, pbs.PBSConfig()).startswith(label)


def test_a_preset_is_the_config_the_calls_get(monkeypatch):
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=256, head_dim=32)
    seen = []
    attention = pbs.attention

    def recording(q, k, v, config=None, **kwargs):
        seen.append(config)
        return attention(q, k, v, config, **kwargs)

    monkeypatch.setattr(pbs, "attention", recording)
    fp8 = pbs.PBSConfig.from_preset("fp8")
    bench_defaults.path_of(q, k, v, fp8)
    assert seen == [fp8] and seen[0].precision == "fp8"


def test_a_config_given_as_json_text_or_file_is_the_one_timed(tmp_path):
    chosen = pbs.PBSConfig.from_preset("pbs_xattention")
    chosen = chosen.model_copy(update={"selector": chosen.selector.model_copy(update={"threshold": 0.97, "stride": 16})})
    path = tmp_path / "config.json"
    path.write_text(chosen.model_dump_json())
    assert bench_defaults.chosen_config(None, chosen.model_dump_json()) == (chosen, "--config")
    assert bench_defaults.chosen_config(None, str(path)) == (chosen, "--config")
    assert bench_defaults.chosen_config("fp8", None) == (pbs.PBSConfig.from_preset("fp8"), "fp8")
    assert bench_defaults.chosen_config(None, None) == (pbs.PBSConfig(), "defaults")


def test_the_graph_rotation_replays_the_captured_call_or_reports_why_not():
    calls = []

    def cudnn():
        calls.append("cudnn")

    def pbs_call():
        calls.append("pbs")

    class Captured:
        def replay(self):
            calls.append("replay")

    events, busy, error = bench_defaults.rotations(cudnn, pbs_call, graph=False)
    assert list(events) == list(busy) == ["cudnn", "pbs", "cudnn_again"] and error is None

    captured = []
    events, busy, error = bench_defaults.rotations(cudnn, pbs_call, sdpa_path=cudnn, graph=True,
                                                   capture=lambda fn: captured.append(fn) or Captured())
    assert captured == [pbs_call] and error is None
    assert list(events) == ["cudnn", "pbs", "cudnn_again", "sdpa_path", "pbs_graph"]
    assert list(busy) == ["cudnn", "pbs", "cudnn_again", "pbs_graph"]
    events["pbs_graph"]()
    busy["pbs_graph"]()
    assert calls == ["replay", "replay"]

    def refuse(fn):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    events, busy, error = bench_defaults.rotations(cudnn, pbs_call, graph=True, capture=refuse)
    assert error == "RuntimeError: operation not permitted when stream is capturing"
    assert "pbs_graph" not in events and "pbs_graph" not in busy
