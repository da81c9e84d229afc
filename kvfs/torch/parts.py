"""Attributes an owner shows that belong to one of its parts.

``TieredCache`` and ``KVRouter`` hold named parts, each with its own state; the names
they always showed (``cache.refills``, ``router.hot_total``, ...) stay, read from the part
that owns the value: ``refills = Shown[int]("moves", "refills")`` reads
``cache.moves.refills``. Read only: only the part changes its state.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, cast, overload

T = TypeVar("T")


class Shown(Generic[T]):
    """A read-only attribute that is ``getattr(getattr(owner, part), name)``."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Shown[T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: Any, owner: type | None = None) -> T | Shown[T]:
        if obj is None:  # on the class: the descriptor itself (introspection, docs)
            return self
        return cast(T, getattr(getattr(obj, self.part), self.name))
