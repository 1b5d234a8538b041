"""The command's flags: one parser per verb, each listing only the flags that verb accepts,
with its default and, where our name differs, the Megatron-LM (Shoeybi et al. 2019;
Narayanan et al. 2021) and torchtitan (Liang et al. 2024) name of the same setting.

Every value is typed and bounded here (a count is a whole number of at least its minimum, a
rate a finite number in its range), so a bad flag is answered before torch is imported; a
bad flag is one line naming the flag, the value and what it takes, and exit status 2 (the
parser's `error`, in place of argparse's usage block). This module imports nothing heavy:
`playground --help` and a bad flag answer in a tenth of a second.
"""
from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
import textwrap

from activation_checkpointing import MODES as AC_MODES
from model.config import DEFAULT_LR, PRESETS
from pipeline.schedules import SCHEDULES
from sequence_parallel.balance import BALANCES, IMPLEMENTATIONS

from .fits import DEFAULT_HEADROOM
from .layout import Layout
from .run_config import DTYPES

VERBS = ("train", "check", "plan", "calibrate", "export", "bench")
# --dtype by verb: a check's PASS proves most in float64, a plan prices mixed precision
DEFAULT_DTYPE = {"train": "float32", "check": "float64", "plan": "bfloat16"}
DEFAULT_STEPS = {"train": 20, "check": 3}
PROFILES = "h100-sxm, a100-80gb, h200 or a TOML/JSON profile file"


# -- values ---------------------------------------------------------------------------------
def whole(minimum: int):
    """argparse type: a whole number of at least `minimum`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text}: not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text}: must be at least {minimum}")
        return value
    parse.__name__ = "whole number"
    return parse


def real(low: float, high: float = math.inf, open_low: bool = False, open_high: bool = True):
    """argparse type: a finite number in [low, high) (or (low, ...) with `open_low`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text}: not a number") from None
        below = value <= low if open_low else value < low
        above = value >= high if open_high else value > high
        if not math.isfinite(value) or below or above:
            lo = f"above {low:g}" if open_low else f"at least {low:g}"
            hi = "" if math.isinf(high) else (f" and below {high:g}" if open_high else f" and at most {high:g}")
            raise argparse.ArgumentTypeError(f"{text}: must be a finite number {lo}{hi}")
        return value
    parse.__name__ = "number"
    return parse


# -- the parser -----------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `playground VERB: --flag VALUE: what is wrong`, exit 2."""

    def __init__(self, *args, **kwargs):
        self.accepted: dict = {}  # {verb: its flags}, set by `parser` once every verb is built
        kwargs.setdefault("allow_abbrev", False)  # (a prefix of a flag is not that flag)
        kwargs.setdefault("formatter_class", Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: {self._explain(message)}\n")
        sys.exit(2)

    def _flags(self) -> list:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def _explain(self, message: str) -> str:
        m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message)
        if m:
            flag, what = m.groups()
            if flag.startswith("{"):
                return f"{what.replace('invalid choice', 'no verb')}"
            if what.startswith("invalid choice: "):
                value, choices = re.match(r"invalid choice: '?(.*?)'? \(choose from (.*)\)", what).groups()
                return f"{flag} {value}: choose one of {choices.replace(chr(39), '')}"
            kind = re.match(r"invalid (\S+(?: \S+)?) value: '(.*)'", what)
            if kind:
                return f"{flag} {kind.group(2)}: not a {kind.group(1)}"
            if what == "expected one argument":
                return f"{flag}: give a value"
            if what.startswith("not allowed with argument"):
                return f"{flag}: {what}"
            return f"{flag} {what}"
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:
            word = m.group(1).split()[0]
            return self._unknown(word.split("=")[0])
        m = re.match(r"the following arguments are required: (.*)", message)
        if m:
            missing = m.group(1)
            if missing.startswith("{"):
                return f"give a verb: {', '.join(VERBS)} (playground VERB --help lists its flags)"
            hint = f" ({PROFILES})" if missing == "--hardware" else ""
            return f"{missing} is required{hint}"
        return message

    def _unknown(self, word: str) -> str:
        if not word.startswith("-"):
            return f"{word!r}: unexpected (flags start with --; playground {self.prog.split()[-1]} --help lists them)"
        verb = self.prog.split()[-1]
        elsewhere = [v for v, flags in self.accepted.items() if word in flags]
        if elsewhere:
            return f"{word} is not a flag of {verb}: it belongs to {' and '.join(elsewhere)}" + \
                   (f" ({WHY_NOT[verb, word]})" if (verb, word) in WHY_NOT else "")
        close = difflib.get_close_matches(word, self._flags(), n=2, cutoff=0.6)
        alias = MEGATRON.get(word)
        if alias and alias in self._flags():
            return f"{word}: not a flag of playground {verb}; it is {alias} here"
        return f"{word}: not a flag of playground {verb}" + (f"; did you mean {' or '.join(close)}?" if close
                                                            else f" (playground {verb} --help lists them)")


