"""The byte ledger (docs/architecture.md, Contract 2): one entry per participating rank per call.

Entries are kept per rank in the order that rank issued its calls, so the ledger is the
same from run to run whatever the thread timing. Totals answer "how many bytes did this
label / op / group move, per rank"; algbw and busbw follow nccl-tests once an entry has
a start and end time (measured on the torch backend; modelled by the cost model on the
simulated one).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, asdict

from .algorithms import bus_factor


@dataclass(slots=True)
class LedgerEntry:
    rank: int  # global rank that this entry belongs to
    index: int  # position among this rank's calls
    op: str
    group: tuple  # global ranks of the group, group-rank order (src, dst for p2p)
    label: str
    dtype: str
    shape: tuple
    size: int  # message size S in bytes, nccl-tests definition
    algorithm: str
    bytes_sent: int
    bytes_recv: int
    site: object = ""  # file:line of the caller (a call.Site, formatted when read: str(site))
    start: float | None = None  # seconds; filled by the cost model or measured
    end: float | None = None

    @property
    def duration(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        return self.end - self.start

    @property
    def algbw(self) -> float | None:
        """Bytes per second, S / t (nccl-tests)."""
        d = self.duration
        return None if not d else self.size / d

    @property
    def busbw(self) -> float | None:
        a = self.algbw
        return None if a is None else a * float(bus_factor(self.op, len(self.group)))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["group"] = list(self.group)
        d["shape"] = list(self.shape)
        d["site"] = str(self.site)
        return d


@dataclass
class Totals:
    calls: int = 0
    size: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0


@dataclass
class Ledger:
    world_size: int
    per_rank: list = field(default_factory=list)

    def __post_init__(self):
        if not self.per_rank:
            self.per_rank = [[] for _ in range(self.world_size)]

    def record(self, entry: LedgerEntry) -> None:
        """Append `entry` to its rank's list; only that rank's thread calls this."""
        self.per_rank[entry.rank].append(entry)

    @property
    def entries(self) -> list[LedgerEntry]:
        return [e for lst in self.per_rank for e in lst]

    def for_rank(self, rank: int) -> list[LedgerEntry]:
        return list(self.per_rank[rank])

    def __len__(self) -> int:
        return sum(len(lst) for lst in self.per_rank)

    def totals(self, by: str | tuple = "op") -> dict:
        """{rank: {key: Totals}}; `by` is a field name ('op', 'label', 'group', ...) or a
        tuple of field names."""
        keys = (by,) if isinstance(by, str) else tuple(by)
        out: dict = {}
        for r, lst in enumerate(self.per_rank):
            acc = defaultdict(Totals)
            for e in lst:
                k = tuple(getattr(e, f) for f in keys)
                t = acc[k[0] if len(k) == 1 else k]
                t.calls += 1
                t.size += e.size
                t.bytes_sent += e.bytes_sent
                t.bytes_recv += e.bytes_recv
            out[r] = dict(acc)
        return out

    def bytes_sent(self, rank: int | None = None, **match) -> int:
        """Bytes sent by `rank` (all ranks if None) over entries whose fields equal `match`."""
        ranks = range(self.world_size) if rank is None else [rank]
        return sum(
            e.bytes_sent
            for r in ranks
            for e in self.per_rank[r]
            if all(getattr(e, k) == v for k, v in match.items())
        )

    def table(self, by: str = "label") -> str:
        """A per-rank table of calls and bytes by `by`."""
        rows = [("rank", by, "calls", "sent", "received")]
        for r, groups in self.totals(by).items():
            for k, t in sorted(groups.items(), key=lambda kv: str(kv[0])):
                rows.append((str(r), str(k), str(t.calls), human_bytes(t.bytes_sent), human_bytes(t.bytes_recv)))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = ["  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def to_json(self) -> list[dict]:
        return [e.to_dict() for e in self.entries]

    @classmethod
    def merged(cls, world_size: int, per_rank_lists) -> "Ledger":
        led = cls(world_size)
        for r, lst in enumerate(per_rank_lists):
            led.per_rank[r] = list(lst)
        return led


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
