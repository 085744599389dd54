"""The log-sum-exp that `pbs.attention(..., return_lse=True)` returns: exact over the keys each
query attends to, on every backend that returns it, through the dense fallback too, and refused
by name where a backend cannot give it."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.backends import AttentionBackend, CallSpec, register_backend, resolve_backend
from pbs.backends.registry import _BACKENDS

SMALL = {"block_size": 64, "segment_size": 128}
# The Triton kernel runs on the GPU where there is one, in the interpreter on CPU-only machines
# (tests/conftest.py sets TRITON_INTERPRET=1 there).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _truth(q, k, plan, scale, rows_per_step=1024):
    """float64 log-sum-exp of the masked, scaled scores: the plan's blocks, causal on positions."""
    layout = plan.layout
    qp, kp = plan.query_permutation.apply(q).double(), plan.key_permutation.apply(k).double()
    group = q.shape[1] // kp.shape[1]
    kp = kp.repeat_interleave(group, 1)
    bs = layout.block_size
    qpos = plan.query_positions()
    kpos = plan.key_positions().repeat_interleave(q.shape[1] // plan.key_positions().shape[1], 1)
    blocks = plan.mask.to_dense()
    lse = torch.empty(qp.shape[:3], dtype=torch.float64, device=q.device)
    for r0 in range(0, q.shape[2], rows_per_step):  # 8K x 8K x 8 heads in float64 is 4 GiB at once
        r1 = min(q.shape[2], r0 + rows_per_step)
        scores = torch.einsum("bhqd,bhkd->bhqk", qp[:, :, r0:r1], kp) * scale
        rows = torch.arange(r0, r1, device=q.device) // bs
        keep = blocks[:, :, rows].repeat_interleave(bs, 3)[..., : k.shape[2]]
        keep = keep & (kpos[:, :, None, :] <= qpos[:, :, r0:r1, None])
        lse[:, :, r0:r1] = scores.masked_fill(~keep, float("-inf")).logsumexp(-1)
    return plan.query_permutation.unapply(lse[..., None])[..., 0]


@pytest.mark.parametrize("backend, dtype", [("reference", torch.float32), ("triton", torch.float32),
                                            ("triton", torch.float16)])
@pytest.mark.parametrize("config", [
    {"selector": {"name": "mean_pool", "threshold": 0.8}},
    {"permuter": "last_block", "selector": "mean_pool", "gqa": "per_head"},
    {"permuter": "key_aware_query", "selector": {"name": "budget", "density": 0.5}},  # permuted queries
], ids=["none", "last_block", "key_aware_query"])
def test_lse_equals_the_logsumexp_of_the_selected_scores(backend, dtype, config):
    q, k, v = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=700, seq_len_q=300, head_dim=32, seed=3)
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    q, k, v = (x.to(device, dtype) for x in (q, k, v))
    out, lse, plan = pbs.attention(q, k, v, {**SMALL, **config, "backend": backend}, return_lse=True, return_plan=True)
    assert plan.backend == backend and lse.dtype == torch.float32 and lse.shape == (2, 4, 300)
    truth = _truth(q.float(), k.float(), plan, 32**-0.5)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lse.double(), truth, atol=tolerance, rtol=0)
    assert torch.equal(out, pbs.attention(q, k, v, {**SMALL, **config, "backend": backend}))
    out_run, lse_run = pbs.run(pbs.plan(q, k, {**SMALL, **config, "backend": backend}, return_lse=True), q, k, v,
                               return_lse=True)
    assert torch.equal(out_run, out) and torch.equal(lse_run, lse)


def test_a_query_that_sees_no_key_has_lse_minus_inf_and_output_zero():
    q, k, v = pbs.testing.make_qkv(heads_q=2, heads_kv=1, seq_len=256, head_dim=16)
    plan = pbs.plan(q, k, {**SMALL, "backend": "reference", "force_sink_block": False}, return_lse=True)
    empty = pbs.BlockMask.from_dense(torch.zeros(plan.mask.shape, dtype=torch.bool), plan.layout)
    import dataclasses

    out, lse = pbs.run(dataclasses.replace(plan, mask=empty), q, k, v, return_lse=True)
    assert torch.isneginf(lse).all() and (out == 0).all()


