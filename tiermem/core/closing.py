"""``Closing``: the base of every resource that is a context manager closing itself on exit."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

__all__ = ["Closing"]

T = TypeVar("T", bound="Closing")


class Closing:
    """``with Resource(...) as r:`` closes ``r`` on the way out, whatever raised; ``close()`` is the
    subclass's (idempotent, as each of ours is)."""

    if TYPE_CHECKING:

        def close(self) -> None: ...

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
