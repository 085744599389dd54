"""``pbs.attention`` under ``torch.compile`` (a custom op) and inside CUDA graphs (no host sync)."""

from __future__ import annotations

import pytest
import torch

import pbs

SMALL = {"block_size": 32, "segment_size": 64}


def test_compiled_attention_is_one_graph_and_matches_eager():
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=256, head_dim=32)
    eager = pbs.attention(q, k, v, SMALL)

    @torch.compile(fullgraph=True, backend="eager")  # fullgraph: a graph break would raise
    def layer(q, k, v):
        return pbs.attention(q, k, v, SMALL) * 2.0

    torch.testing.assert_close(layer(q, k, v), eager * 2.0)


def test_custom_op_schema_and_fake_shape():
    q, k, v = pbs.testing.make_qkv(batch=2, heads_q=4, heads_kv=2, seq_len=128, seq_len_q=64, head_dim=16)
    v = torch.randn(2, 2, 128, 24)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        out = torch.ops.pbs.attention(fq, fk, fv, pbs.PBSConfig(**SMALL).model_dump_json(), 0.25)
    assert out.shape == (2, 4, 64, 24) and out.dtype == q.dtype
    real = torch.ops.pbs.attention(q, k, v, pbs.PBSConfig(**SMALL).model_dump_json(), 0.25)
    torch.testing.assert_close(real, pbs.attention(q, k, v, SMALL, scale=0.25))


def test_return_plan_under_compile_is_a_clear_error():
    q, k, v = pbs.testing.make_qkv(batch=1, heads_q=2, heads_kv=1, seq_len=128, head_dim=16)

    @torch.compile(fullgraph=True, backend="eager")
    def layer(q, k, v):
        return pbs.attention(q, k, v, SMALL, return_plan=True)

    with pytest.raises(Exception, match="return_plan=True is not supported under torch.compile"):
        layer(q, k, v)


GPU_CONFIG = {"check_finite": False, "dense_fallback": {"min_seq_len": 0, "max_density": None}}


def _gpu_inputs(seq_len=8192):
    return pbs.testing.make_qkv(batch=1, heads_q=8, heads_kv=2, seq_len=seq_len, head_dim=128,
                                dtype=torch.bfloat16, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "components",
    [{"permuter": "last_block", "selector": "mean_pool"}, {"permuter": "last_block", "selector": "antidiagonal"}, {}],
    ids=["last_block-mean_pool", "last_block-antidiagonal", "defaults"],
)
def test_cuda_graph_captures_plan_and_attention(components):
    config = {**GPU_CONFIG, **components}
    q, k, v = _gpu_inputs()
    eager = pbs.attention(q, k, v, config)  # warm-up: compiles and tunes outside the capture
    static_q, static_k, static_v = q.clone(), k.clone(), v.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # any host sync inside raises
        static_out = pbs.attention(static_q, static_k, static_v, config)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, eager, atol=0, rtol=0)
    # New inputs copied into the captured buffers give that input's result.
    q2, k2, v2 = (x.roll(1, dims=1) for x in (q, k, v))
    static_q.copy_(q2), static_k.copy_(k2), static_v.copy_(v2)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, pbs.attention(q2, k2, v2, config), atol=0, rtol=0)


@pytest.mark.gpu
def test_check_finite_inside_a_graph_capture_is_a_clear_error():
    q, k, v = _gpu_inputs(4096)
    config = {**GPU_CONFIG, "check_finite": True}
    pbs.attention(q, k, v, config)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="check_finite=False"):
        with torch.cuda.graph(graph):
            pbs.attention(q, k, v, config)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_on_gpu(mode):
    q, k, v = _gpu_inputs()
    eager = pbs.attention(q, k, v, GPU_CONFIG)

    @torch.compile(fullgraph=True, mode=mode)
    def layer(q, k, v):
        return pbs.attention(q, k, v, GPU_CONFIG).float().sum(-1)

    for _ in range(3):  # reduce-overhead records a CUDA graph on a later call
        out = layer(q, k, v)
    torch.testing.assert_close(out, eager.float().sum(-1), atol=1e-2, rtol=1e-3)
