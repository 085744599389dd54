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
from collections.abc import Mapping
from typing import Annotated, Any, Generic, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError

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
            _check_name_reads_back(cls, field, name)
            existing = self._classes.get(name)
            if existing is not None and existing is not cls and not overwrite:
                if _same_definition(existing, cls):
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
        if not isinstance(name, str):
            raise TypeError(
                f"a {self.kind}'s 'name' must be the name (a str) of a registered {self.kind}, got "
                f"{type(name).__name__} {name!r}; registered {self.kind}s: {', '.join(self.names())}"
            )
        if name not in self._classes:
            load_plugins()
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; registered {self.kind}s: {', '.join(sorted(self._classes))}"
            ) from None

    def parse(self, value: Any) -> C:
        """Turns a name, a dict with a ``name`` key, or a config instance into a config instance.

        An instance is taken only if its class is the one registered under its name: the config's
        JSON holds the name alone, so any other class (an unregistered subclass) would read back
        as the registered one and behave differently.
        """
        if isinstance(value, self.base):
            self._check_registered_class(value)
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
            f"instance, got {type(value).__name__} {value!r}; registered {self.kind}s: {', '.join(self.names())}"
        )

    def _check_registered_class(self, value: C) -> None:
        cls, name = type(value), getattr(value, "name", None)
        registered = self._classes.get(name) if isinstance(name, str) else None
        if registered is None and isinstance(name, str):
            load_plugins()
            registered = self._classes.get(name)
        if registered is cls or (registered is not None and _same_definition(registered, cls)):
            return
        registered_as = [n for n, c in self._classes.items() if c is cls]
        if registered is None and registered_as:
            raise TypeError(
                f"{cls.__name__} is registered as {self.kind} {registered_as[0]!r}, but this instance "
                f"names {name!r}, so its JSON would not read back; use name={registered_as[0]!r}"
            )
        if registered is None:
            raise TypeError(
                f"{cls.__name__} instance names {self.kind} {name!r}, which is not registered; "
                f"register the class with pbs.register_{self.kind} (registered {self.kind}s: "
                f"{', '.join(self.names())})"
            )
        raise TypeError(
            f"{cls.__module__}.{cls.__qualname__} is not the class registered as {self.kind} {name!r} "
            f"({registered.__module__}.{registered.__qualname__}): its JSON would name {name!r} and read "
            f"back as {registered.__name__}. Register the subclass under a name of its own "
            f'(name: Literal["my_{self.kind}"] = "my_{self.kind}", then pbs.register_{self.kind}), or '
            f"use {registered.__name__}"
        )


def _same_definition(a: type, b: type) -> bool:
    """The same class statement executed again (a module reload), not a class from a factory."""
    return a.__qualname__ == b.__qualname__ and a.__module__ == b.__module__ and "<locals>" not in a.__qualname__


def _check_name_reads_back(cls: type[BaseModel], field: Any, name: str) -> None:
    """Refuses a class whose default ``name`` its own ``name`` field does not accept.

    pydantic does not validate defaults, so ``name: Literal["a"] = "b"`` builds configs that run
    but whose JSON (``{"name": "b"}``) does not validate as the class again.
    """
    annotation = field.annotation
    if get_origin(annotation) is Literal and not field.metadata:
        accepted = name in get_args(annotation)  # the usual case, without building a validator
    else:
        typ = Annotated[(annotation, *field.metadata)] if field.metadata else annotation
        try:
            accepted = TypeAdapter(typ).validate_python(name) == name
        except ValidationError:
            accepted = False
    if not accepted:
        raise TypeError(
            f"{cls.__name__} is registered under its default name {name!r}, which its own `name` "
            f"field ({_annotation_text(annotation)}) does not accept, so its configs would not "
            f'read back from JSON; declare name: Literal["{name}"] = "{name}"'
        )


def _annotation_text(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return "Literal[" + ", ".join(repr(a) for a in get_args(annotation)) + "]"
    return getattr(annotation, "__name__", repr(annotation))
