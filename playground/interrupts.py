"""Ctrl-C that Python delivers wrapped or not at all. A KeyboardInterrupt raised inside a
class body's `__set_name__` (a dataclass being defined while a module imports) comes out as
the RuntimeError "Error calling __set_name__ ...", the interrupt its cause; one raised
inside code whose exceptions Python ignores (a weakref callback such as the import
system's module-lock cleanup, a `__del__`, a garbage-collector callback) is printed as
"Exception ignored in ..." and lost, and the command ran on as if never interrupted. The
command answers both as the interrupt they are (`by_interrupt`, `interrupts_never_ignored`:
Python hands an ignored exception to `sys.unraisablehook`, since Python 3.8)."""
from __future__ import annotations

import contextlib
import os
import sys


def by_interrupt(e: BaseException) -> bool:
    """Whether `e` is a KeyboardInterrupt or was raised from one (its cause or context chain)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def interrupts_never_ignored(verb):
    """Within it, a Ctrl-C that Python would ignore (raised where exceptions are only printed)
    stops the process as an answered interrupt does: one line, "<verb>: interrupted", and
    status 130, without the interpreter's teardown (a module interrupted mid-import may not
    unload cleanly). `verb`: a callable giving the command's name at that moment. Other
    ignored exceptions go to the hook that was there before."""
    previous = sys.unraisablehook

    def hook(unraisable):
        if by_interrupt(unraisable.exc_value):
            sys.stderr.write(f"\n{verb()}: interrupted\n")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        previous(unraisable)
    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
