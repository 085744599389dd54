"""Integrations of PBS-Attn with model libraries.

* `pbs.integrations.transformers`: ``attn_implementation="pbs"`` for Hugging Face
  transformers (``register()``), with the ``pbs generate`` command in `pbs.cli.generate`.
* `pbs.integrations.ttft`: time to first token of a causal LM (`measure_ttft`), shared by
  ``pbs generate`` and ``benchmarks/bench_ttft.py``.
* `pbs.integrations.tensor_parallel`: PBS on one rank's share of the heads under tensor
  parallelism (``tp_plan="auto"``), deciding as one process over all heads would.
* `pbs.integrations.context_parallel`: a transformers model's prefill with the prompt split over
  the ranks of a group (``attn_implementation="pbs_context_parallel"``,
  `context_parallel_prefill`), each layer through `pbs.distributed.context_parallel_attention`.

Nothing here is imported by ``import pbs``, and the library an integration serves is imported only
when it is used, so ``pbs`` works without them installed.
"""
