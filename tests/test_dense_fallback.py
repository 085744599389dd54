"""The ``auto`` dense-fallback policy (``PBSConfig.dense_fallback``) and the SDPA dense path."""

from __future__ import annotations

import pytest
import torch

import pbs
from pbs.dense import dense_attention_sdpa
from pbs.testing import relative_error

SMALL = {"block_size": 32, "segment_size": 64}


def _qkv(seq_len=256, seq_len_q=None):
    return pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=seq_len, seq_len_q=seq_len_q, head_dim=32)


@pytest.mark.parametrize("seq_len_q", [None, 100])
def test_sdpa_path_equals_dense_reference(seq_len_q):
    # Bottom-right causal alignment for Nq < Nk, GQA without expanding K/V.
    q, k, v = _qkv(seq_len_q=seq_len_q)
    out = dense_attention_sdpa(q, k, v, scale=32**-0.5)
    assert relative_error(out, pbs.reference.dense_attention(q, k, v)) < 1e-5


# One malformed input below has more queries than keys, for which torch's lower-right causal bias warns.
@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
def test_chunks_after_a_prefix_take_the_dense_kernel_where_it_runs(monkeypatch):
    # dense_attention's routing: a causal call with fewer queries than keys goes to the Gluon
    # kernel wherever that kernel runs (faked here: dense_kernel_available), anything else to SDPA.
    import pbs.dense

    kernel_calls = []

    def fake_kernel(q, k, v, *, scale, causal):
        kernel_calls.append((q.shape[2], k.shape[2]))
        return dense_attention_sdpa(q, k, v, scale=scale, causal=causal)

    monkeypatch.setattr(pbs.dense, "dense_kernel_available", lambda q, dv: True)
    monkeypatch.setattr(pbs.dense, "dense_kernel_attention", fake_kernel)
    q, k, v = _qkv(seq_len_q=100)
    out = pbs.dense.dense_attention(q, k, v, scale=32**-0.5)
    assert kernel_calls == [(100, 256)]
    assert relative_error(out, pbs.reference.dense_attention(q, k, v)) < 1e-5
    pbs.dense.dense_attention(*_qkv(), scale=32**-0.5)  # Nq == Nk: cuDNN's causal
    pbs.dense.dense_attention(q, k, v, scale=32**-0.5, causal=False)
    # Malformed inputs never reach the kernel (it checks no shapes; SDPA names the problem).
    for bad in [(q, k[..., :16], v), (q[:, :3], k, v), (q, k, v[:, :, :200]), (q.double(), k, v), (k, q, v)]:
        try:
            pbs.dense.dense_attention(*bad, scale=32**-0.5)
        except Exception:  # noqa: BLE001 - SDPA's own error; the point is which function ran
            pass
    assert kernel_calls == [(100, 256)]
    # pbs.attention's dense-by-length path and the policy's dense path both route through it.
    config = {**SMALL, "dense_fallback": {"min_seq_len": 1 << 20, "devices": ["cpu"]}}
    out, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan.dense_rule == "length" and kernel_calls == [(100, 256)] * 2
    pbs.dense.DensePolicy(pbs.PBSConfig(**SMALL)).dense(q, k, v, 32**-0.5)
    assert kernel_calls == [(100, 256)] * 3


def test_short_inputs_run_dense_without_planning():
    q, k, v = _qkv()
    config = {**SMALL, "dense_fallback": {"min_seq_len": 257, "devices": ["cpu"]}}
    out, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan.dense_rule == "length" and plan.density == 1.0
    assert relative_error(out, pbs.reference.dense_attention(q, k, v)) < 1e-5
    # One key more than the limit: PBS runs (its output differs from dense). The density checks are
    # off, so that the length rule alone decides (the default selector keeps 0.94 of 8 blocks here).
    config["dense_fallback"].update(min_seq_len=256, max_density=None)
    out, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan is not None and plan.fallback is None and plan.density < 1
    assert relative_error(out, pbs.reference.dense_attention(q, k, v)) > 1e-3


