"""Hardware profiles for the cost model (docs/architecture.md, Contract 3).

Rates are per GPU. Link bandwidths are per direction. Datasheet values:
- A100 80GB SXM (NVIDIA A100 Tensor Core GPU datasheet): bf16 dense 312 TFLOP/s, HBM2e
  2.039 TB/s, 80 GB, NVLink 3 600 GB/s bidirectional = 300 GB/s each way. Network: a
  DGX A100 node has one 200 Gb/s HDR InfiniBand port per GPU (DGX A100 user guide): 25 GB/s.
- H100 SXM (NVIDIA H100 Tensor Core GPU datasheet): bf16 dense 989 TFLOP/s (1,979 with
  sparsity), HBM3 3.35 TB/s, 80 GB, NVLink 4 900 GB/s bidirectional = 450 GB/s each way.
  Network: DGX H100 has one 400 Gb/s ConnectX-7 port per GPU (DGX H100 user guide): 50 GB/s.
- H200 SXM (NVIDIA H200 Tensor Core GPU datasheet): the H100's compute and NVLink, HBM3e
  4.8 TB/s, 141 GB; network as DGX H100 (DGX H200: 400 Gb/s per GPU).
- FP32 (not tensor-core; torch's default for float32 matmuls, TF32 off): A100 19.5 TFLOP/s,
  H100/H200 SXM 67 TFLOP/s (the same datasheets).
Not datasheet values (assumptions, override them with a profile file):
- achievable fractions: 0.80 of peak for matmuls and 0.90 of HBM bandwidth, from this
  workplace's own H200 measurements (an 8192³ bf16 matmul at 788 TFLOP/s of 989; a
  device-to-device copy at 4.3 TB/s of 4.8), used for the A100 and H100;
- fused attention at 0.60 of the bf16 peak: FlashAttention-2 reaches 50-73% of the
  A100's peak forward and backward (Dao 2023, abstract), FlashAttention-3 75% forward on
  the H100 with a slower backward (Shah et al. 2024);
- a kernel floor of 5 µs: the host's time to issue one op (a launch, and eager PyTorch's
  dispatch), which the GPU waits for when its kernels are shorter (the compute model's
  host queue); a collective call costs the host one floor too unless the profile gives
  `collective_floor` (calibrate measures it: the process group's bookkeeping, the
  backend's call and its wait);
- latencies α: 2 µs per NVLink step and 5 µs per network step, of the order of NCCL's
  own tuning model for its Simple protocol.
The `h200` profile is not the datasheet's: `playground calibrate` fitted it on 2× H200
(playground/calibrate.py; its `source` says which run).
A profile file (TOML or JSON) holds the same keys (`source` optional; a `calibration`
table, as calibrate writes, is kept for the record and not read); missing keys are an error.
"""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import asdict, dataclass, fields

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_bf16_flops: float  # dense FLOP/s
    matmul_fraction: float  # achievable fraction of the peak for matmuls
    hbm_bandwidth: float  # bytes/s
    hbm_fraction: float  # achievable fraction of HBM bandwidth
    hbm_capacity: float  # bytes
    nvlink_bandwidth: float  # bytes/s per GPU, one direction
    network_bandwidth: float  # bytes/s per GPU, one direction
    nvlink_latency: float  # seconds per step (α inside a node)
    network_latency: float  # seconds per step (α across nodes)
    gpus_per_node: int
    fp32_flops: float  # dense FP32 FLOP/s (float32 matmuls; float64 runs at this rate too)
    attention_fraction: float  # achievable fraction of the bf16 peak in fused attention kernels
    kernel_floor: float  # seconds the host takes to issue one op (the compute model's host queue)
    source: str = "datasheet"  # where the numbers come from
    # seconds the host takes to issue and wait one collective through the process group (the
    # ledger's entry, the backend's call); None: one kernel_floor (profiles without it)
    collective_floor: float | None = None

    @property
    def call_floor(self) -> float:
        """The host's seconds per collective call (collective_floor, else one kernel_floor)."""
        return self.kernel_floor if self.collective_floor is None else self.collective_floor

    def to_dict(self) -> dict:
        """Every field (a profile file's keys); collective_floor only where it is set."""
        out = asdict(self)
        if out["collective_floor"] is None:
            del out["collective_floor"]
        return out


