"""`playground` and `python -m playground`: the command (cli.py), with Ctrl-C answered in one
line and status 130 from the first moment, while the command's own modules or torch are
still being imported (cli.main handles it from then on, ranks included)."""
import os
import sys

from playground.interrupts import by_interrupt, interrupts_never_ignored


def main() -> int:
    try:
        with interrupts_never_ignored(lambda: "playground"):
            from .cli import main as command
        return command()
    except BaseException as e:  # (before cli.main took over: importing it, or torch inside it)
        if isinstance(e, SystemExit) or not by_interrupt(e):
            raise
        sys.stderr.write("\nplayground: interrupted\n")
        sys.stderr.flush()
        os._exit(130)  # no teardown: a module interrupted mid-import may not unload cleanly


if __name__ == "__main__":
    sys.exit(main())
