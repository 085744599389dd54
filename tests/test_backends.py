"""One backend registry: configs, ``auto``, ``pbs list``, the demo's choices and
planning all read `pbs.backends`, so a plugin backend is a first-class citizen."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.backends import AttentionBackend, _BACKENDS, choose_backend, planning_implementation, register_backend
from pbs.components import selector_registry
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

    register_backend(AttentionBackend("my_plugin", lambda call: [], run))
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


def test_unknown_backend_names_fail_in_the_config_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown backend 'tritn'; available: auto, hopper, triton, reference, flex"):
        pbs.PBSConfig(backend="tritn")


def test_register_impl_rejects_unknown_backends():
    with pytest.raises(ValueError, match=r"unknown backend 'trition'.*registered backends: hopper, triton"):
        selector_registry.register_impl("mean_pool", "trition")


def test_auto_is_not_a_backend_name():
    with pytest.raises(ValueError, match="'auto' is not a backend name"):
        register_backend(AttentionBackend("auto", lambda call: [], lambda call: call.q))


def test_auto_skips_backends_that_cannot_run_and_explains_named_ones():
    q, k, v = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=256, head_dim=32)
    plan, q_perm, k_perm, v_perm = pbs.planning.build_plan(q, k, pbs.PBSConfig(**SMALL), 32**-0.5, v)
    call = pbs.backends.AttentionCall(q=q_perm, k=k_perm, v=v_perm, plan=plan, scale=32**-0.5)
    assert choose_backend("auto", call).name == "reference"  # on CPU
    with pytest.raises(ValueError, match="backend 'hopper' cannot run this call: inputs are on cpu, not CUDA"):
        choose_backend("hopper", call)


def test_planning_implementation_follows_the_backend():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert planning_implementation("auto", cpu) == "reference"
    assert planning_implementation("reference", cuda) == "reference"
    for name in ("auto", "hopper", "triton", "flex"):
        assert planning_implementation(name, cuda) == "triton"


def test_cli_lists_the_registry(capsys, plugin_backend):
    from pbs.cli import main

    assert main(["list"]) == 0
    assert "backends:  auto, hopper, triton, reference, flex, my_plugin" in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_auto_picks_hopper_on_hopper_and_both_kernels_agree():
    q, k, v = pbs.testing.make_qkv(heads_q=8, heads_kv=2, seq_len=4096, head_dim=128, dtype=torch.bfloat16,
                                   device="cuda")
    plan, q_perm, k_perm, v_perm = pbs.planning.build_plan(q, k, pbs.PBSConfig(), 128**-0.5, v)
    call = pbs.backends.AttentionCall(q=q_perm, k=k_perm, v=v_perm, plan=plan, scale=128**-0.5)
    on_hopper = torch.cuda.get_device_capability()[0] == 9
    assert choose_backend("auto", call).name == ("hopper" if on_hopper else "triton")
    triton_out = choose_backend("triton", call).run(call)
    if on_hopper:
        torch.testing.assert_close(choose_backend("hopper", call).run(call), triton_out, atol=2e-2, rtol=0)
