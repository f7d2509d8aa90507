"""The demo's text: documents of bytes, packed into fixed-length rows with segment ids.

By default the documents are the top-level definitions (functions, classes and the code between
them; a long class split at its methods) of the Python standard library's own modules, read at
run time, so nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import pathlib
import random
import re
import sysconfig

import numpy as np

BOS = 256  # begins every document; the other tokens are bytes
VOCAB_SIZE = 257
_TOP_LEVEL = re.compile(rb"\n(?=(?:def|class|async def|@)\b)")
_NESTED = re.compile(rb"\n(?=[ \t]+(?:def|class|async def|@)\b)")
LONG_DOCUMENT = 8192  # bytes; a longer definition (a big class) is split at its methods


def stdlib_documents(max_bytes: int, seed: int = 0) -> list[bytes]:
    """Definitions from stdlib modules (taken in a seeded random order), ``max_bytes`` or a little more."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(root.glob("*.py"))
    random.Random(seed).shuffle(paths)
    documents, total = [], 0
    for path in paths:
        for definition in _TOP_LEVEL.split(path.read_bytes()):
            parts = _NESTED.split(definition) if len(definition) > LONG_DOCUMENT else [definition]
            for document in filter(bytes.strip, parts):
                documents.append(document)
                total += len(document)
                if total >= max_bytes:
                    return documents
    return documents


def file_documents(path: str | pathlib.Path, max_bytes: int | None = None) -> list[bytes]:
    """The paragraphs (blank-line separated) of a text file, as documents."""
    text = pathlib.Path(path).read_bytes()[:max_bytes]
    return [p for p in re.split(rb"\n\s*\n", text) if p.strip()]


@dataclasses.dataclass(frozen=True)
class Packed:
    """Rows of ``length`` tokens with the id of the document each token belongs to."""

    tokens: np.ndarray  # (rows, length) int32
    segments: np.ndarray  # (rows, length) int32

    @property
    def num_targets(self) -> int:
        """Next-token targets within a document (the ones the loss counts)."""
        return int(np.sum(self.segments[:, 1:] == self.segments[:, :-1]))


def pack(documents: list[bytes], length: int) -> Packed:
    """Concatenates ``BOS + document`` for each document and cuts the stream into rows of
    ``length`` (the tail that fills no row is dropped). A row may hold several documents."""
    tokens = np.concatenate([np.concatenate([[BOS], np.frombuffer(d, np.uint8)]) for d in documents]).astype(np.int32)
    segments = np.concatenate([np.full(len(d) + 1, i, np.int32) for i, d in enumerate(documents)])
    rows = len(tokens) // length
    if rows == 0:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than one row of {length}")
    cut = rows * length
    return Packed(tokens[:cut].reshape(rows, length), segments[:cut].reshape(rows, length))


def split(documents: list[bytes], every: int = 20) -> tuple[list[bytes], list[bytes]]:
    """(train, validation): every ``every``-th document is held out."""
    return (
        [d for i, d in enumerate(documents) if i % every],
        [d for i, d in enumerate(documents) if not i % every],
    )


def unigram_cross_entropy(train: Packed, validation: Packed) -> float:
    """Nats per target of the best context-free model: validation targets scored by the training
    targets' token frequencies (add-one smoothed). The model must beat this to have learnt anything."""

    def targets(p: Packed) -> np.ndarray:
        return p.tokens[:, 1:][p.segments[:, 1:] == p.segments[:, :-1]]

    counts = np.bincount(targets(train), minlength=VOCAB_SIZE) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-np.mean(log_p[targets(validation)]))
