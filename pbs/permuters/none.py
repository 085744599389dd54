"""``none``: no segmented permutation at all; the paper's unpermuted baselines.

``identity`` keeps every token in place but still treats each segment as permutable, so the whole
on-diagonal segment is forced and left out of the selector's softmax (PBS-Attn with a trivial
permutation). ``none`` is plain block-sparse attention: only the diagonal block is forced, and the
selectors rank every causally allowed block. With ``mean_pool`` it is the paper's MeanPooling
baseline (Algorithm 2 with a plain causal block mask), with ``antidiagonal`` XAttention's estimator.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pbs.components import PermutationInputs, PermuterConfig, Permutations, register_permuter


@register_permuter
class NoPermuter(PermuterConfig):
    """No permutation and no segments: the unpermuted block-sparse baselines."""

    name: Literal["none"] = "none"
    segmented: ClassVar[bool] = False

    def permute(self, inputs: PermutationInputs) -> Permutations:
        return Permutations(keys=None, queries=None)