def test_dense_selection_falls_back_after_planning():
    q, k, v = _qkv()
    sparse = pbs.plan(q, k, SMALL)
    config = {**SMALL, "dense_fallback": {
        "min_seq_len": 0, "max_planned_density": sparse.density - 0.01, "probe_blocks": 0, "planning_cost_pairs": 0,
        "devices": ["cpu"]}}
    out, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan is not None and "max_planned_density" in plan.fallback
    assert relative_error(out, pbs.reference.dense_attention(q, k, v)) < 1e-5
    config["dense_fallback"]["max_planned_density"] = min(1.0, sparse.density + 0.01)
    _, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan.fallback is None
    # max_density None switches the planned check off too (the one switch for both density rules).
    config["dense_fallback"].update(max_planned_density=sparse.density - 0.01, max_density=None)
    _, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan.fallback is None


def test_the_planned_density_limit_is_separate_from_the_probes():
    # A plan above the probe's limit (0.8) but below max_planned_density runs sparse: planning is
    # paid by then and the block-sparse kernel is faster than dense up to near full density.
    q, k, v = _qkv()
    sparse = pbs.plan(q, k, SMALL)
    policy = {"min_seq_len": 0, "probe_blocks": 0, "devices": ["cpu"], "max_density": sparse.density - 0.05,
              "max_planned_density": sparse.density + 0.01, "planning_cost_pairs": 0}
    _, plan = pbs.attention(q, k, v, {**SMALL, "dense_fallback": policy}, return_plan=True)
    assert plan is not None and plan.fallback is None
    assert pbs.PBSConfig().dense_fallback.max_planned_density == 0.95


def test_flat_attention_goes_dense_before_planning():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 512, 32, generator=gen)
    k, v = torch.randn(1, 2, 512, 32, generator=gen), torch.randn(1, 2, 512, 32, generator=gen)
    policy = {"min_seq_len": 0, "devices": ["cpu"], "planning_cost_pairs": 0}
    calls = []
    real = pbs.dense.build_plan
    try:
        pbs.dense.build_plan = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        out, plan = pbs.attention(q, k, v, {**SMALL, "dense_fallback": policy}, return_plan=True)
        assert plan.dense_rule == "probe" and not calls  # decided by the probe: nothing planned
        assert relative_error(out, pbs.reference.dense_attention(q, k, v)) < 1e-5
        # With the probe off the same input is planned, then falls back on the planned density.
        _, plan = pbs.attention(q, k, v, {**SMALL, "dense_fallback": {**policy, "probe_blocks": 0}}, return_plan=True)
        assert calls and plan is not None and "max_planned_density" in plan.fallback
    finally:
        pbs.dense.build_plan = real
    # Structured attention passes the probe and runs sparse.
    q, k, v = _qkv(seq_len=512)
    _, plan = pbs.attention(q, k, v, {**SMALL, "dense_fallback": policy}, return_plan=True)
    assert plan is not None and plan.fallback is None


def test_the_probe_leaves_fixed_density_selectors_alone():
    # `budget` fixes the density in the config; flat attention must not send it to dense.
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 512, 32, generator=gen)
    k, v = torch.randn(1, 2, 512, 32, generator=gen), torch.randn(1, 2, 512, 32, generator=gen)
    config = {**SMALL, "selector": {"name": "budget", "density": 0.3},
              "dense_fallback": {"min_seq_len": 0, "planning_cost_pairs": 0, "devices": ["cpu"]}}
    _, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan is not None and plan.fallback is None and plan.density < 0.6
    assert pbs.PBSConfig(**config).selector.mass_share() is None
    assert pbs.PBSConfig(selector={"name": "oracle", "coverage": 0.95}).selector.mass_share() == 0.95


def test_the_probe_covers_a_union_at_its_members_largest_share():
    # A union keeps at least each member's blocks: the default (vertical_slash 0.75 | mean_pool 0.9)
    # is probed at 0.9; a union of fixed-density members is not probed.
    assert pbs.PBSConfig().selector.mass_share() == 0.9
    budgets = {"name": "union", "selectors": [{"name": "budget", "density": 0.3}, "budget"]}
    assert pbs.PBSConfig(selector=budgets).selector.mass_share() is None
    mixed = {"name": "union", "selectors": [{"name": "budget", "density": 0.3}, {"name": "oracle", "coverage": 0.8}]}
    assert pbs.PBSConfig(selector=mixed).selector.mass_share() == 0.8
    args = pbs.dense.DensePolicy(pbs.PBSConfig(selector=mixed)).probe_arguments(0.125)
    assert args is not None and args["threshold"] == 0.8


