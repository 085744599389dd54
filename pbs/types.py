"""The values that flow between planning and running: `Permutation`, `BlockMask`, `Plan`."""

from __future__ import annotations


from dataclasses import dataclass

import torch

from pbs.config_view import ConfigView
from pbs.layout import Layout


@dataclass(frozen=True, eq=False)
class Permutation:
    """A segmented permutation of one token axis, per (batch, head).

    Slot ``t`` of the permuted sequence holds the token at original index ``indices[b, h, t]``;
    ``inverse[b, h, i]`` is the slot that original index ``i`` moved to. Indices are local to the
    sequence (``0 .. N-1``); for queries add `Layout.query_offset` to get positions.

    Attributes:
        indices: ``(B, H, N)`` int64.
        inverse: ``(B, H, N)`` int64, ``inverse.gather(-1, indices) == arange(N)``.
        is_identity: true when nothing moved; `apply` then returns its input unchanged.
    """

    indices: torch.Tensor
    inverse: torch.Tensor
    is_identity: bool = False

    @classmethod
    def from_indices(cls, indices: torch.Tensor) -> "Permutation":
        """Builds a permutation (and its inverse) from ``(B, H, N)`` slot-to-original indices.

        Raises:
            TypeError: ``indices`` is not an integer tensor.
            ValueError: ``indices`` is not 3-D, or (off CUDA, where checking would cost a host
                sync) holds a value outside ``0 .. N-1``.
        """
        if not isinstance(indices, torch.Tensor) or indices.is_floating_point() or indices.dtype == torch.bool:
            raise TypeError(f"Permutation indices must be an integer tensor, got {getattr(indices, 'dtype', type(indices).__name__)}")
        if indices.dim() != 3:
            raise ValueError(f"Permutation indices must have shape (B, H, N), got {tuple(indices.shape)}")
        n = indices.shape[-1]
        if not indices.is_cuda and indices.numel() and not bool(((indices >= 0) & (indices < n)).all()):
            raise ValueError(
                f"Permutation indices must lie in 0..{n - 1} (N = {n}), got values from "
                f"{int(indices.min())} to {int(indices.max())}"
            )
        indices = indices.to(torch.int64)
        inverse = torch.empty_like(indices)
        arange = torch.arange(indices.shape[-1], device=indices.device).expand_as(indices)
        inverse.scatter_(-1, indices, arange)
        return cls(indices=indices, inverse=inverse)

    @classmethod
    def identity(cls, batch: int, heads: int, length: int, device: torch.device | str = "cpu") -> "Permutation":
        """The permutation that moves nothing (stored as an expanded ``arange``, no copy)."""
        arange = torch.arange(length, device=device).expand(batch, heads, length)
        return cls(indices=arange, inverse=arange, is_identity=True)

    @property
    def heads(self) -> int:
        return self.indices.shape[1]

    @property
    def length(self) -> int:
        return self.indices.shape[-1]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """Reorders tokens of ``x`` into permuted order.

        Args:
            x: ``(B, Hx, N, D)`` with ``Hx == H`` or ``H % Hx == 0``; in the second case each of the
                ``H / Hx`` heads that share an input head gets its own reordered copy (per-head GQA).

        Returns:
            ``(B, H, N, D)`` with ``out[b, h, t] = x[b, h * Hx // H, indices[b, h, t]]``.
        """
        h = self.heads
        if self.is_identity and x.shape[1] == h:
            return x
        if x.shape[1] != h:
            b, hx, n, d = x.shape
            x = x[:, :, None].expand(b, hx, h // hx, n, d).reshape(b, h, n, d)
        index = self.indices[..., None].expand(*self.indices.shape, x.shape[-1])
        return x.gather(2, index)

    def unapply(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of `apply` for ``y`` of shape ``(B, H, N, D)``: back to original order."""
        if self.is_identity:
            return y
        index = self.inverse[..., None].expand(*self.inverse.shape, y.shape[-1])
        return y.gather(2, index)

    def to(self, device: torch.device | str) -> "Permutation":
        return Permutation(self.indices.to(device), self.inverse.to(device), self.is_identity)


PRECISION_FORMATS: dict[str, tuple[str | None, bool]] = {
    "native": (None, False),
    "fp8_qk": ("e4m3", False),
    "fp8": ("e4m3", True),
    "int8_qk": ("int8", False),
    "int8_qk_fp8_pv": ("int8", True),
}
"""Every `pbs.PBSConfig.precision`: ``(format of Q and K or None, whether P.V runs in e4m3)``."""


def block_index_dtype(num_key_blocks: int) -> torch.dtype:
    """The dtype of `BlockMask.indices` for ``num_key_blocks`` key blocks."""
    return torch.int16 if num_key_blocks < 2**15 else torch.int32


def full_block_counts(counts: torch.Tensor, indices: torch.Tensor, layout: Layout) -> torch.Tensor:
    """`BlockMask.full_counts` of selected-block lists: ``(B, Hq, Tq)`` int32.

    The number of leading entries of each ascending list ``indices[..., :counts]`` that lie below
    the query block's `Layout.first_masked_blocks`, i.e. need no per-token check. Computed on
    ``indices``' device with no host sync (CUDA-graph safe).
    """
    # Recomputed per mask, not cached: a device tensor kept in a cache may have been allocated
    # in a CUDA-graph pool (torch.compile's cudagraph trees warm up there) and would keep that
    # whole pool alive; a full GPU test run with such a cache ran out of memory.
    first = layout.first_masked_blocks(indices.device).to(indices.dtype)  # (Tq,), <= Tk fits the dtype
    # The -1 padding past each count is below every ``first`` too: one pass over the lists counts
    # it along, and the padding (Tk - count entries) is taken off again.
    below = (indices < first[:, None]).sum(-1, dtype=torch.int32)
    return below - (indices.shape[-1] - counts.to(torch.int32))


class _DerivedOnFirstRead:
    """`BlockMask.full_counts`: the value given to the constructor, else `full_block_counts` worked
    out on first read and kept. Deferred because many masks are only intermediate (a union's
    member, merged into another list) and never reach a kernel: deriving the split for them
    cost a dozen small launches per plan."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, mask: "BlockMask | None", owner: type) -> torch.Tensor | None:
        if mask is None:
            return None  # the dataclass default: derive
        value = mask.__dict__.get(self.slot)
        if value is None:
            value = full_block_counts(mask.counts, mask.indices, mask.layout)
            mask.__dict__[self.slot] = value
        return value

    def __set__(self, mask: "BlockMask", value: torch.Tensor | None) -> None:
        mask.__dict__[self.slot] = value


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Selected key blocks per (batch, query head, query block), as counts plus sorted indices.

    The kernel walks ``indices[b, h, i, :counts[b, h, i]]`` and nothing else. Entries past the count
    are ``-1``. Block indices refer to the *permuted* key order.

    Each list is split, as FlexAttention splits its full and partial blocks, into a *full* head
    that needs no per-token check (key blocks wholly in the past of every query of the query
    block) and a *masked* tail (the on-diagonal segment, and the partial last key block when
    ``Nk`` is not a multiple of the block size), which is compared on original positions. The
    split is stored here, worked out once by `full_block_counts` from
    `Layout.first_masked_blocks`, and every backend (the Triton and Gluon kernels, the
    FlexAttention lowering) reads it. When a builder does not give it, it is derived on first
    read, so no builder can leave it out.

    Attributes:
        counts: ``(B, Hq, Tq)`` int32, number of selected key blocks.
        indices: ``(B, Hq, Tq, Tk)`` selected key blocks in ascending order, then ``-1``; int16
            while ``Tk < 2**15`` (up to 4M tokens at block 128: half the memory of int32, which
            matters at 512K where the list alone is ``Hq * Tq * Tk`` entries), int32 beyond.
        layout: the geometry the mask was built for.
        full_counts: ``(B, Hq, Tq)`` int32, how many leading entries of each list need no
            per-token check (``<= counts``); the rest get one. Leave it out to have it derived
            (`full_block_counts`, on first read); pass it to carry one along (`to`), from a
            kernel that counted it while compacting the lists, or, in tests, to check that a
            backend really reads it.
    """

    counts: torch.Tensor
    indices: torch.Tensor
    layout: Layout
    full_counts: torch.Tensor | None = _DerivedOnFirstRead()  # type: ignore[assignment]

    @property
    def known_full_counts(self) -> torch.Tensor | None:
        """`full_counts` where it was given or already derived, else None (without deriving it):
        for builders whose layout is not the one the derivation would read (a padded batch)."""
        return self.__dict__.get("_full_counts")

    def __post_init__(self) -> None:
        given = self.__dict__.get("_full_counts")
        if given is not None and tuple(given.shape) != tuple(self.counts.shape):
            raise ValueError(
                f"full_counts must have the shape of counts {tuple(self.counts.shape)}, "
                f"got {tuple(given.shape)}"
            )

    @classmethod
    def from_dense(cls, dense: torch.Tensor, layout: Layout) -> "BlockMask":
        """Converts a ``(B, Hq, Tq, Tk)`` bool mask to counts + sorted indices."""
        if dense.dtype != torch.bool:
            raise TypeError(f"dense must be a bool tensor, got dtype {dense.dtype}")
        expected = (layout.batch, layout.heads_q, layout.num_query_blocks, layout.num_key_blocks)
        if tuple(dense.shape) != expected:
            raise ValueError(f"dense must have shape (B, Hq, Tq, Tk) = {expected}, got {tuple(dense.shape)}")
        tk = dense.shape[-1]
        counts = dense.sum(-1, dtype=torch.int32)
        # Compaction by a running count (one scan and one scatter: no sort): a selected block goes
        # to slot "selected blocks before it", the rest to a spare last column that is dropped.
        slot = torch.where(dense, dense.cumsum(-1, dtype=torch.int32) - 1, tk)
        index_dtype = block_index_dtype(tk)
        packed = torch.full((*dense.shape[:-1], tk + 1), -1, dtype=index_dtype, device=dense.device)
        arange = torch.arange(tk, device=dense.device, dtype=index_dtype).expand_as(dense)
        packed.scatter_(-1, slot.long(), arange)
        indices = packed[..., :tk].contiguous()
        return cls(counts=counts, indices=indices, layout=layout)

    def to_dense(self) -> torch.Tensor:
        """``(B, Hq, Tq, Tk)`` bool mask of the selected blocks."""
        tk = self.layout.num_key_blocks
        dense = torch.zeros(*self.indices.shape[:-1], tk + 1, dtype=torch.bool, device=self.indices.device)
        # -1 padding lands in the spare last column, which is dropped.
        idx = torch.where(self.indices < 0, tk, self.indices).long()
        dense.scatter_(-1, idx, True)
        return dense[..., :tk]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.indices.shape)  # type: ignore[return-value]

    def num_selected(self) -> torch.Tensor:
        """Selected blocks per (batch, head): ``(B, Hq)`` int64."""
        return self.counts.sum(-1, dtype=torch.int64)

    def density_per_head(self) -> torch.Tensor:
        """Selected over allowed blocks per (batch, head): ``(B, Hq)`` float32."""
        return self.num_selected().float() / self.layout.total_allowed_blocks

    def density(self) -> float:
        """Fraction of the causally allowed blocks that are selected, over all heads and batches."""
        return float(self.density_per_head().mean())

    def to(self, device: torch.device | str) -> "BlockMask":
        return BlockMask(self.counts.to(device), self.indices.to(device), self.layout, self.full_counts.to(device))


@dataclass(frozen=True, eq=False)
class Plan:
    """Everything `pbs.run` needs besides the tensors: permutations and the block mask.

    Attributes:
        key_permutation: ``Permutation`` over keys; ``H`` is ``Hq`` in ``per_head`` GQA mode and
            ``Hkv`` in ``shared`` mode.
        query_permutation: ``Permutation`` over queries with ``H = Hq`` (identity for key permuters).
        mask: the selected blocks in permuted order.
        config: the config that produced the plan.
        backend: the attention backend chosen when planning (`pbs.list_backends`), which
            `pbs.run` uses.
        layout: geometry of the call.
        fallback: why dense attention ran instead of PBS (`pbs.dense.DensePolicy`), or None
            when PBS ran. A plan returned for a dense call is dense itself: every causally
            allowed block selected (density 1.0), nothing permuted; `pbs.run` of it is dense
            attention on the block-sparse backend.
        dense_rule: the `pbs.dense.DensePolicy` rule that sent the call to dense attention:
            ``"length"``, ``"planning_cost"``, ``"probe"`` or ``"planned_density"``; None when PBS ran.
    """

    key_permutation: Permutation
    query_permutation: Permutation
    mask: BlockMask
    config: ConfigView
    backend: str
    fallback: str | None = None
    dense_rule: str | None = None

    @property
    def ran_dense(self) -> bool:
        """Whether dense attention ran instead of PBS for the call that returned this plan."""
        return self.fallback is not None

    @property
    def decision(self) -> str:
        """``"pbs"``, or ``"dense (<rule>): <reason>"`` when the dense policy decided dense."""
        return "pbs" if self.fallback is None else f"dense ({self.dense_rule}): {self.fallback}"

    @property
    def precision(self) -> str:
        """The arithmetic that ran (`pbs.PBSConfig.precision`): the config's for PBS, ``"native"``
        when the dense policy ran SDPA instead."""
        return "native" if self.fallback is not None else self.config.precision

    @property
    def layout(self) -> Layout:
        return self.mask.layout

    @property
    def density(self) -> float:
        """Selected over causally allowed blocks (see `BlockMask.density`)."""
        return self.mask.density()

    def key_positions(self) -> torch.Tensor:
        """Original position of every permuted key slot: ``(B, Hk, Nk)`` int64."""
        return self.key_permutation.indices

    def query_positions(self) -> torch.Tensor:
        """Original position of every permuted query slot: ``(B, Hq, Nq)`` int64."""
        return self.query_permutation.indices + self.layout.query_offset

    def __repr__(self) -> str:
        """One line: the call's shape, the components, block size, density, backend, and the dense
        policy's decision where the plan records one (the tensors are left out: a plan holds
        ``(B, H, N)`` permutations and ``(B, Hq, Tq, Tk)`` block indices)."""
        layout, config = self.layout, self.config
        shape = (f"B={layout.batch}, Hq={layout.heads_q}, Hkv={layout.heads_kv}, Nq={layout.seq_len_q}, "
                 f"Nk={layout.seq_len_k}")
        components = f"permuter={config.permuter.name!r}, selector={config.selector.name!r}"
        decision = getattr(self, "decision", None)
        return (f"Plan({shape}, {components}, block_size={layout.block_size}, density={self.density:.3f}, "
                f"backend={self.backend!r}" + (f", decision={decision!r}" if decision is not None else "") + ")")


@dataclass(frozen=True, eq=False)
class PagedTensor:
    """The keys (or the values) of one sequence where a paged cache holds them: what stands in
    for the ``(1, H, N, D)`` tensor they would make, so that the layers that only need its shape,
    dtype and device (the layout, dispatch, the dense policy's length rule) read it as they read
    that tensor, and the kernels that can read pages get the cache and the table instead of a copy.

    Row ``t`` of the sequence is ``cache[block_table[t // page_size], t % page_size]``. Built by
    `pbs.varlen_attention` from its ``block_table`` row and ``seqused_k`` entry, checked there.

    Attributes:
        cache: ``(num_pages, page_size, H, D)``, the whole cache (every sequence's pages).
        block_table: ``(max_pages,)`` int32 on the cache's device: this sequence's pages in order;
            entries past ``ceil(length / page_size)`` are never read.
        length: the sequence's rows, ``N``.
    """

    cache: torch.Tensor
    block_table: torch.Tensor
    length: int

    @property
    def shape(self) -> torch.Size:
        """``(1, H, N, D)``: the shape of the tensor the pages stand for."""
        _, _, heads, dim = self.cache.shape
        return torch.Size((1, heads, self.length, dim))

    @property
    def page_size(self) -> int:
        return self.cache.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.cache.dtype

    @property
    def device(self) -> torch.device:
        return self.cache.device

    @property
    def is_cuda(self) -> bool:
        return self.cache.is_cuda

    def gather(self) -> torch.Tensor:
        """The sequence as one contiguous ``(1, H, N, D)`` tensor: a copy of its pages, for the
        code that cannot read pages (the reference backend, the permuters that reorder keys)."""
        pages = -(-self.length // self.page_size)
        rows = self.cache.index_select(0, self.block_table[:pages].long()).flatten(0, 1)[: self.length]
        return rows.transpose(0, 1).unsqueeze(0).contiguous()


def is_paged(x: object) -> bool:
    """Whether ``x`` is a `PagedTensor` (keys or values read from a paged cache)."""
    return isinstance(x, PagedTensor)
