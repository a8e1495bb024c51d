"""``Uncopyable``: the base of every object that ``copy.deepcopy`` and ``pickle`` must not copy."""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["Uncopyable"]


class Uncopyable:
    """An object that holds what a copy cannot (a connection to tiermemd, a place in a process group, a model's
    params kept elsewhere): ``copy.deepcopy`` and pickling raise the subclass's ``TypeError``
    (``_not_copyable``), which names what to copy or save instead."""

    __slots__ = ()

    def _not_copyable(self) -> TypeError:
        return TypeError(f"{type(self).__name__} cannot be copied or pickled")

    def __deepcopy__(self, memo: dict[int, Any]) -> NoReturn:
        raise self._not_copyable()

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise self._not_copyable()
