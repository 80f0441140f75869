"""Weight stashing with reference-counted versions (PipeDream, as Dorylus uses it, thesis 2.5.1).

An interval's forward takes the latest weights and holds that version until its backward is
done, so the gradient is computed on the weights that produced the activations even when newer
weights were published meanwhile. A version is freed once nobody holds it and it is not the
latest.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch


class WeightStash:
    """Versions of a parameter dict, each kept while an interval holds it.

    Args:
        params: the initial parameters (version 0); they are copied.

    Example:
        >>> stash = WeightStash({"w": torch.zeros(2)})
        >>> version, w = stash.acquire()
        >>> stash.publish({"w": torch.ones(2)})
        1
        >>> stash.get(version)["w"].tolist(), sorted(stash.live())
        ([0.0, 0.0], [0, 1])
        >>> stash.release(version); sorted(stash.live())
        [1]
    """

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._refs: dict[int, int] = {}
        self._latest = -1
        self._lock = threading.Lock()
        self.publish(params)

    @property
    def latest(self) -> int:
        return self._latest

    def publish(self, params: Mapping[str, torch.Tensor]) -> int:
        """Make a copy of ``params`` the latest version; returns its number."""
        frozen = {name: p.detach().clone() for name, p in params.items()}
        with self._lock:
            previous = self._latest
            self._latest += 1
            self._versions[self._latest] = frozen
            self._refs[self._latest] = 0
            self._free_if_unused(previous)
            return self._latest

    def acquire(self) -> tuple[int, dict[str, torch.Tensor]]:
        """Hold the latest version (the forward's weights); returns ``(version, params)``."""
        with self._lock:
            self._refs[self._latest] += 1
            return self._latest, self._versions[self._latest]

    def get(self, version: int) -> dict[str, torch.Tensor]:
        """A held version's parameters (the backward's weights)."""
        with self._lock:
            if self._refs.get(version, 0) < 1:
                raise RuntimeError(f"weight version {version} is not held by anyone")
            return self._versions[version]

    def release(self, version: int) -> None:
        with self._lock:
            self._refs[version] -= 1
            self._free_if_unused(version)

    def live(self) -> dict[int, int]:
        """Version -> reference count of every version still stored."""
        with self._lock:
            return dict(self._refs)

    def _free_if_unused(self, version: int) -> None:
        if version in self._refs and self._refs[version] == 0 and version != self._latest:
            del self._refs[version], self._versions[version]
