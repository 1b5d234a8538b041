"""Hardware profiles for the cost model (docs/architecture.md, Contract 3).

Rates are per GPU. Link bandwidths are per direction. One profile per GPU type; every
number in it is a datasheet's, a measurement's (this project's, or one published with
its source), or an assumption said to be one:
- `h100-sxm` is a file, profiles/h100-sxm.json, whose `sources` table cites each number:
  the datasheet's peaks, HBM and NVLink; kernels measured on an H200 (the same GH100
  compute: 132 SMs, 1,980 MHz, 700 W) by benchmarks/shapes_gpu.py: bf16 matmuls at 0.70
  of the peak sustained under the power limit, with tile and wave quantization, fused
  attention by head dimension and sequence, memory-bound kernels at 0.77 of HBM; NCCL's
  effective NVLink bandwidth, 370 GB/s (NCCL's maintainer, NVIDIA/nccl-tests thread "H100 all
  reduce performance is poor", 2024).
- A100 80GB SXM (NVIDIA A100 Tensor Core GPU datasheet): bf16 dense 312 TFLOP/s, HBM2e
  2.039 TB/s, 80 GB, 108 SMs. NVLink 3 is 300 GB/s each way on the wire; NCCL's
  all_reduce_perf on 8 A100s of one node reaches a bus bandwidth of 232.5 GB/s
  (NVIDIA/nccl-tests thread "Two A100 nodes cannot reach ideal all-reduce performance",
  2023), the figure taken. Network: a DGX A100 node has one
  200 Gb/s HDR InfiniBand port per GPU (DGX A100 user guide): 25 GB/s.
- H200 SXM (NVIDIA H200 Tensor Core GPU datasheet): the H100's compute and NVLink, HBM3e
  4.8 TB/s, 141 GB; network as DGX H100 (DGX H200: 400 Gb/s per GPU). `h200-datasheet`.
- FP32 (not tensor-core; torch's default for float32 matmuls, TF32 off): A100 19.5 TFLOP/s,
  H100/H200 SXM 67 TFLOP/s (the same datasheets).
- Compute beside communication (A100 and H100): 18.9% slower on average (Lee et al.
  2025, "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
  Learning", 4 A100s and H100s; simulator/clock.py).
- GEMM tiles (A100): cuBLAS's 256×128, 128×256 and 128×128 (NVIDIA, "Matrix
  Multiplication Background User's Guide", tile and wave quantization on the A100's 108
  SMs).
Assumptions of the A100, h100-datasheet and h200-datasheet profiles (the datasheet values
above with these; override them with a profile file):
- achievable fractions: 0.80 of peak for matmuls and 0.90 of HBM bandwidth (this
  workplace's H200 measured 0.78 for an 8192³ bf16 matmul over its first half second and
  0.70 sustained under its power limit; a copy at 0.83 of its HBM);
- fused attention at 0.60 of the bf16 peak, within the 50-73% of the A100's peak
  FlashAttention-2 reaches (Dao 2023, abstract), in its own count, which takes the backward
  as 2.5 times the forward (its benchmarks/benchmark_flash_attention.py, `flops`: the
  backward computes QKᵀ again), as this simulator's does (torch's FLOP formula for the
  backward counts that recomputation: torch/utils/flop_counter.py, sdpa_backward_flop_count);
  FlashAttention-1's kernels at half that (simulator/compute_model.py, FLASH_GENERATIONS);
- a kernel floor of 5 µs: the host's time to issue one op (a launch, and eager PyTorch's
  dispatch), which the GPU waits for when its kernels are shorter (the compute model's
  host queue); a collective call costs the host one floor too unless the profile gives
  `collective_floor` (calibrate measures it: the process group's bookkeeping, the
  backend's call and its wait);
- no `selective_floor`: what selective activation checkpointing's Python dispatch mode adds
  to the host's cost per op is not priced (calibrate measures it: on one H100's host it
  made 1b-moe's host-bound step 1.6 times its full recomputation's);
- no `region_op_floor`: a compiled region's call (its forward, its backward) costs the host
  one kernel floor, however many kernels its graph launches (calibrate measures the cost per
  op inside the model's step);
- no `optimizer_hbm_fraction`: the optimizer's passes stream at `hbm_fraction` (calibrate
  times one pass over a large unit);
- latencies α: 2 µs per NVLink step and 5 µs per network step, of the order of NCCL's
  own tuning model for its Simple protocol.
The `h200` profile is not the datasheet's: `playground calibrate` fitted it on 2× H200
(playground/calibrate.py; its `source` says which run), and it takes the SMs, the matmul
tiles and the attention table by shape that benchmarks/shapes_gpu.py measured on an H200
(its `sources`).
A profile file (TOML or JSON) holds the same keys (`source` optional; `collective_floor`,
`sm_count`, `matmul_tiles`, `attention_table`, `overlap_slowdown`, `selective_floor`, `region_op_floor` and
`optimizer_hbm_fraction` optional; a `calibration` table, as
calibrate writes, and a `sources` table citing each number are kept for the record and not
read); missing keys are an error.
"""
from __future__ import annotations

