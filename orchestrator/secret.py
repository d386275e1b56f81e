"""Secrets are values whose str() is '***', so they cannot leak into plans, logs or exceptions."""

from __future__ import annotations


class Secret:
    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __str__(self) -> str:
        return "***"

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Secret", self._value))

    def __bool__(self) -> bool:
        return bool(self._value)


def reveal(value: object) -> str:
    return value.reveal() if isinstance(value, Secret) else str(value)
