"""Several processes, one sequence: context-parallel PBS prefill on ``torch.distributed``.

`context_parallel_attention` takes each rank's zigzag shard of one causal sequence
(`shard_sequence`), plans the rank's own queries with the selection inputs of the whole sequence,
and returns the rank's shard of the output; `unshard_sequence` joins the shards again.
docs/context-parallel.md has the launch command, what is communicated and the measurements.

Import it explicitly (``import pbs.distributed``): ``import pbs`` does not load torch.distributed.

Modules: ``sharding`` (the zigzag split), ``context_parallel`` (the call: checks, planning,
attention), ``agreement`` (the ranks agree on the call before any other collective, or all raise
the same error), ``summaries`` (the whole sequence's selection inputs computed across ranks),
``collectives`` (the process group and the all-gathers of uneven shards).
"""

from pbs.distributed.context_parallel import (
    CONTEXT_PARALLEL,
    ContextParallelResult,
    check_supported,
    context_parallel_attend,
    context_parallel_attention,
    unsupported_reasons,
)
from pbs.distributed.sharding import chunk_bounds, rank_chunks, shard_length, shard_sequence, unshard_sequence

__all__ = [
    "CONTEXT_PARALLEL",
    "ContextParallelResult",
    "check_supported",
    "chunk_bounds",
    "context_parallel_attend",
    "context_parallel_attention",
    "rank_chunks",
    "shard_length",
    "shard_sequence",
    "unshard_sequence",
    "unsupported_reasons",
]