import json
import math
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
    # GEMM tile and wave quantization (NVIDIA, "Matrix Multiplication Background User's Guide"):
    # a 16-bit matmul runs as tiles of one of `matmul_tiles` (rows, columns of its output),
    # `sm_count` at a time, so its time is that of whole waves of whole tiles: the cheapest
    # of the tile shapes, as cuBLAS's heuristics pick one. None: no quantization
    sm_count: int | None = None
    matmul_tiles: tuple | None = None
    # fused attention's fraction of the bf16 peak by head dimension and sequence, measured
    # ({head_dim: ((seq, fraction), ...)}): interpolated in log(seq) at the nearest measured
    # head dimension, held flat beyond the ends. None: `attention_fraction` at every shape
    attention_table: dict | None = None
    # how much slower compute runs while a collective is in flight beside it (simulator/clock.py)
    overlap_slowdown: float = 0.0
    # seconds selective activation checkpointing adds to the host's issuing of each op of a
    # checkpointed block, in its forward and in its recomputation: torch's selective
    # checkpoint runs every such op through a Python dispatch mode (its caching and its replay;
    # `playground calibrate` measures it). None: not measured, nothing charged (a plan says so)
    selective_floor: float | None = None
    # seconds the host takes per op of a compiled region's graph (model/compiled.py: its
    # forward call and its backward's, each op that launches, views and the recomputation
    # Inductor fuses into its consumers not counted): torch.compile's call runs Inductor's
    # wrapper, which launches the graph's kernels one by one, at a cost per op of its own
    # (`playground calibrate` times the calls inside the model's step). None: not measured, a
    # call costs one kernel_floor
    region_op_floor: float | None = None
    # achieved fraction of HBM bandwidth in the optimizer's passes (zero/master_adamw.py's one
    # kernel a flat unit, torch's fused AdamW): each streams hundreds of MB in one kernel and
    # reaches more of the bandwidth than the model's elementwise kernels (on one H100, 0.78
    # against 0.65: benchmarks/results/gpu/run71 and run78). None: `hbm_fraction`
    optimizer_hbm_fraction: float | None = None

    @property
    def call_floor(self) -> float:
        """The host's seconds per collective call (collective_floor, else one kernel_floor)."""
        return self.kernel_floor if self.collective_floor is None else self.collective_floor

    def to_dict(self) -> dict:
        """Every field (a profile file's keys); collective_floor only where it is set."""
        out = asdict(self)
        for key in _OPTIONAL:
            if out[key] is None or (key == "overlap_slowdown" and not out[key]):
                del out[key]
        return out

    def attention_fraction_at(self, head_dim: int, seq: int) -> float:
        """The fraction of the bf16 peak fused attention reaches at this head dimension and
        sequence (`attention_table`, else `attention_fraction`)."""
        if not self.attention_table:
            return self.attention_fraction
        dims = sorted(self.attention_table)
        points = self.attention_table[min(dims, key=lambda d: (abs(d - head_dim), -d))]
        if seq <= points[0][0]:
            return points[0][1]
        for (s0, f0), (s1, f1) in zip(points, points[1:]):
            if seq <= s1:
                w = (math.log(seq) - math.log(s0)) / (math.log(s1) - math.log(s0))
                return f0 + w * (f1 - f0)
        return points[-1][1]

    def wave_quantization(self, tiles_m: int, tiles_n: int, batch: int = 1) -> float:
        """How many times the work of an (m × n) output (× batch) the GPU does for it: whole
        tiles in whole waves of `sm_count` (the cheapest tile shape); 1 without the fields."""
        if not self.sm_count or not self.matmul_tiles:
            return 1.0
        best = math.inf
        for tm, tn in self.matmul_tiles:
            tiles = batch * -(-tiles_m // tm) * -(-tiles_n // tn)
            best = min(best, -(-tiles // self.sm_count) * self.sm_count * tm * tn / (batch * tiles_m * tiles_n))
        return best


_ASSUMED = dict(attention_fraction=0.60, kernel_floor=5e-6)
PROFILES = {
    "a100-80gb": Hardware("a100-80gb", 312e12, 0.80, 2.039e12, 0.90, 80 * GB, 232 * GB, 25 * GB, 2e-6, 5e-6, 8,
                          fp32_flops=19.5e12, **_ASSUMED, source="datasheet (A100 80GB SXM) and assumptions",
                          sm_count=108, matmul_tiles=((256, 128), (128, 256), (128, 128)), overlap_slowdown=0.189),
    "h100-datasheet": Hardware("h100-datasheet", 989e12, 0.80, 3.35e12, 0.90, 80 * GB, 450 * GB, 50 * GB, 2e-6, 5e-6, 8,
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


_OPTIONAL = ("collective_floor", "sm_count", "matmul_tiles", "attention_table", "overlap_slowdown", "selective_floor",
             "region_op_floor", "optimizer_hbm_fraction")


def hardware_from_dict(data: dict, where: str = "profile") -> Hardware:
    names = [f.name for f in fields(Hardware)]
    missing = [n for n in names if n not in data and n not in ("source", *_OPTIONAL)]
    unknown = sorted(set(data) - set(names) - {"calibration", "sources"})
    if missing or unknown:
        raise ValueError(f"hardware file {where!r}: missing {missing}, unknown {unknown}")
    values = {}
    for n in (n for n in names if n in data):
        try:
            x = data[n]
            if x is None:
                values[n] = None
            elif n in ("gpus_per_node", "sm_count"):
                values[n] = int(x)
            elif n in ("name", "source"):
                values[n] = str(x)
            elif n == "matmul_tiles":
                values[n] = tuple((int(a), int(b)) for a, b in x)
            elif n == "attention_table":
                values[n] = {int(d): tuple((int(s), float(f)) for s, f in sorted(pts)) for d, pts in x.items()}
            else:
                values[n] = float(x)
        except (TypeError, ValueError, AttributeError):
            raise ValueError(f"hardware file {where!r}: {n} = {data[n]!r} is not a number "
                             f"(or, for matmul_tiles and attention_table, pairs of numbers)") from None
    for n, x in values.items():
        wrong = _out_of_range(n, x)
        if wrong:
            raise ValueError(f"hardware file {where!r}: {n} = {data[n]!r} {wrong}")
    return Hardware(**values)


_FRACTIONS = ("matmul_fraction", "hbm_fraction", "attention_fraction", "optimizer_hbm_fraction")  # of a peak: in (0, 1]
_AT_LEAST_ZERO = ("nvlink_latency", "network_latency", "kernel_floor", "collective_floor", "overlap_slowdown",
                  "selective_floor", "region_op_floor")


def _out_of_range(name: str, x):
    """What is wrong with a profile's value `x` of field `name` (None: nothing): fractions of a
    peak in (0, 1]; latencies, floors and the overlap slowdown finite and at least 0; a
    bandwidth above 0, infinite allowed (no cost per byte: what calibrate writes where a
    collective's time did not grow with its size); every other rate, capacity and count
    finite and above 0."""
    if x is None or name in ("name", "source"):
        return None
    if name == "matmul_tiles":
        return None if all(a > 0 and b > 0 for a, b in x) else "must be pairs of tile sides above 0"
    if name == "attention_table":
        ok = all(d > 0 and s > 0 and 0 < f <= 1 for d, pts in x.items() for s, f in pts)
        return None if ok else "must map head dimensions above 0 to (sequence above 0, fraction in (0, 1]) pairs"
    if name in _FRACTIONS:
        return None if 0 < x <= 1 else "must be a fraction of the peak, in (0, 1]"
    if name in _AT_LEAST_ZERO:
        return None if math.isfinite(x) and x >= 0 else "must be a finite number at least 0"
    if name.endswith("_bandwidth"):
        return None if x > 0 else "must be above 0 (inf: no cost per byte)"
    return None if math.isfinite(x) and x > 0 else "must be a finite number above 0"
