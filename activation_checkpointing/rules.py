"""What activation checkpointing needs of a run: a known mode, and (selective, whose policy
intercepts each op of the eager block; Korthikanti et al. 2022) no torch.compile of the
block. No torch here."""
from __future__ import annotations

from . import MODES


def problem(ac: str) -> str | None:
    if ac not in MODES:
        return f"ac={ac!r}: choose one of {MODES}"
    return None


def run_problem(ac: str, compile: bool) -> str | None:
    if compile and ac.startswith("selective"):
        return (f"--compile with --ac {ac}: the selective policy intercepts each op of the eager block; use "
                "--ac full with --compile")
    return None