@pytest.mark.parametrize("fallback", [{"min_seq_len": 10**6}, {"min_seq_len": 0, "max_density": 0.01},
                                      {"min_seq_len": 0, "max_density": 1.0, "max_planned_density": 0.01}],
                         ids=["length", "probe", "planned_density"])
def test_the_dense_fallback_returns_the_dense_lse(fallback):
    q, k, v = pbs.testing.make_qkv(heads_q=4, heads_kv=2, seq_len=512, seq_len_q=200, head_dim=32, seed=1)
    config = {**SMALL, "dense_fallback": {**fallback, "devices": ["cpu"]}}
    out, lse, plan = pbs.attention(q, k, v, config, return_lse=True, return_plan=True)
    assert plan.ran_dense and plan.density == 1.0
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double().repeat_interleave(2, 1)) * 32**-0.5
    visible = torch.arange(512)[None, :] <= torch.arange(312, 512)[:, None]
    torch.testing.assert_close(lse.double(), scores.masked_fill(~visible, float("-inf")).logsumexp(-1), atol=1e-4, rtol=0)
    torch.testing.assert_close(out, pbs.reference.dense_attention(q, k, v), atol=1e-5, rtol=0)


@pytest.fixture
def backend_without_lse():
    register_backend(AttentionBackend("no_lse", lambda spec: [], _BACKENDS["reference"].run))
    yield
    del _BACKENDS["no_lse"]


def test_a_backend_that_does_not_return_the_lse_is_refused_by_name(backend_without_lse):
    q, k, v = pbs.testing.make_qkv(heads_q=2, heads_kv=1, seq_len=256, head_dim=16)
    config = {**SMALL, "backend": "no_lse"}
    pbs.attention(q, k, v, config)  # runs without the LSE
    with pytest.raises(ValueError, match=r"backend 'no_lse' cannot run this call: it does not return the log-sum-exp"):
        pbs.attention(q, k, v, config, return_lse=True)
    plan = pbs.plan(q, k, config)
    with pytest.raises(ValueError, match=r"the plan was made for backend 'no_lse'.*does not return the log-sum-exp"):
        pbs.run(plan, q, k, v, return_lse=True)


def test_auto_takes_a_backend_that_returns_the_lse():
    assert all(_BACKENDS[name].returns_lse for name in ("hopper", "triton", "reference"))
    cpu = CallSpec.of(torch.zeros(1, 1, 1, 16), 16, 64, needs_lse=True)
    with pytest.raises(ValueError, match="does not return the log-sum-exp"):
        resolve_backend("flex", cpu)
    assert resolve_backend("auto", cpu).name == "reference"


def test_return_lse_is_refused_under_torch_compile(monkeypatch):
    q, k, v = pbs.testing.make_qkv(heads_q=2, heads_kv=1, seq_len=128, head_dim=16)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ValueError, match="return_lse=True is not supported under torch.compile"):
        pbs.attention(q, k, v, return_lse=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run scripts/gpu_check.sh on the GPU machine)")
def test_gpu_lse_on_the_default_path_matches_the_reference():
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=8, heads_kv=2, seq_len=8192, head_dim=128, dtype=torch.bfloat16,
                                   device="cuda", seed=2)
    config = {"dense_fallback": {"min_seq_len": 0, "max_density": 1.0}}
    out, lse, plan = pbs.attention(q, k, v, config, return_lse=True, return_plan=True)
    on_hopper = torch.cuda.get_device_capability()[0] == 9
    assert plan.backend == ("hopper" if on_hopper else "triton")
    truth = _truth(q.float(), k.float(), plan, 128**-0.5)
    assert (lse.double() - truth).abs().max().item() < 5e-2
    assert torch.equal(out, pbs.run(plan, q, k, v))
    if on_hopper:  # the Gluon kernel's LSE against the Triton kernel's, on the same plan
        import dataclasses

        triton_out, triton_lse = pbs.run(dataclasses.replace(plan, backend="triton"), q, k, v, return_lse=True)
        assert (triton_lse - lse).abs().max().item() < 1e-3
        assert (triton_out.float() - out.float()).abs().max().item() < 2e-2
