"""The texts of ``pbs quality``: fixed tuning and held-out sets, and the token sequences built from them.

Every text ships with CPython itself (3.10 and later), so the report needs no download:

* ``stdlib:<path>``: a module's source file under the standard-library directory
  (``sysconfig.get_paths()["stdlib"]``), e.g. ``stdlib:argparse.py``;
* ``topic:<name>``: a section of the language reference as ``pydoc`` ships it
  (``pydoc_data.topics.topics[name]``), i.e. English prose with a few code examples;
* ``<id>+<id>``: several of those joined into one document (one newline between them), for
  documents longer than any one held-out text.

The texts are split into two fixed sets, so that a method can be tuned on one and judged on the
other (`TEXT_SETS`). Each set has long **documents** (next-token loss at several lengths) and
**copy probes**: a prose passage, filler from an unrelated source file, then the passage again.

The files differ between Python versions, so the report records the Python version and a SHA-256
of every text it read; numbers are comparable only between runs with the same hashes.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

TextSetName = Literal["tuning", "heldout", "heldout-long"]
TEXT_SET_CHOICES = ("tuning", "heldout", "heldout-long", "all")


@dataclass(frozen=True)
class CopySource:
    """A copy probe's two texts: the passage that is repeated and the filler between the copies."""

    passage: str
    filler: str


@dataclass(frozen=True)
class TextSet:
    """One fixed set of texts (source ids, see the module docstring)."""

    name: TextSetName
    documents: tuple[str, ...]
    copies: tuple[CopySource, ...]

    def sources(self) -> list[str]:
        """Every source id of the set, each once, in order."""
        ids: list[str] = list(self.documents)
        for copy in self.copies:
            ids += [copy.passage, copy.filler]
        return list(dict.fromkeys(ids))


# The two sets never share a text. Documents are at least 8192 tokens long with SmolLM2's
# tokenizer on CPython 3.11 (the shortest, topic:compound, has 12.3K); passages are prose, fillers
# code, so a passage cannot be predicted from its filler.
TUNING = TextSet(
    name="tuning",
    documents=("stdlib:argparse.py", "stdlib:subprocess.py", "topic:compound"),
    copies=(CopySource(passage="topic:types", filler="stdlib:tarfile.py"),),
)
HELDOUT = TextSet(
    name="heldout",
    documents=("stdlib:typing.py", "stdlib:difflib.py", "topic:specialnames"),
    copies=(CopySource(passage="topic:formatstrings", filler="stdlib:inspect.py"),),
)
# Held out too, for the lengths where the defaults run sparse (``dense_fallback.min_seq_len``
# 32768): documents of at least 32768 tokens under Gemma 3's tokenizer on CPython 3.11. The first
# is the held-out set's first two documents joined (typing.py alone has 31.7K tokens; joined 54.5K),
# the second a standard-library file in no other set (turtle.py, 39.5K). The copy probe is the
# held-out one, whose filler (inspect.py, 31.0K tokens) allows up to ~30K tokens between the copies.
HELDOUT_LONG = TextSet(
    name="heldout-long",
    documents=("stdlib:typing.py+stdlib:difflib.py", "stdlib:turtle.py"),
    copies=(CopySource(passage="topic:formatstrings", filler="stdlib:inspect.py"),),
)
TEXT_SETS: dict[str, TextSet] = {"tuning": TUNING, "heldout": HELDOUT, "heldout-long": HELDOUT_LONG}


def text_sets(selection: str) -> list[TextSet]:
    """The sets that ``--texts`` names: ``"tuning"``, ``"heldout"``, ``"heldout-long"`` or ``"all"``
    (``tuning`` and ``heldout``; the long set is asked for by name)."""
    if selection == "all":
        return [TUNING, HELDOUT]
    if selection not in TEXT_SETS:
        raise ValueError(f"texts must be one of {TEXT_SET_CHOICES}, got {selection!r}")
    return [TEXT_SETS[selection]]


def read_text(source: str) -> str:
    """The text of a source id (``stdlib:<path>``, ``topic:<name>``, or several joined by ``+``).

    Raises:
        FileNotFoundError / KeyError: this Python has no such file or topic (a trimmed install).
        ValueError: an unknown kind of source.
    """
    if "+" in source:
        return "\n".join(read_text(part) for part in source.split("+"))
    kind, _, name = source.partition(":")
    if kind == "stdlib":
        path = Path(sysconfig.get_paths()["stdlib"]) / name
        if not path.is_file():
            raise FileNotFoundError(f"text {source!r}: no file {path} in this Python's standard library")
        return path.read_text(encoding="utf-8")
    if kind == "topic":
        try:
            from pydoc_data.topics import topics
        except ImportError as exc:  # a distribution that strips pydoc_data
            raise FileNotFoundError(f"text {source!r}: this Python has no pydoc_data package") from exc
        if name not in topics:
            raise KeyError(f"text {source!r}: pydoc_data.topics has no topic {name!r}")
        return topics[name]
    raise ValueError(f"text {source!r}: the source kind must be 'stdlib' or 'topic', got {kind!r}")


