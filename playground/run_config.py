"""`RunConfig`: everything a training run or an equivalence check needs, picklable so
gloo processes receive it."""
from __future__ import annotations

from dataclasses import dataclass, field

from activation_checkpointing import rules as ac_rules
from model import GPTConfig, preset
from zero import rules as zero_rules

from .layout import Layout

DTYPES = ("float32", "float64", "bfloat16", "float16")


def torch_dtype(name: str):
    import torch
    return getattr(torch, name)


@dataclass(frozen=True)
class RunConfig:
    model: GPTConfig = field(default_factory=lambda: preset("tiny"))
    layout: Layout = field(default_factory=Layout)
    steps: int = 10  # the run's total: a resumed run continues to this step
    lr: float = 3e-3
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.0
    # bfloat16: float32 weights, bf16 compute (DDP: under autocast; ZeRO: bf16 compute copies);
    # float16: ZeRO's fp16 compute copies with dynamic loss scaling (stage 0 without --zero)
    dtype: str = "float32"
    reduce_dtype: str | None = None  # ZeRO: the dtype gradients are reduced in (None: grad_dtype's)
    # ZeRO beside compute copies: the dtype gradients accumulate in (None: the compute dtype;
    # "float32": Megatron-LM's main grads, zero/zero.py)
    grad_dtype: str | None = None
    seed: int = 0
    data: str | None = None  # None/"markov", or a path
    bucket_cap_mb: float = 25.0
    # data parallelism reduces gradients during the backward, bucket by bucket (DDP) or unit
    # by unit (ZeRO-0/1); False: after it (DDP in one bucket), as Megatron-LM's did in 2021
    grad_overlap: bool = True
    backend: str = "sim"
    progress: bool = True
    # sim: ranks executing at once between blocking calls; None: twice the CPU count
    # (more running ranks add no throughput, only live activations; see collectives.launch)
    max_running: int | None = None
    hardware: str | None = None  # sim: a hardware profile name or file; time is then simulated on it
    # with hardware: count every op of every step; otherwise step 0 is counted, step 1
    # recorded, and later steps replay its compute (simulator/clock.py)
    count_every_step: bool = False
    # bfloat16 as compute copies with fp32 master weights (ZeRO's engine, at stage 0 without
    # --zero: Megatron-LM's --bf16, FSDP2's param_dtype) and the recipe a plan prices
    # (playground/planning.py); False: torch.autocast over float32 weights (`--autocast`),
    # whose casts of every weight each forward and of its gradient back cost device time;
    # under ZeRO (its own compute copies) it has no effect
    bf16_copies: bool = True
    # ZeRO's step with compute copies at stages 0-2 in one pass a unit (zero/master_adamw.py);
    # False: torch's AdamW on fp32 gradients, then the copies rounded from the masters, as
    # separate passes (how the engine stepped before; benchmarks/fidelity.py plans the GPU runs
    # measured then as they ran)
    fused_master_step: bool = True
    # checkpoints (playground/checkpoint.py)
    save: str | None = None  # a folder: save there every `save_every` steps and at the end
    save_every: int | None = None
    resume: str | None = None  # a checkpoint folder to continue from (any layout)
    init_from: str | None = None  # a state_dict file of the reference GPT to start from
    compile: bool = False  # torch.compile each block's body (real backends: the simulator counts ops one by one)
    # each MoE layer's compiled region replayed as CUDA graphs (model/cuda_graphs.py; a GPU)
    cuda_graphs: bool = False
    # faults on purpose (playground/faults.py): injected faults, what a NaN or an Inf does
    # ("stop", "skip" the step, "off": not checked), seconds a rank may wait in one collective
    # (None: the backend's default), and restarts from the last checkpoint after a crash or a hang
    faults: tuple = ()
    on_nan: str = "stop"
    timeout: float | None = None
    max_restarts: int = 0
    elastic: int | None = None  # a restart may continue on fewer ranks, down to this many (a rank lost for good)
    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {sorted(DTYPES)}")
        if self.reduce_dtype is not None and self.reduce_dtype not in DTYPES:
            raise ValueError(f"reduce_dtype={self.reduce_dtype!r}: choose one of {sorted(DTYPES)}")
        layout = self.layout
        for found in (zero_rules.run_problem(layout.zero, self.dtype, self.reduce_dtype, self.grad_overlap),
                      ac_rules.run_problem(layout.ac, self.compile)):
            if found:  # what a strategy needs of the run (its `rules` module)
                raise ValueError(found)
        if self.grad_dtype is not None:
            if self.grad_dtype != "float32":
                raise ValueError(f"grad_dtype={self.grad_dtype!r}: gradients accumulate in float32 or, by default, "
                                 f"the compute dtype")
            if self.dtype not in ("bfloat16", "float16"):
                raise ValueError(f"--grad-dtype float32 keeps float32 gradients beside 16-bit compute copies; with "
                                 f"--dtype {self.dtype} the gradients are {self.dtype} already")
            if self.dtype == "bfloat16" and not (layout.zero or self.bf16_copies):
                raise ValueError("--grad-dtype float32 with --autocast: under autocast the weights and their gradients "
                                 "are float32 already")
        if self.save_every is not None and self.save_every < 1:
            raise ValueError(f"--save-every {self.save_every}: must be at least 1")
        if self.save_every is not None and not self.save:
            raise ValueError("--save-every needs --save DIR")
        if self.resume and self.init_from:
            raise ValueError(f"--resume {self.resume} continues a run from its checkpoint's weights and moments; "
                             f"--init-from {self.init_from} starts a new one from a state_dict: give one of them")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.compile and self.backend == "sim":
            raise ValueError("--compile runs the blocks as torch.compile's fused kernels, which the simulator cannot "
                             "count op by op: use it with --backend torch (or gloo)")
        found = cuda_graphs_problem(self)
        if found:
            raise ValueError(found)
        if self.hardware is not None and self.backend != "sim":
            raise ValueError(f"--hardware simulates time on the sim backend; backend {self.backend!r} measures it")
        if self.on_nan not in ("stop", "skip", "off"):
            raise ValueError(f"--on-nan {self.on_nan!r}: choose stop, skip or off")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"--timeout {self.timeout}: must be a number of seconds above 0")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts {self.max_restarts}: must be at least 0")
        if self.max_restarts and not self.save:
            raise ValueError(f"--max-restarts {self.max_restarts} restarts from the last checkpoint: it needs "
                             f"--save DIR (and --save-every K to lose fewer steps)")
        if self.elastic is not None and not 1 <= self.elastic <= layout.world:
            raise ValueError(f"--elastic {self.elastic}: the fewest ranks a restart may continue on, between 1 and "
                             f"the world of {layout.world}")
        if self.elastic is not None and not self.max_restarts:
            raise ValueError(f"--elastic {self.elastic} lets a restart continue on fewer ranks: give --max-restarts R")
        for f in self.faults:
            if f.rank >= layout.world:
                raise ValueError(f"--inject {f}: rank {f.rank} is not in the world of {layout.world} ranks "
                                 f"(0..{layout.world - 1})")
            if f.step > self.steps:
                raise ValueError(f"--inject {f}: step {f.step} is after the run's last step ({self.steps}, "
                                 f"--steps); it would never fire")

    @property
    def autocast(self) -> bool:
        """bf16 under torch.autocast over float32 weights (`--autocast`): bf16 without compute
        copies (`bf16_copies` False) and without ZeRO, which keeps its own."""
        return self.dtype == "bfloat16" and not (self.bf16_copies or self.layout.zero)

    @property
    def param_dtype(self):
        """Weights, gradients and optimizer states: bfloat16 runs keep them in float32."""
        return torch_dtype("float32" if self.dtype in ("bfloat16", "float16") else self.dtype)

    @property
    def tokens_per_step(self) -> int:
        return self.layout.global_batch * self.model.seq_len


