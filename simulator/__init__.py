"""The simulator: the time and memory model of a simulated run. Hardware profiles, the
alpha-beta cost model of collectives, the roofline compute model, the per-rank clock
with record and replay, memory accounting by category, and Chrome traces. It plugs into
the process-group layer through `collectives.timing.TimeModel` (`SimulatedTime`)."""
from .hardware import PROFILES, Hardware, load_hardware
from .memory import MemoryTracker
from .time_model import SimulatedTime

__all__ = ["Hardware", "PROFILES", "load_hardware", "MemoryTracker", "SimulatedTime"]
