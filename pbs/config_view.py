"""`ConfigView`: a `pbs.PBSConfig` as the values beneath `pbs.config` name it.

`pbs.config` is built from the components (`pbs.components`), which are built from the values of
`pbs.types`. Yet a component checks that it can run with a config
(`ComponentConfig.check_compatible`), and a `pbs.types.Plan` holds the config that made it. Both
name the config by this protocol instead of importing `pbs.config`, so that the imports of the
values floor run one way: layout, types, components, config. A `ConfigView` is always a
`PBSConfig`; its members are `PBSConfig`'s fields (tests/test_layout_rules.py holds the two together).
"""

from __future__ import annotations

from typing import Any, Protocol


class ConfigView(Protocol):
    """The fields of a `pbs.PBSConfig`, read-only (see `pbs.PBSConfig` for their meaning)."""

    @property
    def version(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def segment_size(self) -> int: ...
    @property
    def permuter(self) -> Any: ...  # a pbs.PermuterConfig: pbs.components imports this module
    @property
    def selector(self) -> Any: ...  # a pbs.SelectorConfig
    @property
    def gqa(self) -> str: ...
    @property
    def causal(self) -> bool: ...
    @property
    def backend(self) -> str: ...
    @property
    def force_sink_block(self) -> bool: ...
    @property
    def check_finite(self) -> bool | None: ...
    @property
    def dense_fallback(self) -> Any: ...  # a pbs.DenseFallback, defined beside PBSConfig
    @property
    def precision(self) -> str: ...
