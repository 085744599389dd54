"""`pbs.kernels.pad_rows` against its eager twin `pbs.reference.pad_rows`, bit for bit, through the
Triton interpreter on CPU (every address checked against the tensors' storages), and the dispatcher
`pbs.backends.padding`: the twin on CPU, the kernel on CUDA, captured in a CUDA graph there.

Every kernel output is written into a NaN-poisoned buffer, so a padded row the kernel forgot (or
left to a zero fill it does not do) fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

from pbs.kernels import pad_rows as kernel
from pbs.reference import pad_rows as eager

pytestmark = pytest.mark.usefixtures("checked_addresses")

ROWS = 48
# Empty, one token, on and off the kernel's row tile (16 rows for H * D = 512), and exactly ROWS.
LENGTHS = [0, 1, 16, 17, ROWS, 5]
DTYPES = [torch.float16, torch.float32, torch.bfloat16]  # a copy: bf16 is exact in the interpreter too


def packed_batch(lengths, heads, head_dim, dtype, device="cpu", seed=0):
    """``(x (T, H, D), cu_seq (N + 1,) int32)`` for sequences of ``lengths``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), heads, head_dim, generator=generator).to(dtype=dtype, device=device)
    cu_seq = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return x, cu_seq


def paged_batch(lengths, heads, head_dim, page_size, dtype, device="cpu", seed=0):
    """``(cache, block_table, lengths)``: pages handed out in a random order, NaN wherever no
    sequence wrote, and one table entry more than any sequence needs, left at -1 (never read)."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_sequence = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per_sequence) + 2
    order = torch.randperm(num_pages, generator=generator).tolist()
    cache = torch.full((num_pages, page_size, heads, head_dim), float("nan"))
    table = torch.full((len(lengths), max(pages_per_sequence) + 1), -1, dtype=torch.int32)
    for i, n in enumerate(lengths):
        for j in range(pages_per_sequence[i]):
            table[i, j] = page = order.pop()
            filled = min(page_size, n - j * page_size)
            cache[page, :filled] = torch.randn(filled, heads, head_dim, generator=generator)
    return (cache.to(dtype=dtype, device=device), table.to(device),
            torch.tensor(lengths, dtype=torch.int32, device=device))


def poisoned(n, heads, head_dim, dtype, device="cpu"):
    return torch.full((n, ROWS, heads, head_dim), float("nan"), dtype=dtype, device=device)


def assert_padded(got, x_rows, lengths):
    """``got (N, H, rows, D)``: the view of a token-major buffer, zeros past each length and no NaN
    (the sequences' own rows are compared with the twin by the caller)."""
    assert got.transpose(1, 2).is_contiguous(), "the result is the (N, H, rows, D) view of a token-major buffer"
    assert not got.isnan().any(), "a padded row was never written"
    for i, n in enumerate(lengths):
        assert (got[i, :, n:] == 0).all(), f"sequence {i}: the rows past its length {n} are not zeros"
    assert got.shape[2] == x_rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, head_dim", [(8, 64), (2, 64)])  # GQA-shaped: the query and the KV heads
def test_packed_kernel_equals_the_eager_twin(dtype, heads, head_dim):
    x, cu_seq = packed_batch(LENGTHS, heads, head_dim, dtype)
    expected = eager.pad_packed(x, cu_seq, ROWS)
    got = kernel.pad_packed(x, cu_seq, ROWS, out=poisoned(len(LENGTHS), heads, head_dim, dtype))
    assert torch.equal(got, expected)
    assert_padded(got, ROWS, LENGTHS)
    start = int(cu_seq[3])
    assert torch.equal(got[3, :, :17], x[start:start + 17].transpose(0, 1))  # the twin aside: its own rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [8, 2])
def test_paged_kernel_equals_the_eager_twin(dtype, page_size, heads):
    cache, table, lengths = paged_batch(LENGTHS, heads, 64, page_size, dtype)
    expected = eager.pad_paged(cache, table, lengths, ROWS)
    got = kernel.pad_paged(cache, table, lengths, ROWS, out=poisoned(len(LENGTHS), heads, 64, dtype))
    assert torch.equal(got, expected)
    assert_padded(got, ROWS, LENGTHS)
    for i, n in enumerate(LENGTHS):  # the twin itself: sequence i's keys, in order, through the table
        keys = [cache[table[i, t // page_size], t % page_size] for t in range(n)]
        assert torch.equal(expected[i, :, :n], torch.stack(keys, 1) if n else expected[i, :, :0])


def test_a_reused_buffer_is_rewritten_whole_with_new_lengths():
    # The buffer of a longer batch, padded again with shorter sequences: the rows the first call
    # wrote are zeros now, in both modes (a captured graph reuses its buffers this way).
    x, cu_seq = packed_batch([ROWS, ROWS], 2, 64, torch.float16)
    buffer = poisoned(2, 2, 64, torch.float16)
    kernel.pad_packed(x, cu_seq, ROWS, out=buffer)
    assert (buffer != 0).float().mean() > 0.99
    x, cu_seq = packed_batch([3, 17], 2, 64, torch.float16, seed=1)
    again = kernel.pad_packed(x, cu_seq, ROWS, out=buffer)
    assert torch.equal(again, eager.pad_packed(x, cu_seq, ROWS))
    assert_padded(again, ROWS, [3, 17])

    cache, table, lengths = paged_batch([ROWS, ROWS], 2, 64, 16, torch.float16)
    kernel.pad_paged(cache, table, lengths, ROWS, out=buffer)
    lengths = torch.tensor([17, 0], dtype=torch.int32)
    again = kernel.pad_paged(cache, table, lengths, ROWS, out=buffer)
    assert torch.equal(again, eager.pad_paged(cache, table, lengths, ROWS))
    assert_padded(again, ROWS, [17, 0])


def test_empty_inputs_give_zeros():
    x, cu_seq = packed_batch([0, 0], 2, 64, torch.float32)
    assert x.shape[0] == 0
    got = kernel.pad_packed(x, cu_seq, ROWS, out=poisoned(2, 2, 64, torch.float32))
    assert torch.equal(got, eager.pad_packed(x, cu_seq, ROWS)) and (got == 0).all()
    # A table with no page column: every slot is padding, whatever the lengths say.
    cache, table, _ = paged_batch([5, 9], 2, 64, 16, torch.float32)
    lengths = torch.tensor([5, 9])
    got = kernel.pad_paged(cache, table[:, :0], lengths, ROWS, out=poisoned(2, 2, 64, torch.float32))
    assert torch.equal(got, eager.pad_paged(cache, table[:, :0], lengths, ROWS)) and (got == 0).all()
    assert kernel.pad_packed(x, cu_seq[:1], ROWS).shape == (0, 2, ROWS, 64)


def test_strided_inputs_with_contiguous_token_rows():
    # K out of a fused (T, 2, H, D) KV tensor, and a cache whose pages interleave K and V: the row
    # (and page) strides are the kernel's arguments, so neither is copied.
    lengths = [7, 0, 30]
    kv, cu_seq = packed_batch([2 * n for n in lengths], 4, 32, torch.float16)
    kv = kv.view(-1, 2, 4, 32)
    cu_seq = cu_seq // 2
    k = kv[:, 0]
    assert not k.is_contiguous() and kernel.rows_are_contiguous(k)
    got = kernel.pad_packed(k, cu_seq, ROWS, out=poisoned(3, 4, 32, torch.float16))
    assert torch.equal(got, eager.pad_packed(k, cu_seq, ROWS))
    assert_padded(got, ROWS, lengths)

    cache, table, lengths = paged_batch(lengths, 4, 32, 16, torch.float16)
    interleaved = torch.stack((cache, -cache), 1)  # (num_pages, 2, page_size, H, D)
    k_cache = interleaved[:, 0]
    got = kernel.pad_paged(k_cache, table, lengths, ROWS, out=poisoned(3, 4, 32, torch.float16))
    assert torch.equal(got, eager.pad_paged(cache, table, lengths, ROWS))


def test_bad_layouts_and_buffers_are_refused_by_name():
    x, cu_seq = packed_batch([5, 9], 4, 32, torch.float16)
    d_strided = x.transpose(1, 2).contiguous().transpose(1, 2)  # (T, H, D) with stride H along D
    assert not kernel.rows_are_contiguous(d_strided)
    with pytest.raises(ValueError, match=r"x must have contiguous token rows .*strides \(128, 1, 4\)"):
        kernel.pad_packed(d_strided, cu_seq, ROWS)
    with pytest.raises(ValueError, match=r"cache must be \(num_pages, page_size, H, D\); got shape \(14, 4, 32\)"):
        kernel.pad_paged(x, torch.zeros(2, 1, dtype=torch.int32), torch.tensor([5, 9]), ROWS)
    cache, table, lengths = paged_batch([5, 9], 4, 32, 16, torch.float16)
    with pytest.raises(ValueError, match=r"lengths must have shape \(N,\) = \(2,\)"):
        kernel.pad_paged(cache, table, lengths[:1], ROWS)
    for twin in (kernel, eager):
        with pytest.raises(ValueError, match=r"out must be a contiguous torch.float16 tensor of shape \(2, 48, 4, 32\)"):
            twin.pad_packed(x, cu_seq, ROWS, out=torch.zeros(2, 4, ROWS, 32, dtype=torch.float16))
        with pytest.raises(ValueError, match=r"got torch.float32 \(2, 48, 4, 32\)"):
            twin.pad_paged(cache, table, lengths, ROWS, out=torch.zeros(2, ROWS, 4, 32))


def test_the_dispatcher_takes_the_eager_twin_off_cuda(monkeypatch):
    from pbs.backends import padding

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel ran on CPU")

    monkeypatch.setattr(kernel, "pad_packed", refuse)
    monkeypatch.setattr(kernel, "pad_paged", refuse)
    x, cu_seq = packed_batch(LENGTHS, 2, 64, torch.float32)
    assert torch.equal(padding.pad_packed(x, cu_seq, ROWS), eager.pad_packed(x, cu_seq, ROWS))
    cache, table, lengths = paged_batch(LENGTHS, 2, 64, 16, torch.float32)
    assert torch.equal(padding.pad_paged(cache, table, lengths, ROWS), eager.pad_paged(cache, table, lengths, ROWS))


@pytest.mark.gpu
def test_the_dispatcher_runs_the_kernel_on_cuda_and_equals_the_twin_in_bf16(monkeypatch):
    from pbs.backends import padding

    launches = []

    def counted(name):
        launch = getattr(kernel, name)

        def run(*args, **kwargs):
            launches.append(name)
            return launch(*args, **kwargs)

        return run

    for name in ("pad_packed", "pad_paged"):
        monkeypatch.setattr(kernel, name, counted(name))
    lengths = [0, 1, 127, 128, 129, 1000, 2048]
    x, cu_seq = packed_batch(lengths, 8, 128, torch.bfloat16, device="cuda")
    got = padding.pad_packed(x, cu_seq, 2048)
    assert torch.equal(got, eager.pad_packed(x, cu_seq, 2048))
    for page_size in (1, 16):
        cache, table, seqused = paged_batch(lengths, 8, 128, page_size, torch.bfloat16, device="cuda")
        got = padding.pad_paged(cache, table, seqused, 2048)
        assert torch.equal(got, eager.pad_paged(cache, table, seqused, 2048))
    assert launches == ["pad_packed", "pad_paged", "pad_paged"]
    # Rows that are not contiguous take the twin instead of a copy of the whole tensor.
    d_strided = x.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(padding.pad_packed(d_strided, cu_seq, 2048), eager.pad_packed(x, cu_seq, 2048))
    assert len(launches) == 3


@pytest.mark.gpu
def test_the_padding_is_captured_in_a_cuda_graph_and_replays_with_new_lengths():
    from pbs.backends import padding

    batches = [[300, 0, 1, 211], [1, 511, 0, 0], [128, 128, 128, 128]]  # the same total: T is fixed
    rows, page_size = 512, 16
    x, cu_seq = packed_batch(batches[0], 8, 128, torch.bfloat16, device="cuda")
    cache, table, seqused = paged_batch(batches[0], 8, 128, page_size, torch.bfloat16, device="cuda")
    table = torch.nn.functional.pad(table, (0, rows // page_size + 1 - table.shape[1]), value=-1)
    cache = torch.cat((cache, torch.full((64, *cache.shape[1:]), float("nan"), dtype=cache.dtype, device="cuda")))
    packed_out = torch.full((4, rows, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    paged_out = packed_out.clone()

    def pad():
        padding.pad_packed(x, cu_seq, rows, out=packed_out)
        padding.pad_paged(cache, table, seqused, rows, out=paged_out)

    pad()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host read inside raises
        pad()
    for seed, lengths in enumerate(batches[1:] + batches[:1], start=1):
        fresh_x, fresh_cu = packed_batch(lengths, 8, 128, torch.bfloat16, device="cuda", seed=seed)
        fresh_cache, fresh_table, fresh_used = paged_batch(lengths, 8, 128, page_size, torch.bfloat16,
                                                          device="cuda", seed=seed)
        x.copy_(fresh_x), cu_seq.copy_(fresh_cu), seqused.copy_(fresh_used)
        table.fill_(-1)[:, :fresh_table.shape[1]] = fresh_table
        cache.fill_(float("nan"))[:fresh_cache.shape[0]] = fresh_cache
        graph.replay()
        assert torch.equal(packed_out.transpose(1, 2), eager.pad_packed(fresh_x, fresh_cu, rows)), lengths
        assert torch.equal(paged_out.transpose(1, 2), eager.pad_paged(fresh_cache, fresh_table, fresh_used, rows)), lengths
        assert_padded(paged_out.transpose(1, 2), rows, lengths)