def text_digest(text: str) -> str:
    """SHA-256 of the UTF-8 text, the first 16 hex digits (written to the report)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class Sample:
    """One token sequence the model reads, and which of its next-token losses count.

    ``losses[j]`` below is the loss of predicting token ``j + 1`` from tokens ``0..j``, so a span
    ``(start, end)`` of *tokens* is scored by the losses ``start - 1 .. end - 2``.

    Attributes:
        name: unique, e.g. ``"heldout doc stdlib:typing.py 4096"``.
        text_set: ``"tuning"`` or ``"heldout"`` (or any label for custom samples).
        kind: ``"document"`` (score every token but the first) or ``"copy"``.
        input_ids: ``(N,)`` int64.
        sources: the source ids the tokens came from.
        first_span: for a copy probe, the token span ``[start, end)`` of the first passage.
        copy_span: for a copy probe, the token span of the repeated passage.
        filler: for a copy probe, the number of filler tokens between the copies.
    """

    name: str
    text_set: str
    kind: Literal["document", "copy"]
    input_ids: torch.Tensor
    sources: tuple[str, ...]
    first_span: tuple[int, int] | None = None
    copy_span: tuple[int, int] | None = None
    filler: int | None = None

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    def describe(self) -> dict:
        """JSON-ready description (no token ids)."""
        info = {"name": self.name, "set": self.text_set, "kind": self.kind, "tokens": self.length,
                "sources": list(self.sources)}
        if self.kind == "copy":
            info.update(first_span=list(self.first_span), copy_span=list(self.copy_span), filler=self.filler)
        return info


def span_loss(losses: torch.Tensor, span: tuple[int, int]) -> float:
    """Mean next-token loss over the tokens ``[start, end)`` (``start >= 1``) of a sequence.

    Args:
        losses: ``(N - 1,)``, ``losses[j]`` the loss of token ``j + 1``.
        span: token positions; token 0 has no prediction, so ``start`` must be at least 1.
    """
    start, end = span
    if not 1 <= start < end <= losses.shape[0] + 1:
        raise ValueError(f"span {span} does not fit a sequence of {losses.shape[0] + 1} tokens (start >= 1)")
    return float(losses[start - 1 : end - 1].double().mean())


def document_sample(name: str, text_set: str, ids: torch.Tensor, length: int, source: str = "") -> Sample:
    """The first ``length`` tokens of a document."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.shape[0] < length:
        raise ValueError(f"{name}: the text has {ids.shape[0]} tokens, fewer than the {length} asked for")
    return Sample(name=name, text_set=text_set, kind="document", input_ids=ids[:length].clone(), sources=(source,))


def copy_sample(
    name: str,
    text_set: str,
    passage_ids: torch.Tensor,
    filler_ids: torch.Tensor,
    *,
    passage_tokens: int,
    filler_tokens: int,
    sources: tuple[str, str] = ("", ""),
) -> Sample:
    """``passage[:passage_tokens] + filler[:filler_tokens] + passage[:passage_tokens]``.

    The loss of the probe is measured on the second passage only (`Sample.copy_span`); the
    first passage's own loss (`Sample.first_span`, its first token excepted) says how hard the
    passage is to predict without a copy to read.
    """
    passage_ids = torch.as_tensor(passage_ids, dtype=torch.long).flatten()
    filler_ids = torch.as_tensor(filler_ids, dtype=torch.long).flatten()
    if passage_tokens < 2:
        raise ValueError(f"passage_tokens must be at least 2, got {passage_tokens}")
    if passage_ids.shape[0] < passage_tokens:
        raise ValueError(f"{name}: the passage has {passage_ids.shape[0]} tokens, fewer than {passage_tokens}")
    if filler_ids.shape[0] < filler_tokens:
        raise ValueError(f"{name}: the filler has {filler_ids.shape[0]} tokens, fewer than {filler_tokens}")
    a = passage_ids[:passage_tokens]
    ids = torch.cat([a, filler_ids[:filler_tokens], a])
    start = passage_tokens + filler_tokens
    return Sample(
        name=name, text_set=text_set, kind="copy", input_ids=ids, sources=sources,
        first_span=(1, passage_tokens), copy_span=(start, start + passage_tokens), filler=filler_tokens,
    )


@dataclass
class TextLibrary:
    """Reads and tokenizes source texts once each, and remembers their digests for the report."""

    tokenize: Callable[[str], Sequence[int]]
    digests: dict[str, str] = field(default_factory=dict)
    token_counts: dict[str, int] = field(default_factory=dict)
    _ids: dict[str, torch.Tensor] = field(default_factory=dict)

    def ids(self, source: str) -> torch.Tensor:
        if source not in self._ids:
            text = read_text(source)
            ids = torch.tensor(list(self.tokenize(text)), dtype=torch.long)
            self._ids[source] = ids
            self.digests[source] = text_digest(text)
            self.token_counts[source] = int(ids.shape[0])
        return self._ids[source]


def build_samples(
    sets: Sequence[TextSet],
    library: TextLibrary,
    *,
    lengths: Sequence[int] = (4096, 8192),
    fillers: Sequence[int] = (1000, 3000, 5000),
    passage_tokens: int = 1000,
) -> list[Sample]:
    """Every document at every length and every copy probe at every filler length, set by set."""
    samples: list[Sample] = []
    for text_set in sets:
        for source in text_set.documents:
            ids = library.ids(source)
            for length in lengths:
                name = f"{text_set.name} doc {source} {length}"
                samples.append(document_sample(name, text_set.name, ids, length, source))
        for copy in text_set.copies:
            passage, filler = library.ids(copy.passage), library.ids(copy.filler)
            for filler_tokens in fillers:
                name = f"{text_set.name} copy {copy.passage} / {copy.filler} {filler_tokens}"
                samples.append(copy_sample(
                    name, text_set.name, passage, filler, passage_tokens=passage_tokens,
                    filler_tokens=filler_tokens, sources=(copy.passage, copy.filler),
                ))
    return samples
