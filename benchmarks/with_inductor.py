"""`playground` with TorchInductor's options set, for GPU experiments on what the model
compiles (the MoE layer's region: model/compiled.py), under torchrun:

    torchrun --nproc_per_node 1 benchmarks/with_inductor.py cpp_wrapper=1 -- train --model 1b-moe ...
    torchrun --nproc_per_node 1 benchmarks/with_inductor.py cpp_wrapper=1 -- benchmarks/gpu_profile.py ...

Each NAME=VALUE before `--` sets `torch._inductor.config.NAME` (VALUE read as a Python
literal where it is one) before the command runs; the rest is playground's command line,
or a script (a path ending in .py) and its arguments.
An unknown name is refused in one line. (Inductor's cpp_wrapper: the compiled graph's
kernels launched from generated C++ instead of a Python wrapper, the host cost per call
the MoE region's profile blames; torch.compile's documentation, "cpp_wrapper".)
"""
import ast
import os
import runpy
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list) -> int:
    if "--" not in argv:
        sys.exit("with_inductor: usage: with_inductor.py NAME=VALUE ... -- PLAYGROUND-ARGS")
    split = argv.index("--")
    import torch._inductor.config as inductor

    for item in argv[:split]:
        name, _, text = item.partition("=")
        if not hasattr(inductor, name):
            sys.exit(f"with_inductor: torch._inductor.config has no option {name!r}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        setattr(inductor, name, value)
        print(f"with_inductor: torch._inductor.config.{name} = {value!r}", flush=True)
    rest = argv[split + 1:]
    if rest and rest[0].endswith(".py"):
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")
        return 0
    from playground.cli import main as playground

    return playground(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
