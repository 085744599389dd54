"""pbs: Permuted Block-Sparse Attention for fast long-context prefill.

```python
import pbs

q, k, v = pbs.testing.make_qkv(seq_len=1024, heads_q=4, heads_kv=2, head_dim=32)
out = pbs.attention(q, k, v)  # default: the vertical_slash_pooled preset (no permutation)
assert out.shape == (1, 4, 1024, 32)
paper = pbs.attention(q, k, v, pbs.PBSConfig.from_preset("pbs_paper"))  # last_block + mean_pool
```
"""

from pbs import permuters as _permuters  # noqa: F401  (registers the built-in permuters)
from pbs import selectors as _selectors  # noqa: F401  (registers the built-in selectors)
from pbs import backends  # noqa: F401  (registers the built-in backends and the GPU planners)
from pbs import ops  # noqa: F401  (registers torch.ops.pbs.attention for torch.compile)
from pbs import reference, testing
from pbs.api import attention, plan, run
from pbs.backends import list_backends
from pbs.components import (
    PermutationInputs,
    PermuterConfig,
    Permutations,
    SelectionInputs,
    SelectorConfig,
    list_permuters,
    list_selectors,
    register_permuter,
    register_selector,
)
from pbs.config import DenseFallback, PBSConfig
from pbs.layout import Layout
from pbs.serving import merge_attention_states, varlen_attention
from pbs.types import BlockMask, Permutation, Plan



def _installed_version() -> str:
    """The version pip installed of ``pbs-attn`` (this package's install name); ``0+unknown`` for a
    source tree that pip did not install."""
    import importlib.metadata

    try:
        return importlib.metadata.version("pbs-attn")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()


def list_presets() -> list[str]:
    """Names of the named configs that `PBSConfig.from_preset` takes (``pbs list`` prints them too).

    ```python
    import pbs

    assert "pbs_paper" in pbs.list_presets()
    config = pbs.PBSConfig.from_preset(pbs.list_presets()[0])
    ```
    """
    from pbs.config import PRESETS

    return list(PRESETS)


__all__ = [
    "BlockMask",
    "DenseFallback",
    "Layout",
    "PBSConfig",
    "PermutationInputs",
    "Permutation",
    "Permutations",
    "PermuterConfig",
    "Plan",
    "SelectionInputs",
    "SelectorConfig",
    "__version__",
    "attention",
    "list_backends",
    "list_permuters",
    "list_presets",
    "list_selectors",
    "merge_attention_states",
    "plan",
    "reference",
    "register_permuter",
    "register_selector",
    "run",
    "testing",
    "varlen_attention",
]
