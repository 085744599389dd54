"""Registries that map component names to their config classes.

Users see config objects (``"last_block"``, ``{"name": "mean_pool", "threshold": 0.9}``); the
registry turns a name into its config class. The reference implementation is the config class's
own method; GPU planners register against the same name in the dispatch layer
(`pbs.backends.register_planner`), so a config never changes when the backend does.

Third-party packages register components by exposing an entry point in the ``pbs.plugins`` group
that points at a module (or callable) which calls `register_permuter` /
`register_selector`. Plugins load the first time a registry is asked for a name it lacks or
for its list of names.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "pbs.plugins"

C = TypeVar("C", bound=BaseModel)

_plugins_loaded = False


def load_plugins() -> list[str]:
    """Imports every ``pbs.plugins`` entry point once; returns the names of those loaded now."""
    global _plugins_loaded
    if _plugins_loaded:
        return []
    _plugins_loaded = True
    loaded = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as exc:  # a broken plugin must not break pbs itself
            logger.warning("pbs: could not load plugin %r (%s): %s", ep.name, ep.value, exc)
            continue
        if callable(obj) and not isinstance(obj, type):
            obj()
        loaded.append(ep.name)
    return loaded


class Registry(Generic[C]):
    """Name -> config class, for one kind of component."""

    def __init__(self, kind: str, base: type[C]):
        self.kind = kind
        self.base = base
        self._classes: dict[str, type[C]] = {}

    def register(self, cls: type[C] | None = None, *, overwrite: bool = False) -> Any:
        """Class decorator: registers a config class under the default of its ``name`` field."""

        def decorator(cls: type[C]) -> type[C]:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"register_{self.kind} expects a subclass of {self.base.__name__}, got {cls!r}")
            field = cls.model_fields.get("name")
            name = field.default if field is not None else None
            if not isinstance(name, str) or not name:
                raise TypeError(
                    f"{cls.__name__} must declare a default for its `name` field, "
                    f'e.g. name: Literal["my_{self.kind}"] = "my_{self.kind}"'
                )
            existing = self._classes.get(name)
            if existing is not None and existing is not cls and not overwrite:
                same_name = existing.__qualname__ == cls.__qualname__ and existing.__module__ == cls.__module__
                if same_name and "<locals>" not in cls.__qualname__:
                    pass  # the same class re-executed (module reload): take the new definition
                else:
                    raise ValueError(
                        f"a {self.kind} named {name!r} is already registered ({existing.__module__}."
                        f"{existing.__qualname__}, a different class object); pass overwrite=True "
                        "to replace it"
                    )
            self._classes[name] = cls
            return cls

        return decorator(cls) if cls is not None else decorator

    def unregister(self, name: str) -> None:
        """Removes a component (mainly for tests)."""
        self._classes.pop(name, None)

    def names(self) -> list[str]:
        """Registered names, sorted (loads plugins first)."""
        load_plugins()
        return sorted(self._classes)

    def get(self, name: str) -> type[C]:
        """The config class registered under ``name``; the error lists every registered name."""
        if name not in self._classes:
            load_plugins()
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; registered {self.kind}s: {', '.join(sorted(self._classes))}"
            ) from None

    def parse(self, value: Any) -> C:
        """Turns a name, a dict with a ``name`` key, or a config instance into a config instance."""
        if isinstance(value, self.base):
            return value
        if isinstance(value, str):
            return self.get(value)()
        if isinstance(value, Mapping):
            if "name" not in value:
                raise ValueError(
                    f"a {self.kind} given as a dict needs a 'name' key; registered {self.kind}s: "
                    f"{', '.join(self.names())}"
                )
            return self.get(value["name"]).model_validate(dict(value))
        raise TypeError(
            f"a {self.kind} must be a name (str), a dict with a 'name' key or a {self.base.__name__} "
            f"instance, got {type(value).__name__}"
        )
