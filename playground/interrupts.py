"""Ctrl-C that Python delivers wrapped: a KeyboardInterrupt raised inside a class body's
`__set_name__` (a dataclass being defined while a module imports) comes out as the
RuntimeError "Error calling __set_name__ ...", the interrupt its cause. The command answers
it as the interrupt it is."""
from __future__ import annotations


def by_interrupt(e: BaseException) -> bool:
    """Whether `e` is a KeyboardInterrupt or was raised from one (its cause or context chain)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False
