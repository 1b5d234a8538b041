import os
import sys

# programs.py and reference.py are imported by name, also inside spawned gloo processes
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


def pytest_configure(config):
    """Under pytest-xdist (`-n N`), each of the N worker processes gets its share of the
    cores for torch's intra-op threads: N processes with a thread per core each would
    oversubscribe the cores (on 2 cores, the default tier ran 159 s so and 106 s with a
    thread each). A run without workers keeps torch's default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


@pytest.fixture
def cli(capsys):
    """The `playground` command run in this process (its argument checks need no new
    interpreter): cli(*args) -> (exit status, stdout, stderr)."""
    def run(*args):
        from playground.cli import main
        capsys.readouterr()  # (what the test printed before)
        try:
            status = main([str(a) for a in args])
        except SystemExit as e:  # (argparse's own errors)
            status = e.code
        out = capsys.readouterr()
        return status, out.out, out.err
    return run


@pytest.fixture
def saves_past_the_hooks(monkeypatch):
    """Sabotage: a compiled region on the meta device (model/compiled.py) keeps what its
    partition saves on its autograd node instead of through save_for_backward, as
    AOTAutograd's own runtime keeps some saved tensors: the memory tracker sees none of them."""
    from model import compiled

    class Unseen(compiled._Partitioned):
        @staticmethod
        def forward(ctx, graphs, *tensors):
            got = graphs.forward(*tensors)
            n = len(graphs.differentiable)
            ctx.kept, ctx.graphs, ctx.n_args = got[n:], graphs, len(tensors)
            return tuple(got[:n])

        @staticmethod
        def backward(ctx, *grads):
            tangents = [g for g, d in zip(grads, ctx.graphs.differentiable) if d]
            return (None, *compiled._Backward(ctx.graphs).run(*ctx.kept, *tangents))
    monkeypatch.setattr(compiled, "_Partitioned", Unseen)