_ASSUMED = dict(attention_fraction=0.60, kernel_floor=5e-6)
PROFILES = {
    "a100-80gb": Hardware("a100-80gb", 312e12, 0.80, 2.039e12, 0.90, 80 * GB, 300 * GB, 25 * GB, 2e-6, 5e-6, 8,
                          fp32_flops=19.5e12, **_ASSUMED, source="datasheet (A100 80GB SXM) and assumptions"),
    "h100-sxm": Hardware("h100-sxm", 989e12, 0.80, 3.35e12, 0.90, 80 * GB, 450 * GB, 50 * GB, 2e-6, 5e-6, 8,
                         fp32_flops=67e12, **_ASSUMED, source="datasheet (H100 SXM) and assumptions"),
    "h200-datasheet": Hardware("h200-datasheet", 989e12, 0.80, 4.8e12, 0.90, 141 * GB, 450 * GB, 50 * GB, 2e-6,
                               5e-6, 8, fp32_flops=67e12, **_ASSUMED, source="datasheet (H200 SXM) and assumptions"),
}
CALIBRATED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb"}


def load_hardware(name_or_path: str) -> Hardware:
    """A named profile, or a TOML/JSON file with every field of `Hardware`."""
    key = ALIASES.get(name_or_path, name_or_path)
    shipped = os.path.join(CALIBRATED, f"{key}.json")
    if os.sep not in key and os.path.exists(shipped):  # a calibrated profile shipped with the simulator
        name_or_path = shipped
    elif key in PROFILES:
        return PROFILES[key]
    elif not os.path.exists(name_or_path):
        raise ValueError(f"hardware {name_or_path!r}: not a profile ({profile_names()}) nor a file")
    if os.path.isdir(name_or_path):
        raise ValueError(f"hardware {name_or_path!r}: a folder, not a profile file")
    toml = name_or_path.endswith(".toml")
    try:
        with open(name_or_path, "rb") as f:
            data = tomllib.load(f) if toml else json.load(f)
    except (ValueError, UnicodeDecodeError) as e:  # (json's and tomllib's decode errors are ValueErrors)
        raise ValueError(f"hardware file {name_or_path!r}: not valid {'TOML' if toml else 'JSON'} ({e})") from None
    except OSError as e:
        raise ValueError(f"hardware file {name_or_path!r}: cannot read it ({e.strerror})") from None
    if not isinstance(data, dict):
        raise ValueError(f"hardware file {name_or_path!r}: holds a {type(data).__name__}, not a table of fields")
    return hardware_from_dict(data, name_or_path)


def profile_names() -> list:
    """The named profiles: the datasheet ones and the calibrated ones shipped in profiles/."""
    shipped = [f[:-5] for f in os.listdir(CALIBRATED) if f.endswith(".json")] if os.path.isdir(CALIBRATED) else []
    return sorted(set(PROFILES) | set(shipped))


def hardware_from_dict(data: dict, where: str = "profile") -> Hardware:
    names = [f.name for f in fields(Hardware)]
    missing = [n for n in names if n not in data and n not in ("source", "collective_floor")]
    unknown = sorted(set(data) - set(names) - {"calibration"})
    if missing or unknown:
        raise ValueError(f"hardware file {where!r}: missing {missing}, unknown {unknown}")
    values = {}
    for n in (n for n in names if n in data):
        try:
            values[n] = (int(data[n]) if n == "gpus_per_node" else str(data[n]) if n in ("name", "source")
                         else None if data[n] is None else float(data[n]))
        except (TypeError, ValueError):
            raise ValueError(f"hardware file {where!r}: {n} = {data[n]!r} is not a number") from None
    return Hardware(**values)
