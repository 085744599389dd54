"""`pbs.kernels.stream_gate`: the gate that keeps the stream busy while the host reads the density
probe. On the CPU the gate kernel runs in the Triton interpreter (synchronously, so a gate that is
not yet released polls until it gives up); on a GPU it really holds the stream."""

import time

import pytest
import torch

import pbs
from pbs.kernels.stream_gate import MAX_POLLS, StreamGate, stream_gate
from pbs.testing import relative_error


def test_gate_kernel_polls_until_released_or_gives_up():
    if torch.cuda.is_available():
        pytest.skip("the interpreter test of the polling loop (on a GPU the gate really waits)")
    gate = StreamGate(torch.device("cpu"), max_polls=7)
    gate.hold()  # never released while it runs: it gives up after max_polls reads
    assert gate.held and gate.last_polls == 7
    gate.release()
    assert not gate.held
    gate._word_view[0] = 10  # the host has released up to ticket 10 already
    gate.hold()  # ticket 2 <= 10: passes without polling
    assert gate.last_polls == 0
    gate.release()
    assert int(gate._word_view[0]) == 2  # release writes its own ticket


def test_gate_is_released_on_exit_and_refuses_a_second_hold():
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter variant; the GPU test below covers the device")
    gate = StreamGate(torch.device("cpu"), max_polls=1)
    with gate:
        gate.hold()
        with pytest.raises(RuntimeError, match="already held"):
            gate.hold()
    assert not gate.held
    with pytest.raises(ValueError, match="1-d int32 tensor of at most 8"):
        gate.read(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="got torch.int64"):  # a converting copy would wait
        gate.read(torch.zeros(2, dtype=torch.int64))


@pytest.mark.gpu
def test_gpu_gate_holds_the_stream_until_released():
    gate = StreamGate(torch.device("cuda"))
    values = torch.tensor([3, 4], dtype=torch.int32, device="cuda")
    with gate:
        assert gate.read(values) == [3, 4]
        marker = torch.cuda.Event()
        marker.record()  # queued behind the gate
        time.sleep(0.02)
        assert not marker.query()  # 20 ms later the gate still holds the stream
    marker.synchronize()
    assert not gate.held and 0 < gate.last_polls < MAX_POLLS


@pytest.mark.gpu
def test_gpu_probe_reads_through_the_gate_and_releases_it():
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = pbs.PBSConfig().dense_fallback.min_seq_len
    q = torch.randn((1, 8, n, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn((1, 2, n, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    gate = stream_gate(q.device)
    pbs.attention(q, k, v)  # the first call builds cuDNN's graph: longer than the gate waits
    torch.cuda.synchronize()
    ticket = gate._ticket
    out, plan = pbs.attention(q, k, v, return_plan=True)
    assert plan is None  # flat attention: the probe sent it to dense attention
    torch.cuda.synchronize()
    assert gate._ticket == ticket + 1 and not gate.held  # held once, then released
    assert gate.last_polls < MAX_POLLS  # opened by the host, not by giving up
    assert relative_error(out, pbs.reference.dense_attention(q, k, v)) < 1e-2
    # The gated estimate is the ungated one.
    from pbs.dense import probe_estimate

    config = pbs.PBSConfig()
    with gate:
        gated = probe_estimate(config, q, k, 128**-0.5, gate)
    assert gated == probe_estimate(config, q, k, 128**-0.5)
