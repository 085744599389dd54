"""`benchmarks/bench_defaults.py` names the path the defaults took by the rule the plan records, and
times the config it is given (``--preset``)."""

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
