"""Bad input gets a clear error that names the argument and what is accepted."""

from __future__ import annotations

import pytest
import torch

import pbs
from tests.helpers import random_qkv


def _qkv():
    return random_qkv(batch=1, heads_q=4, heads_kv=2, seq_len=64)


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, r"q must have 4 dimensions \(B, Hq, Nq, D\)"),
        (lambda q, k, v: (q, k[0], v), ValueError, r"k must have 4 dimensions"),
        (lambda q, k, v: (q, k, v.int()), TypeError, r"v must have dtype float16, bfloat16 or float32"),
        (lambda q, k, v: (q.numpy(), k, v), TypeError, r"q must be a torch.Tensor"),
        (lambda q, k, v: (q.half(), k, v), ValueError, r"share a dtype.*q: torch.float16"),
        (lambda q, k, v: (q[:, :3], k, v), ValueError, r"query heads \(q.shape\[1\] = 3\) must be a multiple of .* \(k.shape\[1\] = 2\)"),
        (lambda q, k, v: (q, k[..., :8], v), ValueError, r"head dim D, got q: 16, k: 8"),
        (lambda q, k, v: (q, k[:, :, :32], v), ValueError, r"k and v must agree"),
        (lambda q, k, v: (q, k[:, :, :32], v[:, :, :32]), ValueError, r"Nq = 64.*Nk = 32"),
        (lambda q, k, v: (torch.cat([q, q]), k, v), ValueError, r"batch sizes differ"),
        (lambda q, k, v: (q.index_fill(2, torch.tensor([5]), float("nan")), k, v), ValueError, r"q contains NaN or inf"),
        (lambda q, k, v: (q, k, v.index_fill(2, torch.tensor([0]), float("inf"))), ValueError, r"v contains NaN or inf"),
        (lambda q, k, v: (q[:, :, :0], k, v), ValueError, r"sequence lengths must be positive"),
    ],
)
def test_bad_tensors(mutate, error, message):
    q, k, v = mutate(*_qkv())
    with pytest.raises(error, match=message):
        pbs.attention(q, k, v)


def test_device_mismatch_is_named():
    q, k, v = _qkv()
    meta = k.to("meta")
    with pytest.raises(ValueError, match=r"one device.*k: meta"):
        pbs.attention(q, meta, v)


def test_finite_check_can_be_disabled():
    q, k, v = _qkv()
    q[0, 0, 3, 0] = float("nan")
    out = pbs.attention(q, k, v, {"check_finite": False, "block_size": 16, "segment_size": 32})
    assert out.shape == q.shape  # no error raised: the caller opted out


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), "x"])
def test_bad_scale(scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        pbs.attention(q, k, v, scale=scale)


def test_unknown_backend_lists_the_available_ones():
    q, k, v = _qkv()
    from pbs.backends import AttentionCall, choose_backend

    plan = pbs.plan(q, k)
    call = AttentionCall(q, k, v, plan, 0.25)
    with pytest.raises(ValueError, match="unknown backend 'nope'; available: auto, hopper, triton, reference, flex"):
        choose_backend("nope", call)


def test_check_finite_default_scans_off_cuda_only():
    config = pbs.PBSConfig()
    assert config.check_finite is None
    assert config.checks_finite(torch.device("cpu"))
    # On CUDA the scan would be a full read of q, k, v and a host sync: off unless asked for.
    assert not config.checks_finite(torch.device("cuda"))
    assert pbs.PBSConfig(check_finite=True).checks_finite(torch.device("cuda"))
    assert not pbs.PBSConfig(check_finite=False).checks_finite(torch.device("cpu"))