def test_the_default_config_is_built_once():
    assert pbs.PBSConfig.coerce(None) is pbs.PBSConfig.coerce(None)
    assert pbs.PBSConfig.coerce(None) == pbs.PBSConfig()


def test_policy_only_for_auto_and_listed_devices():
    q, k, v = _qkv()
    always = {"min_seq_len": 10**9, "devices": ["cpu"]}
    # Named backends are never replaced.
    _, plan = pbs.attention(q, k, v, {**SMALL, "backend": "reference", "dense_fallback": always}, return_plan=True)
    assert plan is not None
    # The default policy applies on CUDA only: CPU runs PBS.
    _, plan = pbs.attention(q, k, v, SMALL, return_plan=True)
    assert plan is not None and pbs.PBSConfig().dense_fallback.devices == ("cuda",)


def test_dense_fallback_config_is_validated_and_round_trips():
    config = pbs.PBSConfig(dense_fallback={"min_seq_len": 0, "max_density": None})
    assert pbs.PBSConfig.model_validate_json(config.model_dump_json()) == config
    with pytest.raises(ValueError, match="max_density"):
        pbs.PBSConfig(dense_fallback={"max_density": 1.5})
    with pytest.raises(ValueError, match="min_seq_len"):
        pbs.PBSConfig(dense_fallback={"min_seq_len": -1})


def test_the_probes_integer_verdict_is_the_ratio_rule():
    """Host and GPU kernel decide from the probe's counters with one integer rule; it is
    ``kept / visible > max_density`` wherever the two are more than 2**-20 apart."""
    from pbs.dense import probe_says_dense

    gen = torch.Generator().manual_seed(0)
    for max_density in (0.8, 0.5, 0.95, 1.0, 0.123456):
        visible = torch.randint(1, 3_000_000, (400,), generator=gen).tolist()
        kept = [int(x * r) for x, r in zip(visible, torch.rand(400, generator=gen).tolist())]
        for a, b in zip(kept, visible):
            if abs(a / b - max_density) > 2**-20:
                assert probe_says_dense(a, b, max_density) == (a / b > max_density), (a, b, max_density)
    assert not probe_says_dense(80, 100, 0.8) and probe_says_dense(81, 100, 0.8)
    assert not probe_says_dense(100, 100, 1.0)


def test_the_gated_dense_path_needs_a_hopper_gpu_and_says_why(monkeypatch):
    from pbs.backends import CallSpec
    from pbs.backends.eligibility import gated_dense_reasons

    q, _, v = _qkv()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert any("not CUDA" in r for r in gated_dense_reasons(CallSpec.of(q, v.shape[-1], 128)))


@pytest.mark.gpu
def test_gpu_auto_falls_back_below_the_crossover_and_is_sparse_above():
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=8, heads_kv=2, seq_len=4096, head_dim=128,
                                   dtype=torch.bfloat16, device="cuda")
    out, plan = pbs.attention(q, k, v, {"check_finite": False}, return_plan=True)
    assert plan.dense_rule == "length" and plan.density == 1.0  # 4K < the default min_seq_len
    assert relative_error(out, pbs.reference.dense_attention(q, k, v)) < 1e-2
    config = {"check_finite": False, "dense_fallback": {"min_seq_len": 0, "max_density": 1.0, "planning_cost_pairs": 0}}
    _, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan is not None and plan.fallback is None


