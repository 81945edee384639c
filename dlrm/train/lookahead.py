"""An iterator that can show its next item without handing it out.

Hotline's trainer splits the next mini-batch while the current one trains
(dlrm/train/hotline.py): it must see batch t+1 during step t, and the next step
must still receive it from the same iterator, in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Lookahead(Generic[T]):
    """``items``, in order; ``peek()`` is the next one (taken from ``items`` at most
    once, then handed out by ``next``), or None at the end."""

    def __init__(self, items: Iterable[T]) -> None:
        self._items = iter(items)
        self._next: list[T] = []  # the peeked item, if any

    def __iter__(self) -> Lookahead[T]:
        return self

    def __next__(self) -> T:
        if self._next:
            return self._next.pop()
        return next(self._items)

    def peek(self) -> T | None:
        if not self._next:
            try:
                self._next.append(next(self._items))
            except StopIteration:
                return None
        return self._next[0]
