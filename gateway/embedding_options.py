"""What a pooling server's ``/v1/embeddings`` allows (``--runner pooling``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EmbeddingOptions:
    matryoshka: bool = False  # ``dimensions`` may shorten the embeddings (trained for it)
