"""Checks shared by the config groups: each raises ``ValueError`` naming the option."""

from __future__ import annotations

import msgspec


def require(ok: bool, option: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{option} {message}")


def positive(group: msgspec.Struct, *options: str) -> None:
    for option in options:
        value = getattr(group, option)
        require(value is None or value >= 1, option, f"must be a positive integer, got {value}")


def one_of(value: str, choices: tuple[str, ...], option: str) -> None:
    require(value in choices, option, f"must be one of {', '.join(choices)}, got {value!r}")
