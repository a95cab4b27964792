"""Name -> builder tables, so that configs choose towers, plans and datasets by name.

The lowest floor that registers by name (sharding plans) holds the base; dense/ (towers) and
trainer/ (datasets) use it from here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Builders (or specs of them) registered under names; `option` is the config key that picks one."""

    def __init__(self, option: str):
        self.option = option
        self._builders: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make the builder selectable as `option = name`."""
        def wrap(fn: T) -> T:
            assert name not in self._builders, f"{self.option}: {name!r} registered twice"
            self._builders[name] = fn
            return fn
        return wrap

    def get(self, name: str) -> T:
        """The builder for `name`; an unknown name is a ValueError listing the known ones."""
        if name not in self._builders:
            raise ValueError(f"{self.option}={name!r} is not one of {sorted(self._builders)}")
        return self._builders[name]

    def names(self) -> list[str]:
        return sorted(self._builders)
