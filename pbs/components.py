"""Base classes of the two pluggable components, permuters and selectors, and their registries.

A component is a frozen pydantic config whose ``name`` field (a ``Literal`` with a default) is its
registry key and whose method is the pure-PyTorch reference implementation:

* a **permuter** returns the segmented permutations of keys and queries
  (`PermuterConfig.permute`);
* a **selector** returns the key blocks each query block should compute
  (`SelectorConfig.select`); forced blocks (sink, on-diagonal segment) and the causal limit
  are applied afterwards by `pbs.planning.finalize_selection`, so a selector never has to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from pbs.config_view import ConfigView
from pbs.layout import Layout
from pbs.registry import Registry
from pbs.types import PagedTensor, Permutation


def name_valid_fields(model: type[BaseModel], data: Any, handler: Any) -> Any:
    """Body of a ``model_validator(mode="wrap")``: an unknown field's error (pydantic's
    ``extra_forbidden``, "Extra inputs are not permitted") names the fields that exist."""
    try:
        return handler(data)
    except ValidationError as exc:
        errors = exc.errors()
        if not any(e["type"] == "extra_forbidden" and len(e["loc"]) == 1 for e in errors):
            raise
        valid = ", ".join(model.model_fields)
        details: list[Any] = []
        for e in errors:
            detail: dict[str, Any] = {"type": e["type"], "loc": e["loc"], "input": e["input"]}
            if "ctx" in e:
                detail["ctx"] = e["ctx"]
            if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
                detail["type"] = PydanticCustomError(
                    "extra_forbidden",
                    "unknown field '{field}' of {model}; valid fields: {valid}",
                    {"field": e["loc"][0], "model": model.__name__, "valid": valid},
                )
                detail.pop("ctx", None)
            elif e["type"] == "extra_forbidden":  # a nested model's, already worded: keep its message
                detail["type"] = PydanticCustomError("extra_forbidden", "{message}", {"message": e["msg"]})
                detail.pop("ctx", None)
            details.append(detail)
        raise ValidationError.from_exception_data(exc.title, details) from None


class ComponentConfig(BaseModel):
    """Common base: frozen, no unknown fields, a ``name`` that the registry knows."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str

    @model_validator(mode="wrap")
    @classmethod
    def _name_valid_fields(cls, data: Any, handler: Any) -> Any:
        return name_valid_fields(cls, data, handler)

    def check_compatible(self, config: ConfigView) -> None:
        """Raises ``ValueError`` if this component cannot run with ``config`` (e.g. a stride that
        does not divide the block size). The default accepts everything."""


@dataclass(frozen=True)
class PermutationInputs:
    """What a permuter sees.

    Attributes:
        q: ``(B, Hq, Nq, D)`` queries in original order.
        k: ``(B, Hkv, Nk, D)`` keys in original order.
        layout: geometry of the call.
        gqa: ``"per_head"`` (one key order per query head) or ``"shared"`` (one per KV head).
        scale: softmax scale.
    """

    q: torch.Tensor
    k: torch.Tensor
    layout: Layout
    gqa: str
    scale: float

    @property
    def key_heads(self) -> int:
        """Heads of the key permutation: ``Hq`` in per-head mode, ``Hkv`` in shared mode."""
        return self.layout.heads_q if self.gqa == "per_head" else self.layout.heads_kv


class Permutations(NamedTuple):
    """A permuter's result; ``None`` means that axis is not permuted."""

    keys: Permutation | None
    queries: Permutation | None = None


class PermuterConfig(ComponentConfig):
    """Base of permuter configs; subclasses implement `permute`.

    Attributes:
        segmented: class-level flag. True (every permuter but ``none``): tokens are permuted inside
            segments, so each query block's whole on-diagonal segment is forced and left out of
            the selectors' softmax. False: no segmented permutation at all; the Layout then has
            one-block segments (see `pbs.layout.Layout`).
    """

    segmented: ClassVar[bool] = True

    def permute(self, inputs: PermutationInputs) -> Permutations:
        """Reference implementation: the segmented key (``(B, Hk, Nk)``) and query permutations."""
        raise NotImplementedError(f"{type(self).__name__} does not implement permute()")