@pytest.mark.gpu
def test_gpu_defaults_send_flat_attention_to_dense_attention_and_leave_sdpa_settings_alone(monkeypatch):
    from pbs.backends import CallSpec
    from pbs.backends.eligibility import gated_dense_reasons
    from pbs.kernels import hopper_attn

    gen = torch.Generator(device="cuda").manual_seed(0)
    n = pbs.PBSConfig().dense_fallback.min_seq_len  # the shortest length the probe decides
    q = torch.randn((1, 8, n, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((1, 2, n, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    gated = not gated_dense_reasons(CallSpec.of(q, v.shape[-1], 128))  # a Hopper GPU: the Gluon kernel starts before the read
    before = torch._C._get_sdp_priority_order()
    plans, dense_launches, sdpa_calls = [], [], []
    real_plan, real_dense, real_sdpa = pbs.dense.build_plan, hopper_attn.launch_hopper_dense, pbs.dense.dense_attention_sdpa
    monkeypatch.setattr(pbs.dense, "build_plan", lambda *a, **kw: plans.append(1) or real_plan(*a, **kw))
    monkeypatch.setattr(hopper_attn, "launch_hopper_dense", lambda *a, **kw: dense_launches.append(1) or real_dense(*a, **kw))
    monkeypatch.setattr(pbs.dense, "dense_attention_sdpa", lambda *a, **kw: sdpa_calls.append(1) or real_sdpa(*a, **kw))
    out, plan = pbs.attention(q, k, v, return_plan=True)
    assert plan.dense_rule == "probe" and not plans  # the probe sent it to dense attention before planning
    assert (len(dense_launches), len(sdpa_calls)) == ((1, 0) if gated else (0, 1))
    assert torch._C._get_sdp_priority_order() == before
    assert relative_error(out, pbs.reference.dense_attention(q, k, v)) < 1e-2
    # Structured attention at the same length runs sparse (the gated kernel, if launched, exits).
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=8, heads_kv=2, seq_len=n, head_dim=128,
                                   dtype=torch.bfloat16, device="cuda")
    out, plan = pbs.attention(q, k, v, return_plan=True)
    assert plan is not None and plan.fallback is None and len(plans) == 1
    assert len(dense_launches) == (2 if gated else 0) and len(sdpa_calls) == (0 if gated else 1)
    assert out.isfinite().all()
    # Half that length is dense by the length rule alone: no probe, no sync.
    half = n // 2
    _, plan = pbs.attention(q[:, :, :half], k[:, :, :half], v[:, :, :half], return_plan=True)
    assert plan.dense_rule == "length"


@pytest.mark.gpu
def test_gpu_gated_dense_matches_torch_with_batches_gqa_and_a_prefix():
    """The probe's dense path on a Hopper GPU: batch 2, GQA 4:1, queries after a cached prefix,
    lengths off the block size, strided queries; within torch's max-abs error at bf16."""
    from pbs.backends import CallSpec
    from pbs.backends.eligibility import gated_dense_reasons
    from pbs.dense import DensePolicy
    from tests.helpers import assert_max_abs_error_within_torch

    gen = torch.Generator(device="cuda").manual_seed(1)
    # q as transformers hands it over: a (B, N, H, D) projection viewed as (B, H, N, D).
    q = torch.randn((2, 3000 + 5, 8, 128), generator=gen, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn((2, 2, 5000 + 11, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    reasons = gated_dense_reasons(CallSpec.of(q, v.shape[-1], 128))
    if reasons:
        pytest.skip("needs a Hopper GPU: " + "; ".join(reasons))
    config = pbs.PBSConfig(dense_fallback={"min_seq_len": 0})
    out, reason = DensePolicy(config).probe(q, k, v, 128**-0.5)
    assert out is not None and "density probe" in reason  # random q, k: flat attention
    assert_max_abs_error_within_torch(out, q, k, v, causal=True)


@pytest.mark.gpu
def test_gpu_dense_attention_of_a_chunk_after_a_prefix_runs_the_dense_kernel_within_torch_error(monkeypatch):
    """A chunk of 1000 queries after a prefix of 4000 + 11 keys, batch 2, GQA 4:1, strided
    queries: on a Hopper GPU the Gluon kernel in dense mode runs it, within torch's max-abs error;
    a decode step (one query row, too few tiles to fill the GPU) stays on SDPA."""
    from pbs.backends import CallSpec
    from pbs.backends.eligibility import dense_kernel_reasons
    from pbs.dense import dense_attention
    from pbs.kernels import hopper_attn
    from tests.helpers import assert_max_abs_error_within_torch

    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn((2, 1000, 32, 128), generator=gen, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn((2, 8, 5011, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    reasons = dense_kernel_reasons(CallSpec.of(q, v.shape[-1], 128))
    if reasons:
        pytest.skip("needs a Hopper GPU: " + "; ".join(reasons))
    launches = []
    real = hopper_attn.launch_hopper_dense
    monkeypatch.setattr(hopper_attn, "launch_hopper_dense", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    out = dense_attention(q, k, v, scale=128**-0.5)
    assert launches == [1]
    assert_max_abs_error_within_torch(out, q, k, v, causal=True)
    decode = dense_attention(q[:, :, -1:], k, v, scale=128**-0.5)
    assert launches == [1]
    torch.testing.assert_close(decode, dense_attention_sdpa(q[:, :, -1:], k, v, scale=128**-0.5))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_inputs_on_another_gpu_than_the_current_one():
    """A model spread over GPUs (``device_map="auto"``) calls with tensors on a GPU that is not the
    current one; Triton launches on the current one, so every path must switch to the tensors'."""
    torch.cuda.set_device(0)
    n = pbs.PBSConfig().dense_fallback.min_seq_len
    gen = torch.Generator(device="cuda:1").manual_seed(0)
    q = torch.randn((1, 8, n, 128), generator=gen, device="cuda:1", dtype=torch.bfloat16)
    k = torch.randn((1, 2, n, 128), generator=gen, device="cuda:1", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out, plan = pbs.attention(q, k, v, return_plan=True)  # flat: dense by the probe
    assert plan.dense_rule == "probe" and plan.mask.counts.device == q.device and out.device == q.device
    assert relative_error(out, pbs.reference.dense_attention(q, k, v)) < 1e-2
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=8, heads_kv=2, seq_len=n, head_dim=128, dtype=torch.bfloat16,
                                   device="cuda:1")
    out, plan = pbs.attention(q, k, v, return_plan=True)  # structured: planned and run sparse
    assert plan is not None and plan.fallback is None and out.device == q.device
    on_current, _ = pbs.attention(q.to("cuda:0"), k.to("cuda:0"), v.to("cuda:0"), return_plan=True)
    assert (out.to("cuda:0").float() - on_current.float()).abs().max() < 1e-2
    small = {"dense_fallback": {"min_seq_len": 0}}
    p = pbs.plan(q[:, :, :4096], k[:, :, :4096], small)
    ran = pbs.run(p, q[:, :, :4096], k[:, :, :4096], v[:, :, :4096])
    assert ran.device == q.device and ran.isfinite().all()
    assert torch.cuda.current_device() == 0


@pytest.mark.parametrize("rule, fallback, expected", [
    ("length", {"min_seq_len": 10**6}, "below dense_fallback.min_seq_len"),
    ("planning_cost", {"min_seq_len": 0}, "is at most dense_fallback.planning_cost_pairs"),
    ("probe", {"min_seq_len": 0, "max_density": 0.01, "planning_cost_pairs": 0}, "the density probe estimates"),
    ("planned_density", {"min_seq_len": 0, "max_density": 1.0, "max_planned_density": 0.01, "planning_cost_pairs": 0},
     "above dense_fallback.max_planned_density"),
])
def test_every_dense_rule_records_its_reason_on_cpu(rule, fallback, expected):
    """The dense policy applies on CPU when asked (``devices=["cpu"]``), and whichever rule sends a
    call to dense attention says why: `pbs.api.attend` returns the reason (the transformers
    integration records it in its dispatch trace), and a plan made first carries it."""
    from pbs.api import attend
    from pbs.dense import DensePolicy

    q, k, v = _qkv()
    config = pbs.PBSConfig(**SMALL, dense_fallback={**fallback, "devices": ["cpu"]})
    out, plan, reason, _, decided_by = attend(q, k, v, DensePolicy(config))
    assert reason is not None and expected in reason, reason
    assert decided_by == rule
    torch.testing.assert_close(out, dense_attention_sdpa(q, k, v, scale=q.shape[-1] ** -0.5))
    if rule == "planned_density":
        assert plan is not None and plan.fallback == reason
    else:
        assert plan is None
    _, no_reason_plan, no_reason, _, no_rule = attend(q, k, v, DensePolicy(pbs.PBSConfig(**SMALL)))  # cuda only
    assert no_reason is None and no_rule is None and no_reason_plan.fallback is None


@pytest.mark.parametrize("rule, fallback", [
    ("length", {"min_seq_len": 10**6}),
    ("planning_cost", {"min_seq_len": 0}),
    ("probe", {"min_seq_len": 0, "max_density": 0.01, "planning_cost_pairs": 0}),
    ("planned_density", {"min_seq_len": 0, "max_density": 1.0, "max_planned_density": 0.01, "planning_cost_pairs": 0}),
])
@pytest.mark.parametrize("return_lse", [False, True])
def test_return_plan_always_returns_the_plan_of_what_ran(rule, fallback, return_lse):
    """Whichever rule sends a call to dense attention, ``return_plan=True`` returns a plan (never
    None): dense, density 1.0, saying which rule and why; and `pbs.run` of it is dense attention."""
    q, k, v = _qkv()
    config = pbs.PBSConfig(**SMALL, dense_fallback={**fallback, "devices": ["cpu"]})
    *outs, plan = pbs.attention(q, k, v, config, return_plan=True, return_lse=return_lse)
    assert isinstance(plan, pbs.Plan)
    assert plan.ran_dense and plan.dense_rule == rule and plan.density == 1.0
    assert plan.decision.startswith(f"dense ({rule}): ") and plan.fallback in plan.decision
    dense = pbs.reference.dense_attention(q, k, v)
    torch.testing.assert_close(outs[0].float(), dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pbs.run(plan, q, k, v).float(), dense, atol=1e-5, rtol=1e-5)
    sparse = pbs.attention(q, k, v, SMALL, return_plan=True)[1]  # devices: cuda only, so PBS runs
    assert not sparse.ran_dense and sparse.dense_rule is None and sparse.decision == "pbs"


def test_calls_of_few_query_key_pairs_run_dense_without_the_probe(monkeypatch):
    """Rule 2: a call of at most ``planning_cost_pairs`` query-key pairs runs dense from its shapes
    alone (no probe, no planning), and says so; one pair more and the probe decides."""
    import pbs.dense

    probed = []
    real = pbs.dense.probe_estimate
    monkeypatch.setattr(pbs.dense, "probe_estimate", lambda *a: probed.append(1) or real(*a))
    q, k, v = _qkv(seq_len=512, seq_len_q=128)  # a chunk of 128 queries after 384 cached keys
    fallback = {"min_seq_len": 0, "max_density": 1.0, "max_planned_density": 1.0, "devices": ["cpu"]}
    pairs = 128 * 512
    out, plan = pbs.attention(q, k, v, {**SMALL, "dense_fallback": {**fallback, "planning_cost_pairs": pairs}},
                              return_plan=True)
    assert plan.dense_rule == "planning_cost" and not probed
    assert plan.fallback == ("Nq x Nk = 128 x 512 is at most dense_fallback.planning_cost_pairs = 65536: planning "
                             "would cost about as much as dense attention")
    torch.testing.assert_close(out, dense_attention_sdpa(q, k, v, scale=32**-0.5))
    _, plan = pbs.attention(q, k, v, {**SMALL, "dense_fallback": {**fallback, "planning_cost_pairs": pairs - 1}},
                            return_plan=True)
    assert probed and plan.dense_rule != "planning_cost"
    # max_density None turns the rule off with the other density rules; so does 0.
    for off in ({"planning_cost_pairs": pairs, "max_density": None}, {"planning_cost_pairs": 0}):
        _, plan = pbs.attention(q, k, v, {**SMALL, "dense_fallback": {**fallback, **off}}, return_plan=True)
        assert plan.dense_rule is None
    assert pbs.PBSConfig().dense_fallback.planning_cost_pairs == 1 << 27


def test_the_probes_limit_falls_to_one_minus_the_planning_share():
    """Rule 3 compares the probe with ``min(max_density, 1 - planning_cost_pairs / (Nq Nk))``: a
    call whose estimate sits between the two runs dense with that reason, and sparse without it."""
    from pbs.dense import DensePolicy, probe_gate_limit

    policy = DensePolicy(pbs.PBSConfig(dense_fallback={"max_density": 0.8, "planning_cost_pairs": 1 << 27}))
    assert policy.probe_limit(2048, 131072) == policy.probe_limit(8192, 32768) == 1 << 19  # 0.5
    assert policy.probe_limit(3000, 65536) == (3000 * 65536 - (1 << 27)) * 2**20 // (3000 * 65536)
    # 1 - 1 / 5 is 0.8 exactly, rounded down; above that max_density decides alone, at any size.
    assert policy.probe_limit(4096, 5 << 15) == probe_gate_limit(0.8) - 1
    assert policy.probe_limit(4097, 5 << 15) == policy.probe_limit(1 << 21, 1 << 21) == probe_gate_limit(0.8)
    q, k, v = _qkv(seq_len=512, seq_len_q=256)
    cpu = {"min_seq_len": 0, "max_planned_density": 1.0, "devices": ["cpu"]}
    estimate = float(DensePolicy(pbs.PBSConfig(**SMALL, dense_fallback=cpu)).probe_estimate(q, k, 32**-0.5))
    assert 0.1 < estimate < 0.95, estimate
    pairs = int(256 * 512 * (1 - estimate)) + 2  # 1 - pairs / (256 x 512) is just below the estimate
    config = {**SMALL, "dense_fallback": {**cpu, "max_density": min(1.0, estimate + 0.04), "planning_cost_pairs": pairs}}
    out, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan.dense_rule == "probe"
    assert f"above 1 - dense_fallback.planning_cost_pairs / (Nq x Nk) = 1 - {pairs} / (256 x 512) = " in plan.fallback
    torch.testing.assert_close(out, dense_attention_sdpa(q, k, v, scale=32**-0.5))
    config["dense_fallback"]["planning_cost_pairs"] = 0
    _, plan = pbs.attention(q, k, v, config, return_plan=True)
    assert plan.dense_rule is None


def test_sequence_decisions_use_the_eager_calls_integers():
    """Per sequence on the device, rules 2 and 3 compare the same integers as the eager call of
    that sequence alone (`probe_limit`, `_above_gate`), for many sizes and counters."""
    from pbs.dense import DensePolicy, _above_gate

    gen = torch.Generator().manual_seed(0)
    policy = DensePolicy(pbs.PBSConfig(dense_fallback={"min_seq_len": 0, "max_density": 0.8,
                                                        "planning_cost_pairs": 1 << 27, "devices": ["cpu"]}))
    sizes = [(1, 8), (1024, 131072), (1025, 131072), (2048, 131072), (4096, 131072), (4096, 32768), (8192, 32768),
             (16384, 131072), (131072, 131072), (2_000_000, 2_000_000)]
    len_q = torch.cat([torch.tensor([q for q, _ in sizes]), torch.randint(1, 200_000, (300,), generator=gen)])
    len_k = torch.cat([torch.tensor([k for _, k in sizes]), len_q[len(sizes):] + torch.randint(0, 200_000, (300,), generator=gen)])
    visible = torch.randint(1, 3_000_000, len_q.shape, generator=gen)
    kept = (visible * torch.rand(len_q.shape, generator=gen, dtype=torch.float64)).long()
    kept[:len(sizes)] = visible[:len(sizes)] * 3 // 4  # estimates of 0.75
    decided = policy.sequence_decisions(len_q, len_k, (kept, visible))
    device = torch.device("cpu")
    eager = [policy.runs_dense_by_planning_cost(n, m, device) or _above_gate(a, b, policy.probe_limit(n, m))
             for n, m, a, b in zip(len_q.tolist(), len_k.tolist(), kept.tolist(), visible.tolist())]
    assert decided.tolist() == eager
    assert decided[:len(sizes)].tolist() == [True, True, True, True, False, True, True, False, False, False]