def cuda_graphs_problem(run) -> str | None:
    """Why --cuda-graphs cannot graph this run's MoE layers, or None. A layer's graphs are
    replayed in the order they were captured, which only plain gradient accumulation keeps,
    and read the weights where they lie (model/cuda_graphs.py); they hold the layer's one
    compiled region, which exchanges nothing with other ranks (model/moe.py, `whole_layer`)."""
    if not run.cuda_graphs:
        return None
    layout, why = run.layout, "--cuda-graphs replays each MoE layer's compiled region as CUDA graphs"
    if run.backend != "torch":
        return f"{why} on a GPU: use it with --backend torch, not {run.backend}"
    if not run.model.n_experts:
        return f"{why}: the model has no experts (n_experts 0)"
    if run.dtype != "bfloat16":
        return f"{why}, whose grouped GEMMs run in bfloat16: give --dtype bfloat16, not {run.dtype}"
    if run.compile:
        return f"{why}; with --compile the region is traced into its block's graph instead: give one of them"
    if layout.ac != "none":
        return f"{why} in the order they were captured; --ac {layout.ac} runs a block's forward again inside " \
               f"its backward"
    if layout.pp > 1:
        return f"{why} in the order they were captured; a pipeline (pp {layout.pp}) interleaves the microbatches"
    if layout.zero == 3:
        return f"{why}, which read the weights where they lie; ZeRO-3 gathers them anew at every use"
    others = [f"{axis} {n}" for axis, n in (("ep", layout.ep), ("tp", layout.tp), ("cp", layout.cp)) if n > 1]
    if others:
        return f"{why}, which exchanges nothing with other ranks; under {', '.join(others)} the layer does"
    return None
