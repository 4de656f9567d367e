"""Bad numbers on ``hypic``'s command line are refused by the real CLI in one line, exit status 2,
before any model is loaded."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _hypic(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hypic.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--port", "99999"], "argument --port: must be a port number in 1..65535, got 99999"),
    (["serve", "--threads", "-4"], "argument --threads: must be an integer >= 1, got -4"),
    (["serve", "--seam-width", "-1"], "argument --seam-width: must be an integer >= 0, got -1"),
    (["generate", "--threads", "0", "a prompt"], "argument --threads: must be an integer >= 1, got 0")])
def test_a_bad_number_is_one_line_and_status_2(tiny_checkpoint: Path, argv: list[str], message: str) -> None:
    done = _hypic(*argv, "--model", str(tiny_checkpoint))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [f"hypic {argv[0]}: error: {message} (see hypic {argv[0]} --help)"]
    assert done.stdout == ""  # nothing was loaded or served
