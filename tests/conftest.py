import os
import sys

# programs.py and reference.py are imported by name, also inside spawned gloo processes
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402


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
