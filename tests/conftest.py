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
