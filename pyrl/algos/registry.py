"""Name -> function registries shared by the advantage estimators and the policy losses."""

from __future__ import annotations

from typing import Callable


def make_registry(kind: str, table: dict[str, Callable]):
    """(register(name) decorator, get(name)) over `table`; `kind` names the things in error messages."""

    def register(name: str):
        def decorator(fn):
            if name in table and table[name] is not fn:
                raise ValueError(f"{kind} {name!r} is already registered: {table[name]}")
            table[name] = fn
            return fn

        return decorator

    def get(name: str) -> Callable:
        if name not in table:
            raise ValueError(f"Unknown {kind} {name!r}; known: {', '.join(sorted(table))}")
        return table[name]

    return register, get
