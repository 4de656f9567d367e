"""What ``hypic serve`` refuses about replicas before it starts anything (no Ray, no model): each
in one line naming the flags to change."""
import os
import subprocess
import sys


def test_several_ingresses_without_replicas_are_refused_in_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "hypic.cli", "serve", "--ingress-replicas", "2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--ingress-replicas above 1 needs --dp-size above 1" in done.stderr


def test_replicas_whose_threads_outnumber_the_cpus_are_refused_before_anything_starts() -> None:
    threads = len(os.sched_getaffinity(0)) + 1
    done = subprocess.run([sys.executable, "-m", "hypic.cli", "serve", "--dp-size", str(threads), "--threads", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Ray" not in done.stderr.replace("Ray cluster", "")
    assert done.stderr.strip().splitlines()[-1] == (
        f"hypic: error: --dp-size {threads} x --threads 1 x --tp-size 1 = {threads} threads on {threads - 1} CPU(s): "
        "lower one of them, join a Ray cluster (--ray-address), or pass --allow-cpu-oversubscription")