class Help(argparse.HelpFormatter):
    """Every flag's help ends with its default, where it has one (0 included); lines break
    between words, never inside a flag's name."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or default is None or default is False or default == argparse.SUPPRESS
                or not action.option_strings or "default:" in text):
            return text
        return f"{text} (default: %(default)s)"


# the names other frameworks give a setting ours names differently; an unknown flag among
# these is answered with ours
MEGATRON = {"--tensor-model-parallel-size": "--tp", "--pipeline-model-parallel-size": "--pp",
            "--context-parallel-size": "--cp", "--expert-model-parallel-size": "--ep",
            "--sequence-parallel": "--sp", "--seq-length": "--seq-len", "--num-experts": "--experts",
            "--moe-router-topk": "--top-k", "--moe-expert-capacity-factor": "--capacity-factor",
            "--moe-aux-loss-coeff": "--aux-loss-coef", "--moe-z-loss-coeff": "--z-loss-coef",
            "--moe-router-score-function": "--router", "--moe-router-bias-update-rate": "--bias-update-rate",
            "--moe-ffn-hidden-size": "--expert-d-ff", "--moe-router-load-balancing-type": "--aux-loss",
            "--train-iters": "--steps", "--recompute-granularity": "--ac", "--use-distributed-optimizer": "--zero",
            "--num-layers-per-virtual-pipeline-stage": "--virtual-stages", "--global-batch": "--global-batch-size"}

# why a verb refuses a flag a user may try
WHY_NOT = {("plan", f): "a plan runs no data and keeps no weights" for f in
           ("--save", "--resume", "--init-from", "--data", "--seed", "--steps", "--lr", "--backend", "--compile",
            "--save-every", "--overwrite")}
WHY_NOT.update({("check", f): "a check compares training from the start against one device" for f in
                ("--save", "--resume", "--save-every", "--overwrite")})
WHY_NOT.update({("check", f): "a check runs no simulated time" for f in ("--hardware", "--trace",
                                                                           "--count-every-step")})
WHY_NOT[("check", "--no-progress")] = "a check shows no progress bar"


def _layout_flags(p, verb: str) -> None:
    g = p.add_argument_group("model and layout")
    g.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model preset")
    g.add_argument("--model-config", metavar="KEY=VALUE,...",
                   help="override the preset's shape: d_model, n_layers, n_heads, n_kv_heads, d_ff, vocab_size, "
                        "seq_len, attention=flash|flash1|unfused (flash1: planned as FlashAttention-1), "
                        "attention_dropout (unfused only), and the MoE fields (default: the preset's)")
    g.add_argument("--world", type=whole(1), help="number of ranks (default: the product of the axes; under torchrun "
                                                  "its process count)")
    for axis, what, names in (
            ("dp", "data-parallel", "Megatron: world / (tp·pp·cp); torchtitan: parallelism.data_parallel_*_degree"),
            ("tp", "tensor-parallel (Megatron)", "Megatron --tensor-model-parallel-size; torchtitan: "
                                                 "parallelism.tensor_parallel_degree"),
            ("pp", "pipeline-parallel", "Megatron --pipeline-model-parallel-size; torchtitan: "
                                        "parallelism.pipeline_parallel_degree"),
            ("cp", "context-parallel", "Megatron --context-parallel-size; torchtitan: "
                                       "parallelism.context_parallel_degree"),
            ("ep", "expert-parallel (MoE models)", "Megatron --expert-model-parallel-size; torchtitan: "
                                                   "parallelism.expert_parallel_degree")):
        g.add_argument(f"--{axis}", type=whole(1), help=f"{what} degree ({names}) (default: " +
                       ("what --world leaves over the other axes, else 1)" if axis == "dp" else "1)"))
    g.add_argument("--dp-shard", type=whole(1),
                   help="hybrid sharding (HSDP) with --zero: the data-parallel ranks each ZeRO shard group spans, "
                        "neighbours within a node (torchtitan parallelism.data_parallel_shard_degree; FSDP's "
                        "HYBRID_SHARD) (default: all of dp)")
    g.add_argument("--dp-replicate", type=whole(1),
                   help="hybrid sharding with --zero: the replicas of each shard group, across nodes; dp = dp-shard × "
                        "dp-replicate (torchtitan parallelism.data_parallel_replicate_degree) (default: 1)")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="ZeRO stage over dp: 1 optimizer states (Megatron --use-distributed-optimizer), 2 and "
                        "gradients, 3 and parameters (FSDP, torchtitan's data_parallel_shard_degree); 0 is DDP")
    g.add_argument("--sp", action="store_true", help="sequence parallelism with --tp (Korthikanti et al.; Megatron "
                                                     "--sequence-parallel)")
    g.add_argument("--cp-impl", default="ring", choices=IMPLEMENTATIONS,
                   help="with --cp: ring attention (K/V around the ring; Megatron --cp-comm-type p2p) or Ulysses "
                        "(all-to-all to heads; a2a)")
    g.add_argument("--cp-balance", default="zigzag", choices=BALANCES,
                   help="with --cp: which sequence chunks a cp rank holds: zigzag (rank r: chunks r and 2cp-1-r, "
                        "equal causal work) or contiguous (rank r: chunk r)")
    g.add_argument("--ac", default="none", choices=AC_MODES,
                   help="activation checkpointing of every block: full keeps only the block's input, selective also "
                        "its matmul and attention outputs, selective-op those but every second matmul's "
                        "(torchtitan's selective op policy), and backward recomputes the rest (Megatron "
                        "--recompute-granularity; torchtitan activation_checkpoint.mode)")
    g.add_argument("--seq-len", type=whole(2), help="sequence length (Megatron --seq-length; torchtitan "
                                                    "training.seq_len) (default: the preset's)")
    g.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                   help="with --pp: the pipeline schedule (torchtitan parallelism.pipeline_parallel_schedule)")
    g.add_argument("--microbatches", type=whole(1),
                   help="microbatches per step per data-parallel rank (gradient accumulation, or the pipeline's m; "
                        "Megatron derives it from --global-batch-size) (default: 1, or what --global-batch-size "
                        "gives)")
    g.add_argument("--micro-batch-size", type=whole(1), default=Layout.micro_batch_size,
                   help="sequences per microbatch (Megatron --micro-batch-size; torchtitan training.local_batch_size "
                        "without gradient accumulation)")
    g.add_argument("--global-batch-size", "--global-batch", dest="global_batch", type=whole(1),
                   help="sequences per optimizer step over all ranks (Megatron --global-batch-size; torchtitan "
                        "training.global_batch_size): sets the microbatches to it / (dp × micro-batch size) "
                        "(default: dp × microbatches × micro-batch size)")
    g.add_argument("--virtual-stages", type=whole(1), default=1,
                   help="with --pp and --schedule interleaved: model chunks per pipeline rank (Megatron "
                        "--num-virtual-stages-per-pipeline-rank)")
    g.add_argument("--stage-layers", metavar="N,N,...",
                   help="with --pp: blocks per pipeline stage, comma-separated, e.g. 1,3 (Megatron "
                        "--decoder-first/last-pipeline-num-layers); the first and last may be 0, a stage of "
                        "the embedding or the head alone (default: even)")
    m = p.add_argument_group("mixture of experts (the -moe presets, or --experts on any preset)")
    m.add_argument("--experts", type=whole(0), help="experts per MoE block, 0 for none (Megatron --num-experts) "
                                                    "(default: the preset's)")
    m.add_argument("--moe-every", type=whole(1), help="every k-th block has experts (Megatron --moe-layer-freq) "
                                                      "(default: the preset's, 1)")
    m.add_argument("--top-k", type=whole(1), help="experts per token (Megatron --moe-router-topk) (default: the "
                                                  "preset's, 2)")
    m.add_argument("--capacity-factor", type=real(0.0, open_low=True),
                   help="expert slots per token group: ceil(cf·k·T/E); overflow is dropped (Megatron "
                        "--moe-expert-capacity-factor) (default: the preset's, 1.0)")
    m.add_argument("--dropless", action="store_true", help="no capacity: every assignment is computed (Megatron "
                                                           "without --moe-expert-capacity-factor)")
    m.add_argument("--aux-loss-coef", type=real(0.0), help="Switch load-balancing loss coefficient α (Megatron "
                                                           "--moe-aux-loss-coeff) (default: 0.01)")
    m.add_argument("--z-loss-coef", type=real(0.0), help="ST-MoE router z-loss coefficient β (Megatron "
                                                         "--moe-z-loss-coeff) (default: 0.001)")
    m.add_argument("--aux-loss", choices=("batch", "sequence"),
                   help="the load-balancing loss's counts: over the microbatch (Switch) or per sequence "
                        "(DeepSeek-V3; Megatron --moe-router-load-balancing-type aux_loss|seq_aux_loss) "
                        "(default: the preset's, batch)")
    m.add_argument("--router", choices=("softmax", "topk-softmax", "sigmoid"),
                   help="softmax then top-k; the top-k logits then a softmax (Mixtral); or sigmoid scores with "
                        "normalised top-k gates (DeepSeek-V3; Megatron --moe-router-score-function) "
                        "(default: the preset's, softmax)")
    m.add_argument("--bias-update-rate", type=real(0.0),
                   help="auxiliary-loss-free balancing: a per-expert bias on the routing scores, moved this much per "
                        "step towards the mean load; 0 for none (DeepSeek-V3's γ, 0.001; Megatron "
                        "--moe-router-bias-update-rate with --moe-router-enable-expert-bias) (default: the preset's)")
    m.add_argument("--shared-experts", type=whole(0),
                   help="always-on shared experts beside the routed ones (DeepSeekMoE; Megatron "
                        "--moe-shared-expert-intermediate-size = this × --expert-d-ff) (default: the preset's, 0)")
    m.add_argument("--expert-d-ff", type=whole(1),
                   help="each routed expert's SwiGLU width, narrower for fine-grained experts (Megatron "
                        "--moe-ffn-hidden-size) (default: the preset's, d_ff)")


def _training_flags(p, verb: str) -> None:
    t = p.add_argument_group("training")
    if verb != "plan":
        t.add_argument("--steps", type=whole(1), help=f"optimizer steps in all (Megatron --train-iters; torchtitan "
                                                      f"training.steps) (default: {DEFAULT_STEPS[verb]})"
                                                      + ("; a run resumed with --resume continues to this step"
                                                         if verb == "train" else ""))
        t.add_argument("--lr", type=real(0.0, open_low=True),
                       help="AdamW learning rate (default: the preset's, e.g. "
                            + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()) + ")")
    t.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE[verb],
                   help="bfloat16: bf16 compute copies of float32 master weights (--autocast: float32 weights under "
                        "autocast); float16: ZeRO's fp16 compute copies with dynamic loss scaling" + (" (a PASS in float64 proves most)" if verb == "check" else ""))
    if verb != "plan":  # (a plan prices bf16 as compute copies: playground/planning.py)
        precision = t.add_mutually_exclusive_group()
        precision.add_argument("--autocast", action="store_true",
                               help="--dtype bfloat16 without --zero: torch.autocast over float32 weights (torch's "
                                    "AMP recipe), each weight cast to bf16 in every forward and its gradient back, "
                                    "instead of the default bf16 compute copies with fp32 master weights")
        precision.add_argument("--bf16-copies", action="store_true",
                               help="--dtype bfloat16: bf16 compute copies of the weights with fp32 master weights "
                                    "(ZeRO's engine, at stage 0 without --zero; Megatron-LM's --bf16): the default, "
                                    "and what plan prices")
    t.add_argument("--reduce-dtype", choices=DTYPES,
                   help="with --zero: the dtype gradients are reduced in (default: the dtype they accumulate in)")
    t.add_argument("--grad-dtype", choices=("float32",),
                   help="beside bf16 or fp16 compute copies (--zero, --bf16-copies, or float16): accumulate the "
                        "gradients in float32 buffers and reduce them in it (Megatron-LM's main grads; default: "
                        "the compute dtype)")
    if verb != "plan":
        t.add_argument("--seed", type=whole(0), default=0, help="seed of the weights and of the data")
        t.add_argument("--data", help="'markov' (a synthetic chain with a known loss floor), a text file (read as "
                                      "bytes), or token ids (.npy of integers, or .bin of uint16) (default: markov)")
        t.add_argument("--compile", action="store_true",
                       help="torch.compile each block (backends torch and gloo; with --ac none or full)")
    if verb == "train":
        t.add_argument("--cuda-graphs", action="store_true",
                       help="replay each MoE layer's compiled region as CUDA graphs, its forward and its backward "
                            "one launch each (--backend torch on a GPU; bfloat16, no pipeline, --ac none, --zero "
                            "below 3, ep, tp and cp 1)")
    t.add_argument("--bucket-mb", type=real(0.0, open_low=True), default=25.0,
                   help="DDP bucket size in MiB (torch DDP's bucket_cap_mb)")
    t.add_argument("--no-grad-overlap", action="store_true",
                   help="reduce the gradients after the backward instead of during it (DDP in one bucket; ZeRO-0/1 "
                        "unit by unit after it), as Megatron-LM did in 2021")
    if verb != "plan":
        t.add_argument("--backend", default="sim", choices=["sim", "gloo", "torch"],
                       help="sim: ranks as threads of this process; gloo: local processes; torch: one rank of a "
                            "torchrun job (NCCL on GPUs)")
    if verb != "check":
        t.add_argument("--no-progress", action="store_true", help="no progress bar" +
                       (" (it shows the last step's tokens/s; the report gives the median)" if verb == "train"
                        else ""))


def _output_flags(p, verb: str) -> None:
    o = p.add_argument_group("simulated time and output" if verb != "check" else "output")
    if verb == "train":
        o.add_argument("--hardware", help=f"simulate time and memory on a profile: {PROFILES} (sim backend)")
        o.add_argument("--count-every-step", action="store_true",
                       help="with --hardware: count the ops of every step (slower) instead of replaying step 2's "
                            "compute")
    if verb == "plan":
        o.add_argument("--hardware", required=True, help=f"the profile the layout is planned on: {PROFILES}")
    if verb != "check":
        o.add_argument("--trace", help="write a Chrome/Perfetto trace of every rank's simulated time to this file "
                                       "(open it in ui.perfetto.dev)" + (" (with --hardware)" if verb == "train"
                                                                         else ""))
    o.add_argument("--plots", help="write PNG plots to this folder" + {
        "train": " (loss, bytes by label, with --hardware the last step's timeline and memory)",
        "check": " (each tensor's error against its tolerance)",
        "plan": " (the step and memory per class of ranks, bytes by label, the timeline, the schedule)"}[verb])
    o.add_argument("--json", help="write a machine-readable summary to this file (schema: docs/json.md)")


def _checkpoint_flags(p, verb: str) -> None:
    k = p.add_argument_group("checkpoints")
    if verb == "train":
        k.add_argument("--save", help="save a checkpoint in this folder at the end (and every --save-every steps)")
        k.add_argument("--save-every", type=whole(1), help="with --save: also every K steps")
        k.add_argument("--overwrite", action="store_true", help="with --save: replace a checkpoint already there")
        k.add_argument("--resume", help="continue from the checkpoint in this folder, in this run's layout (any); "
                                        "'auto': from --save DIR's checkpoint if it holds one, else from the start "
                                        "(so torchrun's --max-restarts continues the run)")
    k.add_argument("--init-from", help="start from a state_dict file of the reference GPT (playground export)")


def _fault_flags(p) -> None:
    f = p.add_argument_group("faults on purpose (train)")
    f.add_argument("--inject", action="append", type=_fault, default=[], metavar="KIND@STEP:RANK",
                   help="a fault at a step (from 1) of a rank, repeatable: crash (the rank raises; crash!: lost for "
                        "good), hang (it stops answering), slow:F (from that step on F times slower), nan (a NaN in "
                        "one of its gradients)")
    f.add_argument("--on-nan", choices=("stop", "skip", "off"), default="stop",
                   help="a NaN or an Inf in the loss or a gradient, found on every rank before the optimizer step: stop "
                        "the run, skip the step on every rank, or do not check (Megatron "
                        "--check-for-nan-in-loss-and-grad)")
    f.add_argument("--timeout", type=real(0.0, open_low=True), metavar="SECONDS",
                   help="a rank waiting longer in one collective stops the run, naming the ranks waiting and the call "
                        "(torch.distributed's timeout, NCCL's watchdog) (default: 600 on gloo and torch; on sim 60, "
                        "or three of the run's estimated steps where longer)")
    f.add_argument("--elastic", type=whole(1), metavar="MIN",
                   help="with --max-restarts: after a rank is lost for good (crash!), continue on fewer ranks, down to "
                        "MIN: one data-parallel replica fewer, the global batch kept by more microbatches, the "
                        "checkpoint resharded (torchrun --nnodes MIN:MAX)")
    f.add_argument("--max-restarts", type=whole(0), default=0,
                   help="after a crash or a hang, restart from the last checkpoint of --save, up to this many times, "
                        "and continue to --steps (torchrun --max-restarts)")


def _fault(text: str):
    from .faults import parse_fault
    try:
        return parse_fault(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--inject ")) from None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("parallelism-playground")
    except PackageNotFoundError:
        return "unknown (not installed)"


def parser() -> Parser:
    p = Parser(prog="playground", description="Distributed training on simulated ranks: every byte counted, every "
                                              "layout checked against one device.",
               epilog="`playground VERB --help` lists each verb's flags with their defaults.")
    p.add_argument("--version", action="version", version=f"playground {_version()}")
    sub = p.add_subparsers(dest="verb", required=True, metavar="{" + ",".join(VERBS) + "}")
    about = {"train": "train and report loss, throughput, bytes per rank, simulated time and memory",
             "check": "prove a layout computes what one device computes (exit status 0 only if it does)",
             "plan": "what a layout would cost on --hardware: every rank's program on meta tensors (no data)"}
    for verb in ("train", "check", "plan"):
        v = sub.add_parser(verb, help=about[verb], description=about[verb])
        _layout_flags(v, verb)
        _training_flags(v, verb)
        _output_flags(v, verb)
        if verb != "plan":
            _checkpoint_flags(v, verb)
        if verb == "train":
            _fault_flags(v)
        if verb == "plan":
            s = v.add_argument_group("planning")
            s.add_argument("--search", action="store_true",
                           help="plan every layout of --world for --global-batch-size (tp, pp, cp, ep, ZeRO, schedule, "
                                "micro-batch size, --ac) and print the fastest that fit; --tp/--pp/--cp/--ep given fix "
                                "those axes")
            s.add_argument("--memory-headroom", type=real(0.0, 1.0), default=DEFAULT_HEADROOM, metavar="F",
                           help="share of HBM a layout must leave free to fit: torch's caching allocator fragments (a 1b "
                                "run at 88%% of an H200 ran out of memory); about 0.02 with PYTORCH_CUDA_ALLOC_CONF="
                                "expandable_segments:True")
            s.add_argument("--checkpoint-gbps", type=real(0.0, open_low=True), default=1.0, metavar="GB/S",
                           help="storage bandwidth per writing rank: what a checkpoint of the layout costs")
            s.add_argument("--mtbf-hours", type=real(0.0, open_low=True), metavar="H",
                           help="mean time between failures of one GPU: the checkpoint interval that gives the most "
                                "goodput (Young 1974, Daly 2006) and that goodput")
            s.add_argument("--restart-seconds", type=real(0.0), default=60.0,
                           help="what restarting the job costs before it reads its checkpoint back (with --mtbf-hours)")
            s.add_argument("--top", type=whole(1), default=10, help="with --search: how many layouts to print")
            s.add_argument("--exact", type=whole(1), default=3,
                           help="with --search: how many of the fastest to plan in full (the others are estimated "
                                "from shallow plans, marked *)")
            s.add_argument("--jobs", type=whole(1), metavar="N",
                           help="with --search: processes that plan layouts at once (default: the CPU count for more "
                                "than 100 candidate layouts, else 1)")
    c = sub.add_parser("calibrate", help="measure this machine's kernels and links and write a hardware profile "
                                         "(--hardware FILE)")
    c.add_argument("--backend", default="torch", choices=["torch", "gloo"],
                   help="torch: every rank of a torchrun job (NCCL on GPUs); gloo: --world local CPU processes")
    c.add_argument("--world", type=whole(2), help="with --backend gloo: the number of processes (required there)")
    c.add_argument("--model", default="1b", choices=sorted(PRESETS), help="the model whose shapes are measured")
    c.add_argument("--micro-batch-size", type=whole(1), default=4, help="sequences per microbatch of those shapes")
    c.add_argument("--base", default="h200-datasheet",
                   help="the profile whose peaks, HBM bandwidth and network are kept (datasheet numbers)")
    c.add_argument("--max-mib", type=real(0.0, open_low=True), default=1024.0, help="largest collective message, MiB")
    c.add_argument("--name", help="the profile's name (default: the --out file's)")
    c.add_argument("--out", required=True, help="the profile file to write (JSON)")
    e = sub.add_parser("export", help="write a checkpoint's weights as the reference GPT's plain state_dict")
    e.add_argument("directory", help="the checkpoint folder")
    e.add_argument("file", help="the state_dict file to write (torch.save; GPT.load_state_dict takes it)")
    e.add_argument("--overwrite", action="store_true", help="replace the file if it exists")
    b = sub.add_parser("bench", help="run a benchmark by name; without a name, list them")
    b.add_argument("name", nargs="?", help="the benchmark (see the list: playground bench)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark script")
    accepted = {verb: {s for a in v._actions for s in a.option_strings if s.startswith("--")}
                for verb, v in sub.choices.items()}  # which verbs take a flag, for the verbs' errors
    for v in (p, *sub.choices.values()):
        v.accepted = accepted
    p.verbs = sub.choices
    return p


def parse(argv: list):
    """The arguments of `argv`; a flag the verb does not take is answered by that verb's
    parser (naming the verb that takes it, or the flag meant)."""
    p = parser()
    args, extra = p.parse_known_args(argv)
    if extra:
        p.verbs[args.verb].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def given(argv: list) -> set:
    """The flags typed on the command line (a default is not given)."""
    out = set()
    for word in argv:
        if word == "--":
            break
        if word.startswith("--"):
            out.add(word.split("=", 1)[0])
    return out
