"""A model's start images by name, and clients' own by digest: what a pipeline that takes start images keeps.

The pictures a model offers are encoded at load and kept for its life; a
client's own picture (``StartImage.pixels``, already cut to the frame by the
server) is encoded on first use and kept in a small LRU keyed by its digest,
so sessions that start from the same upload share one encoding. What an
encoding is (Matrix-Game's CLIP context and conditioning stream, Waypoint's
seed latent) is the model's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np

from ..runner.types import StartImage

Encoded = TypeVar("Encoded")


class EncodedStartImages(Generic[Encoded]):
    """``offered``: the model's pictures, encoded, in order (the first is the default); ``encode_client`` encodes
    a client's pixels; at most ``capacity`` clients' encodings are kept (sessions still starting from an evicted
    one keep their own reference to it)."""

    def __init__(
        self, offered: dict[str, Encoded], encode_client: Callable[[np.ndarray], Encoded], *, capacity: int, model: str
    ) -> None:
        if not offered:
            raise ValueError(f"{model} offers at least one start image")
        if capacity < 1:
            raise ValueError(f"image_cache must be at least 1, got {capacity}")
        self._offered = offered
        self._encode_client = encode_client
        self.capacity = capacity
        self._clients: OrderedDict[str, Encoded] = OrderedDict()

    @property
    def names(self) -> list[str]:
        return list(self._offered)

    @property
    def default(self) -> Encoded:
        return next(iter(self._offered.values()))

    def offered(self) -> dict[str, Encoded]:
        return dict(self._offered)

    def cached_digests(self) -> list[str]:
        return list(self._clients)

    def resolve(self, start: StartImage | None) -> Encoded:
        """The encoding of a session's start image (None: the default); a bad choice raises ValueError."""
        if start is None:
            return self.default
        if start.name is not None:
            if start.name not in self._offered:
                raise ValueError(f"unknown start image {start.name!r}; this model offers {self.names}")
            return self._offered[start.name]
        if start.pixels is None:
            raise ValueError("a start image needs a name or pixels")
        cached = self._clients.get(start.digest)
        if cached is not None:
            self._clients.move_to_end(start.digest)
            return cached
        encoded = self._encode_client(start.pixels)
        self._clients[start.digest] = encoded
        while len(self._clients) > self.capacity:
            self._clients.popitem(last=False)
        return encoded
