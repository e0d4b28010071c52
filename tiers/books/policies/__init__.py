"""Eviction policies of an offload tier, registered by name (``eviction_policy`` in the config).

``lru`` and ``arc`` are built in; ``register_policy`` adds another (an ``EvictionPolicy``
subclass) under a new name.
"""

from __future__ import annotations

from collections.abc import Mapping

from shoal.tiers.books.keys import OffloadKey
from shoal.tiers.books.policies.arc import ARCPolicy
from shoal.tiers.books.policies.base import NOT_READY, Chunk, EvictionPolicy
from shoal.tiers.books.policies.lru import LRUPolicy

_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def register_policy(name: str, policy: type[EvictionPolicy]) -> None:
    """Make ``policy`` available as ``eviction_policy=name``; a name is registered once."""
    if name in _POLICIES:
        raise ValueError(f"eviction policy {name!r} is already registered")
    if not (isinstance(policy, type) and issubclass(policy, EvictionPolicy)):
        raise TypeError(f"eviction policy {name!r} must subclass EvictionPolicy, got {policy!r}")
    _POLICIES[name] = policy


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def make_policy(name: str, capacity: int, chunks: Mapping[OffloadKey, Chunk]) -> EvictionPolicy:
    """The policy registered as ``name``; an unknown name is a clear error."""
    try:
        policy = _POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction_policy {name!r}; known: {', '.join(policy_names())}"
        ) from None
    return policy(capacity, chunks)


__all__ = [
    "NOT_READY",
    "ARCPolicy",
    "Chunk",
    "EvictionPolicy",
    "LRUPolicy",
    "make_policy",
    "policy_names",
    "register_policy",
]
