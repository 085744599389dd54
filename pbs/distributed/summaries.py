"""The selection inputs of the whole sequence, computed across the ranks from each rank's shard.

Each rank holds its zigzag shard; the selectors read `pbs.components.SequenceSummaries` of the
whole sequence. `block_means` pools a rank's own key blocks (the ranks then all-gather them),
`line_scores` gives ``vertical_slash``'s scores, `key_order` ``last_block``'s key order and
`probe_estimate` the density probe, each with the collectives the module docstring of
`pbs.distributed.context_parallel` lists. ``local`` lists a rank's chunks as ``(start, end, slot)``:
positions in the sequence, and where the chunk starts in the local shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pbs.components import PermutationInputs
from pbs.config import PBSConfig
from pbs.distributed.collectives import torch_distributed
from pbs.layout import Layout
from pbs.permuters._segments import scoring_queries, sort_within_segments
from pbs.reference.density_probe import probe_density_of_pooled, sampled_query_blocks
from pbs.reference.logits import grouped_logits

# Line-score rows held at once (float32 elements): bounded on the CPU, larger on the GPU.
_LINE_CHUNK = 1 << 24
_LINE_CHUNK_CUDA = 1 << 27


def _softmax_over_ranks(
    queries: torch.Tensor, k: torch.Tensor, parts: list[tuple[int, int, int]], row_pos: torch.Tensor,
    logit_scale: float | None, causal: bool, group: Any, visit: Callable[..., None],
) -> None:
    """Softmax rows of ``queries`` over the keys of every rank, each rank visiting its own keys.

    The rows' maxima and sums over this rank's keys are combined over the ranks (one all-reduce of
    each), then ``visit(start, end, slot, h0, h1, probs)`` sees the probabilities ``(B, h1 - h0, R,
    end - start)`` of each of this rank's key ranges ``(start, end, slot)`` (positions, and where
    the range starts in the local shard), a few heads at a time.

    Args:
        queries: ``(B, Hs, R, D)``, ``Hs`` a multiple of ``k``'s heads.
        k: ``(B, Hkv, N_local, D)``, this rank's keys.
        row_pos: ``(R,)`` positions of the rows (for ``causal``).
        logit_scale: multiplies the logits (None: the queries are scaled already), as the
            one-process code does, so the logits are the same numbers.
    """
    dist = torch_distributed()
    b, hs, rows, _ = queries.shape
    group_size = hs // k.shape[1]
    longest = max((end - start for start, end, _ in parts), default=1)
    budget = _LINE_CHUNK_CUDA if queries.is_cuda else _LINE_CHUNK
    step = max(group_size, (budget // max(1, b * rows * longest)) // group_size * group_size)

    def logits_of(start: int, end: int, slot: int, h0: int, h1: int) -> torch.Tensor:
        logits = grouped_logits(queries[:, h0:h1], k[:, h0 // group_size:h1 // group_size, slot:slot + end - start])
        if logit_scale is not None:
            logits = logits * logit_scale
        if causal:
            future = torch.arange(start, end, device=queries.device)[None, :] > row_pos[:, None]
            logits = logits.masked_fill_(future, float("-inf"))
        return logits

    row_max = torch.full((b, hs, rows), float("-inf"), device=queries.device)
    row_sum = torch.zeros(b, hs, rows, device=queries.device)
    for start, end, slot in parts:
        for h0 in range(0, hs, step):
            h1 = min(hs, h0 + step)
            logits = logits_of(start, end, slot, h0, h1)
            new_max = torch.maximum(row_max[:, h0:h1], logits.amax(-1))
            safe = torch.where(new_max == float("-inf"), 0.0, new_max)
            row_sum[:, h0:h1] = (row_sum[:, h0:h1] * torch.exp(row_max[:, h0:h1] - safe)
                                 + torch.exp(logits - safe[..., None]).sum(-1))
            row_max[:, h0:h1] = new_max
    global_max = row_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    row_sum = row_sum * torch.exp(row_max - global_max).nan_to_num(0.0)
    dist.all_reduce(row_sum, group=group)
    for start, end, slot in parts:
        for h0 in range(0, hs, step):
            h1 = min(hs, h0 + step)
            probs = torch.exp(logits_of(start, end, slot, h0, h1) - global_max[:, h0:h1, :, None])
            visit(start, end, slot, h0, h1, probs / row_sum[:, h0:h1, :, None])


def line_scores(q: torch.Tensor, k: torch.Tensor, local: list[tuple[int, int, int]], seq_len: int, last_rows: int,
                 scale: float, group: Any, src: int) -> torch.Tensor:
    """``vertical_slash``'s line scores of the whole sequence, ``(2, B, Hq, N)`` float32, from every
    rank's keys: what `pbs.selectors.vertical_slash.vertical_and_slash_scores` gives one process.

    ``local`` lists this rank's chunks as ``(start, end, slot)`` (``slot``: where the chunk starts in
    the local shard); ``src`` is the global rank holding the sequence's last rows.
    """
    dist = torch_distributed()
    b, hq, n_local, d = q.shape
    rows = min(last_rows, seq_len)
    # Scaled in float32 on the owner, as the reference scales them, so every rank scores equal rows.
    q_last = torch.empty(b, hq, rows, d, dtype=torch.float32, device=q.device)
    if dist.get_rank() == src:
        q_last.copy_(q[:, :, n_local - rows:].float() * scale)
    dist.broadcast(q_last, src=src, group=group)
    scores = torch.zeros(2, b, hq, seq_len, device=q.device)
    vertical, slash = scores[0], scores[1]

    def visit(start: int, end: int, slot: int, h0: int, h1: int, probs: torch.Tensor) -> None:
        vertical[:, h0:h1, start:end] = probs.sum(-2) / rows
        for r in range(rows):
            pos = seq_len - rows + r
            seen = min(end, pos + 1) - start  # the row's visible keys of this range
            if seen > 0:
                # key start + x sits at offset pos - start - x: the row reversed lands on offsets.
                lo = pos - start - seen + 1
                slash[:, h0:h1, lo:lo + seen] += probs[:, :, r, :seen].flip(-1)

    row_pos = torch.arange(seq_len - rows, seq_len, device=q.device)
    _softmax_over_ranks(q_last, k, local, row_pos, None, True, group, visit)
    slash /= rows
    dist.all_reduce(scores, group=group)
    return scores


def key_order(q: torch.Tensor, k: torch.Tensor, local: list[tuple[int, int, int]], seq_len: int,
               config: PBSConfig, scale: float, group: Any, src: int) -> torch.Tensor:
    """``last_block``'s key order over every rank's keys (`pbs.permuters.last_block`, Eq. 3-4).

    The rank holding the sequence's last queries broadcasts them (their group means in ``shared``
    GQA mode); every rank scores its own keys with the softmax normalised over all ranks' keys and
    sorts its own segments.

    Returns:
        ``(B, Hk, N_local)`` int64: the original positions of this rank's permuted key slots, in
        shard order (``Hk``: ``Hq`` in ``per_head`` GQA mode, else ``Hkv``).
    """
    dist = torch_distributed()
    permuter = config.permuter
    segment = config.segment_size
    permutable = seq_len // segment * segment
    m = min(seq_len, permuter.num_queries or config.block_size)
    causal = bool(permuter.causal_scoring) and config.causal
    b, hq, n_local, d = q.shape
    hkv = k.shape[1]
    heads = hq if config.gqa == "per_head" else hkv
    proxies = torch.empty(b, heads, m, d, dtype=q.dtype, device=q.device)
    if dist.get_rank() == src:
        rows = q[:, :, n_local - m:].contiguous()
        layout = Layout(b, hq, hkv, m, m, config.block_size, config.segment_size)
        proxies.copy_(scoring_queries(PermutationInputs(q=rows, k=k, layout=layout, gqa=config.gqa, scale=scale)))
    dist.broadcast(proxies, src=src, group=group)
    # Eq. 3 scores the keys of the full segments with no mask; causal_scoring masks and takes all.
    parts = [(start, end if causal else min(end, permutable), slot) for start, end, slot in local]
    parts = [part for part in parts if part[1] > part[0]]
    scores = {start: torch.empty(b, heads, end - start, device=q.device) for start, end, _ in parts}

    def visit(start: int, end: int, slot: int, h0: int, h1: int, probs: torch.Tensor) -> None:
        scores[start][:, h0:h1] = probs.mean(-2)

    row_pos = torch.arange(seq_len - m, seq_len, device=q.device)
    _softmax_over_ranks(proxies, k, parts, row_pos, scale, causal, group, visit)
    pieces = []
    for start, end, _ in local:
        sortable = max(0, min(end, permutable) - start)
        chunk_scores = scores.get(start, torch.zeros(b, heads, 0, device=q.device))
        pieces.append(start + sort_within_segments(chunk_scores, 0, sortable, segment, total_len=end - start))
    return torch.cat(pieces, dim=-1)


def probe_estimate(q: torch.Tensor, local: list[tuple[int, int, int]], key_means: torch.Tensor, seq_len: int,
                    args: dict[str, Any], group: Any) -> float:
    """The density probe of the whole sequence: each rank pools the sampled query blocks it holds.

    ``q``: ``(B, Hq, N_local, D)``, this rank's queries; ``key_means``: ``(B, Hkv, ceil(N / block), D)``
    pooled keys of the whole sequence; ``args``: `pbs.dense.DensePolicy.probe_arguments`. Returns the
    estimated density (the same on every rank).
    """
    dist = torch_distributed()
    bs = args["block_size"]
    rows = sampled_query_blocks(-(-seq_len // bs), args["num_blocks"])
    b, hq, _, d = q.shape
    pooled = torch.zeros(b, hq, rows.numel(), d, device=q.device)
    for i, block in enumerate(rows.tolist()):
        first, last = block * bs, min(seq_len, block * bs + bs)
        for start, end, slot in local:
            if start <= first < end:
                a = slot + first - start
                pooled[:, :, i] = q[:, :, a:a + last - first].float().sum(2) / (last - first)
    dist.all_reduce(pooled, group=group)
    estimate = probe_density_of_pooled(pooled, key_means, rows, seq_len, seq_len, block_size=bs,
                                       threshold=args["threshold"], scale=args["scale"], causal=args["causal"])
    return float(estimate)
