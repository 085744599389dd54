"""``pbs quality``: what PBS does to a real trained model's predictions, against dense attention.

For a list of methods (PBS configs, and dense SDPA as the reference) on the same model and tokens:

* **long-text loss**: mean next-token loss over real documents (`pbs.analysis.quality_texts`);
* **copy recall**: a passage, unrelated filler, the passage again; the loss on the second copy;
* **per-layer attention error and coverage**: in the dense run, each layer's ``q``/``k``/``v`` are
  handed to every method, whose output is compared with dense attention on the same inputs, and
  whose selected blocks are weighed with the exact attention mass;
* **density** of every row (selected over causally allowed blocks, a dense layer counting 1).

The model runs the PBS reference backend (``backend="reference"``, whatever a config says). On
CUDA the default GPU backend (``backend="auto"``, with the dense fallback off) runs as well, and the
report compares the two. A method whose PBS layers fall back to dense attention is an error, not
a quiet row of dense numbers. `pbs.analysis.quality_report` writes the JSON, markdown and
pictures; ``pbs quality`` is the command.

The code, by idea: `pbs.analysis.quality_models` (loading the real models),
`pbs.analysis.quality_methods` (the rows: `Method`, `make_method`, the default list),
`pbs.analysis.quality_texts` (the texts and samples), `pbs.analysis.quality_probes` (the forward
passes and the per-layer probe), `pbs.analysis.quality_metrics` (losses, coverage, error, density),
`pbs.analysis.quality_results` (`QualityReport` and its summary) and this module (`run_quality`).
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Sequence
from typing import Any

import torch

from pbs.analysis.progress import ProgressBar
from pbs.analysis.quality_methods import DENSE, Method, check_unique_labels, with_backend
from pbs.analysis.quality_metrics import sample_result
from pbs.analysis.quality_probes import dense_forward, dense_with_layer_probe, full_attention_layers, pbs_forward
from pbs.analysis.quality_results import QualityReport
from pbs.analysis.quality_texts import Sample
from pbs.analysis.result_files import git_revision


def _environment() -> dict[str, Any]:
    import pbs

    revision, dirty = git_revision()
    versions = {"python": platform.python_version(), "torch": torch.__version__, "pbs": pbs.__version__,
                "git_revision": revision, "git_dirty": dirty}
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        versions["transformers"] = transformers.__version__
    return versions


def run_quality(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    methods: Sequence[Method],
    *,
    layer_samples: Sequence[str] = (),
    probe_layers: Sequence[int] | None = None,
    gpu_check: bool | None = None,
    progress: bool = True,
    meta: dict[str, Any] | None = None,
) -> QualityReport:
    """Runs every method on every sample, plus the per-layer probes.

    Args:
        model: a transformers causal LM whose attention dispatches through ``AttentionInterface``.
        samples: token sequences (`build_samples`).
        methods: rows; include `DENSE` for the reference (it is added first if missing). A method
            with a ``chunk_size`` (`pbs.analysis.quality_methods.chunked`) is prefilled in chunks
            against the growing KV cache; the per-layer probe measures one-shot methods only.
        layer_samples: names of the samples on which every method's per-layer error and coverage
            are measured (each costs a dense pass plus, per layer and method, a plan, a reference
            attention and, per distinct permutation, an exact block-mass pass).
        probe_layers: the layer ids probed there (default: every full-attention layer).
        gpu_check: also run each PBS method with ``backend="auto"`` and compare; default: when the
            model is on CUDA.
        progress: progress lines on stderr.
        meta: extra entries for the report's ``meta`` (model info, settings, texts).

    Raises:
        DenseFallbackError: a method ran dense attention in a layer it should have run PBS in.
    """
    methods = list(methods)
    if DENSE.label not in {m.label for m in methods}:
        methods.insert(0, DENSE)
    check_unique_labels(methods)
    names = {s.name for s in samples}
    unknown = sorted(set(layer_samples) - names)
    if unknown:
        raise ValueError(f"layer_samples: no samples named {unknown}")
    device = next(model.parameters()).device
    if gpu_check is None:
        gpu_check = device.type == "cuda"
    if gpu_check and device.type != "cuda":
        raise ValueError("gpu_check needs the model on a CUDA device")
    layers = full_attention_layers(model)
    probed = layers if probe_layers is None else sorted({int(i) for i in probe_layers})
    if not set(probed) <= set(layers):
        raise ValueError(
            f"probe_layers: {sorted(set(probed) - set(layers))} are not full-attention layers of the model "
            f"(those are {layers}; sliding-window layers are not probed)"
        )
    report = QualityReport(
        meta={**(meta or {}), "environment": _environment(), "device": str(device), "layers": layers,
              "layer_samples": list(layer_samples), "probe_layers": probed, "gpu_check": bool(gpu_check)},
        methods=methods,
        samples=[s.describe() for s in samples],
    )
    others = [m for m in methods if not m.is_reference]
    sparse = [m for m in others if not m.is_dense]
    total = len(samples) * len(methods) + (len(samples) * len(sparse) if gpu_check else 0)
    bar = ProgressBar(total, "quality", enabled=progress)
    try:
        for sample in samples:
            probe = probed if sample.name in layer_samples else []
            dense = dense_with_layer_probe(model, sample, methods, report, probe, progress)
            dense_row = sample_result(DENSE, sample, dense, "sdpa")
            if sample.name in layer_samples:
                dense_row["layer_probe"] = True  # its seconds include the per-layer probes
            report.results.append(dense_row)
            bar.advance(f"dense {sample.name} ({dense.seconds:.1f}s)")
            for method in others:
                if method.is_dense:  # dense prefilled in chunks
                    forward = dense_forward(model, sample, prefill_chunk=method.chunk_size)
                    report.results.append(sample_result(method, sample, forward, "sdpa"))
                    bar.advance(f"{method.label} {sample.name} ({forward.seconds:.1f}s)")
                    continue
                forward = pbs_forward(model, sample, with_backend(method.config, "reference"), method.label,
                                      prefill_chunk=method.chunk_size)
                row = sample_result(method, sample, forward, "reference")
                report.results.append(row)
                bar.advance(f"{method.label} {sample.name} ({forward.seconds:.1f}s)")
                if gpu_check:
                    gpu = pbs_forward(model, sample, with_backend(method.config, "auto"), method.label,
                                      prefill_chunk=method.chunk_size)
                    gpu_row = sample_result(method, sample, gpu, "auto")
                    for key in ("loss", "copy_loss", "density"):
                        if key in row:
                            gpu_row[f"{key}_reference"] = row[key]
                    report.gpu.append(gpu_row)
                    bar.advance(f"{method.label} {sample.name} on the GPU backend ({gpu.seconds:.1f}s)")
    finally:
        bar.close()
    return report
