"""``Registry``: the one type behind every extension point that is a set of named, typed objects (the
algorithms, the accountants, the data sets). Adding one is one ``register`` call in its own module."""

from __future__ import annotations

from typing import Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(dict, Generic[T]):
    """A ``dict`` name -> object (iteration in registration order) whose entries come through
    ``register``: once per name, never replaced. ``what`` names an entry in messages ("an accountant");
    ``parameter`` is the API parameter that picks one, named by ``lookup``'s refusal."""

    def __init__(self, what: str, parameter: str) -> None:
        super().__init__()
        self.what, self.parameter = what, parameter

    def register(self, item: T) -> T:
        """Add ``item`` under its ``name`` (a name is registered once)."""
        name = getattr(item, "name", None)
        if not name or not isinstance(name, str) or name in self:
            raise ConfigError(f"{self.what} needs a name not yet registered, got {name!r}")
        self[name] = item
        return item

    def lookup(self, name: str) -> T:
        """The entry registered as ``name``, else a ConfigError that lists them."""
        if not isinstance(name, str) or name not in self:
            raise ConfigError(f"`{self.parameter}` must be one of {', '.join(self)}, got {name!r}")
        return self[name]
