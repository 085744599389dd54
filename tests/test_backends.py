"""One dispatch layer: configs, ``auto``, ``pbs list``, the demo's choices and planning all read
`pbs.backends`, so a plugin backend is a first-class citizen; the backend is chosen once, at plan
time, and `pbs.run` obeys the plan."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.backends import AttentionBackend, CallSpec, get_backend, planning_family, register_backend, resolve_backend
from pbs.backends.registry import _BACKENDS
from pbs.reference.block_sparse_attn import block_sparse_attention_reference

SMALL = {"block_size": 32, "segment_size": 64}


@pytest.fixture
def plugin_backend():
    calls = []

    def run(call):
        calls.append(call.q.shape)
        return block_sparse_attention_reference(
            call.q, call.k, call.v, call.plan.mask, call.plan.query_positions(), call.plan.key_positions(),
            scale=call.scale, causal=call.plan.layout.causal,
        )

    register_backend(AttentionBackend("my_plugin", lambda spec: [], run))
    yield calls
    del _BACKENDS["my_plugin"]


def test_built_in_backends_in_auto_order():
    assert pbs.list_backends() == ["hopper", "triton", "reference", "flex"]


def test_a_plugin_backend_can_be_named_in_a_config_and_runs(plugin_backend):
    q, k, v = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=256, head_dim=32)
    config = pbs.PBSConfig(**SMALL, backend="my_plugin")
    assert pbs.PBSConfig.model_validate_json(config.model_dump_json()).backend == "my_plugin"
    out = pbs.attention(q, k, v, config)
    assert plugin_backend, "the plugin's run was not called"
    reference = pbs.attention(q, k, v, {**SMALL, "backend": "reference"})
    torch.testing.assert_close(out, reference)
    assert "my_plugin" in pbs.list_backends()  # after the built-ins; auto_priority None: never auto


def test_unknown_backend_names_fail_when_planned_with_the_choices():
    q, k, v = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=256, head_dim=32)
    config = pbs.PBSConfig(**SMALL, backend="tritn")  # a plugin may register it later
    for call in (lambda: pbs.plan(q, k, config), lambda: pbs.attention(q, k, v, config)):
        with pytest.raises(ValueError, match=r"unknown backend 'tritn'; available: auto, hopper, triton, reference, flex"):
            call()
    with pytest.raises(ValueError, match=r"unknown backend 'tritn'"):
        pbs.backends.check_backend_name("tritn")


def test_register_planner_rejects_unknown_kinds_and_the_reference_family():
    with pytest.raises(ValueError, match="kind must be 'permuter' or 'selector'"):
        pbs.backends.register_planner("selectr", "mean_pool", "triton")
    with pytest.raises(ValueError, match="the reference family is the components' own methods"):
        pbs.backends.register_planner("selector", "mean_pool", "reference")


def test_auto_is_not_a_backend_name():
    with pytest.raises(ValueError, match="'auto' is not a backend name"):
        register_backend(AttentionBackend("auto", lambda spec: [], lambda call: call.q))


def test_auto_skips_backends_that_cannot_run_and_explains_named_ones():
    q, _, _ = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=256, head_dim=32)
    spec = CallSpec.of(q, 32, 32)
    assert resolve_backend("auto", spec).name == "reference"  # on CPU
    with pytest.raises(ValueError, match="backend 'hopper' cannot run this call: inputs are on cpu, not CUDA"):
        resolve_backend("hopper", spec)


def test_planning_family_follows_the_backend(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert planning_family(get_backend("triton"), cpu) == "reference"
    monkeypatch.setattr(pbs.backends.eligibility, "_triton_installed", lambda: True)
    assert planning_family(get_backend("reference"), cuda) == "reference"
    for name in ("hopper", "triton", "flex"):
        assert planning_family(get_backend(name), cuda) == "triton"
    misspelt = AttentionBackend("misspelt", lambda spec: [], lambda call: call.q, plans_with="trition")
    with pytest.raises(ValueError, match="plans with 'trition', but no planner is registered for it"):
        planning_family(misspelt, cuda)


def test_the_plan_records_the_backend_and_run_obeys_it(plugin_backend):
    """The backend is chosen once, when planning; `run` uses the recorded one, even when the
    config would now resolve to another (here ``auto``, which would pick the reference)."""
    q, k, v = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=256, head_dim=32)
    plan = pbs.plan(q, k, {**SMALL, "backend": "my_plugin"})
    assert plan.backend == "my_plugin"
    auto_plan = pbs.plan(q, k, SMALL)
    assert auto_plan.backend == "reference"  # auto on CPU
    import dataclasses

    rerouted = dataclasses.replace(auto_plan, backend="my_plugin")
    pbs.run(rerouted, q, k, v)
    assert len(plugin_backend) == 1, "run chose its own backend instead of the plan's"
    pbs.run(auto_plan, q, k, v)
    assert len(plugin_backend) == 1


def test_run_refuses_inputs_the_planned_backend_cannot_take():
    q, k, v = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=256, head_dim=32)
    plan = pbs.plan(q, k, {**SMALL, "backend": "reference"})
    import dataclasses

    on_gpu_backend = dataclasses.replace(plan, backend="hopper")
    with pytest.raises(ValueError, match=r"the plan was made for backend 'hopper', which cannot run these inputs"):
        pbs.run(on_gpu_backend, q, k, v)


def test_cli_lists_the_registry(capsys, plugin_backend):
    from pbs.cli import main

    assert main(["list"]) == 0
    assert "backends:  hopper, triton, reference, flex, my_plugin (" in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_auto_picks_hopper_on_hopper_and_both_kernels_agree():
    q, k, v = pbs.testing.make_qkv(heads_q=8, heads_kv=2, seq_len=4096, head_dim=128, dtype=torch.bfloat16,
                                   device="cuda")
    plan, q_perm, k_perm, v_perm = pbs.planning.build_plan(q, k, pbs.PBSConfig(), 128**-0.5, v)
    call = pbs.backends.AttentionCall(q=q_perm, k=k_perm, v=v_perm, plan=plan, scale=128**-0.5)
    on_hopper = torch.cuda.get_device_capability()[0] == 9
    assert plan.backend == ("hopper" if on_hopper else "triton")
    triton_out = get_backend("triton").run(call)
    if on_hopper:
        torch.testing.assert_close(get_backend("hopper").run(call), triton_out, atol=2e-2, rtol=0)
