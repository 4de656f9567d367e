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


GIB = 2**30


def _serve_args(*argv: str):
    from hypic.cli import _parser
    return _parser().parse_args(["serve", *argv])


def test_the_automatic_state_budget_is_shared_by_the_replicas_on_this_machine() -> None:
    """auto is 40 % of the machine for one instance; replicas on the machine alone split it (a Ray
    cluster's replicas each have their own machine's); what their pools leave caps it."""
    from hypic.cli import _check_memory
    one, two, cluster, tight = (_serve_args(*extra) for extra in (
        (), ("--dp-size", "2"), ("--dp-size", "2", "--ray-address", "10.0.0.1:6379"),
        ("--dp-size", "2", "--public-pool-size", "4G", "--private-pool-size", "3G")))
    for args in (one, two, cluster, tight):
        _check_memory(args, machine=20 * GIB)
    assert one.max_state_memory == cluster.max_state_memory == int(0.4 * 20 * GIB)
    assert two.max_state_memory == int(0.4 * 20 * GIB) // 2
    assert tight.max_state_memory == (20 - 2 * 7) * GIB // 2  # 6 GiB left by the pools, 3 each


def test_replicas_whose_memory_budgets_pass_the_machines_are_refused_in_one_line() -> None:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    pool = f"{memory // 2 // 2**20 + 1}M"  # two replicas' pools alone pass the machine
    done = subprocess.run([sys.executable, "-m", "hypic.cli", "serve", "--dp-size", "2", "--threads", "1",
                           "--allow-cpu-oversubscription", "--public-pool-size", pool, "--private-pool-size", "1M"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Ray" not in done.stderr.replace("Ray cluster", "")
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("hypic: error: --dp-size 2 x (--public-pool-size ") and line.endswith(
        "of memory: lower them, or join a Ray cluster (--ray-address)"), line


def test_a_ttft_slo_without_replicas_is_refused_in_one_line() -> None:
    for option in ("--ttft-slo", "--tbt-slo"):
        done = subprocess.run([sys.executable, "-m", "hypic.cli", "serve", option, "1"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and f"{option} needs --dp-size above 1" in done.stderr
    bad = subprocess.run([sys.executable, "-m", "hypic.cli", "serve", "--dp-size", "2", "--ttft-slo", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ttft-slo: must be > 0, got 0" in bad.stderr