@dataclass(frozen=True)
class SequenceSummaries:
    """Selection inputs of a whole sequence, given to a call that plans only a part of its queries.

    Context parallelism (`pbs.distributed`) plans each rank's query chunk as a cached-prefix call
    (``Nq < Nk``) before the rank holds the keys of the others. Selectors whose scores read the
    whole sequence take these instead of computing them from the call's own tensors, so the chunk
    selects the rows one process would select for the whole sequence. A selector that finds None
    computes the value itself.

    Attributes:
        key_block_means: ``(B, Hk, Tk_seq, D)`` float32 means of the permuted key blocks of the whole
            sequence (``Tk_seq >= Tk`` of the call; the call reads its first ``Tk``): ``mean_pool``'s
            pooled keys.
        line_scores: ``(2, B, Hq, N_seq)`` float32 vertical and slash scores of the sequence's last
            rows over all ``N_seq >= Nk`` key positions and offsets (the layout of
            `pbs.kernels.vertical_slash.line_scores`): ``vertical_slash``'s lines, kept by its
            thresholds over the whole sequence before the call keeps its own ``Nk``.
        key_permutation: the whole sequence's key permutation, ``(B, Hk, N_seq)``, made where the
            keys are; a call planning the first ``Nk`` keys (a whole number of segments, or all of
            them) takes its first ``Nk`` slots instead of running its permuter.
    """

    key_block_means: torch.Tensor | None = None
    line_scores: torch.Tensor | None = None
    key_permutation: Permutation | None = None


READS_PREFIX_KEYS = "prefix_keys"
"""A `SelectorConfig.sequence_summaries` entry that is no summary: the selector reads the call's own
keys, every one of the prefix (antidiagonal scoring), so context parallelism plans its chunks once
the keys of every rank are gathered instead of while they travel."""


class SelectionInputs:
    """What a selector sees: permuted tensors plus where every slot came from.

    Attributes:
        q: ``(B, Hq, Nq, D)`` queries in permuted order.
        k: ``(B, Hk, Nk, D)`` keys in permuted order (``Hk`` is ``Hq`` or ``Hkv``); gathered on
            first use when only ``source_k`` and ``key_permutation`` were given.
        layout: geometry of the call.
        query_positions: ``(B, Hq, Nq)`` original position of each query slot.
        key_positions: ``(B, Hk, Nk)`` original position of each key slot.
        scale: softmax scale.
        source_k: ``(B, Hkv, Nk, D)`` keys in original order, when known: fast selectors read them
            through ``key_positions`` instead of gathering a permuted copy.
        key_permutation: the key `Permutation` (needed to gather ``k`` lazily).
        force_sink_block: whether the selection must keep the block holding position 0 (selectors
            that return a finished `BlockMask` apply it themselves).
        summaries: whole-sequence inputs when the call plans part of a sequence
            (`SequenceSummaries`), else None.
        paged_k: the keys in a paged cache (`pbs.types.PagedTensor`, original order, identity
            key permutation) when the call reads pages: the GPU planners that can read pages read
            them in place; for every other reader, ``k`` and ``source_k`` are the pages gathered
            into one ``(1, Hkv, Nk, D)`` tensor on first use.
    """

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        layout: Layout,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        scale: float,
        *,
        source_k: torch.Tensor | None = None,
        key_permutation: Permutation | None = None,
        force_sink_block: bool = True,
        summaries: SequenceSummaries | None = None,
        paged_k: PagedTensor | None = None,
    ):
        if k is None and paged_k is None and (source_k is None or key_permutation is None):
            raise ValueError("SelectionInputs needs the permuted keys k, or source_k and key_permutation, or paged_k")
        self.q = q
        self._k = k
        self.layout = layout
        self.query_positions = query_positions
        self.key_positions = key_positions
        self.scale = scale
        self._source_k = source_k
        self.key_permutation = key_permutation
        self.force_sink_block = force_sink_block
        self.summaries = summaries
        self.paged_k = paged_k

    @property
    def k(self) -> torch.Tensor:
        if self._k is None:
            if self.paged_k is not None:
                self._k = self.paged_k.gather()  # a paged call's key permutation is the identity
            else:
                assert self.key_permutation is not None
                self._k = self.key_permutation.apply(self.source_k)
        return self._k

    @property
    def source_k(self) -> torch.Tensor | None:
        if self._source_k is None and self.paged_k is not None:
            return self.k
        return self._source_k

    @source_k.setter
    def source_k(self, value: torch.Tensor | None) -> None:
        self._source_k = value

    @property
    def has_permuted_k(self) -> bool:
        """Whether the permuted keys exist already (reading ``k`` costs nothing)."""
        return self._k is not None

    def allowed_blocks(self) -> torch.Tensor:
        """``(Tq, Tk)`` bool: blocks not wholly in the future."""
        return self.layout.allowed_blocks(self.q.device)

    def candidate_blocks(self) -> torch.Tensor:
        """``(Tq, Tk)`` bool: the blocks a score-based selector ranks (Algorithm 2's ``C``): the
        allowed blocks minus the forced on-diagonal segment, or every allowed block when the
        layout is unsegmented. See `pbs.layout.Layout.candidate_blocks`."""
        return self.layout.candidate_blocks(self.q.device)


class SelectorConfig(ComponentConfig):
    """Base of selector configs; subclasses implement `select`.

    A selector names the field that trades density for quality in `knob` (``threshold``,
    ``coverage``, ``density``...): sweeps vary it, the demo's ``--threshold`` sets it, and, when it
    is a share of the attention mass (`knob_is_mass_share`), the dense policy's density probe
    covers the same share (`mass_share`).
    """

    knob: ClassVar[str | None] = None
    """The field that trades density for quality, or None (no single field does)."""
    knob_is_mass_share: ClassVar[bool] = True
    """Whether `knob` is a share of each row's attention mass to keep (``threshold``,
    ``coverage``) rather than a density of its own (``budget``'s ``density``)."""
    sequence_summaries: ClassVar[frozenset[str] | None] = None
    """The `SequenceSummaries` fields the selector reads when it plans a chunk of a sequence split
    over ranks (context parallelism), and `READS_PREFIX_KEYS` when it reads the chunk's keys
    themselves: ``frozenset()`` when it reads none, None when it cannot plan a chunk from
    whole-sequence summaries (context parallelism then refuses it)."""

    def summaries_needed(self) -> frozenset[str] | None:
        """`sequence_summaries` of this selector (a selector made of members: of all of them)."""
        return self.sequence_summaries

    def knob_value(self) -> float | None:
        """The value of `knob`, or None when there is none."""
        return None if self.knob is None else float(getattr(self, self.knob))

    def with_knob(self, value: float) -> "SelectorConfig":
        """A copy with `knob` set to ``value`` (validated); a ValueError when there is no knob."""
        if self.knob is None:
            raise ValueError(f"selector {self.name!r} has no single field that trades density for quality (knob)")
        return type(self).model_validate({**self.model_dump(), self.knob: value})

    def mass_share(self) -> float | None:
        """The share of each row's attention mass this selection keeps at least: what the dense
        policy's density probe covers before planning (None: the probe does not run). A selector
        made of members answers for them (`union`: the largest member's share)."""
        return self.knob_value() if self.knob_is_mass_share else None

    def select(self, inputs: SelectionInputs) -> torch.Tensor:
        """Reference implementation: ``(B, Hq, Tq, Tk)`` bool of the key blocks to compute.

        Blocks outside `SelectionInputs.allowed_blocks` are dropped and forced blocks (the
        sink and the on-diagonal segment) added afterwards, so the result may ignore both. A
        score-based selector ranks only `SelectionInputs.candidate_blocks`.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement select()")


permuter_registry: Registry[PermuterConfig] = Registry("permuter", PermuterConfig)
selector_registry: Registry[SelectorConfig] = Registry("selector", SelectorConfig)

register_permuter = permuter_registry.register
register_selector = selector_registry.register


def list_permuters() -> list[str]:
    """Names of every registered permuter."""
    return permuter_registry.names()


def list_selectors() -> list[str]:
    """Names of every registered selector."""
    return selector_registry.names()
