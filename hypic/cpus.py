"""How many cores this process may compute on: the physical cores among the CPUs it is allowed to
run on (its affinity mask: a container's or ``taskset``'s share, not the whole machine). Threads
of one core share its arithmetic units, so torch runs no faster with a thread per hyper-thread."""
import os
from pathlib import Path

CPU_SYSFS = Path("/sys/devices/system/cpu")


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int] | None = None, sysfs: Path | None = None) -> int:
    """The distinct cores ``cpus`` (default: ``allowed_cpus()``) lie on: CPUs listed in each other's
    ``topology/thread_siblings_list`` (under ``sysfs``, default ``CPU_SYSFS``) are one core. A CPU
    whose topology cannot be read counts as a core of its own."""
    folder = CPU_SYSFS if sysfs is None else sysfs
    cores = {_siblings(cpu, folder) for cpu in (allowed_cpus() if cpus is None else cpus)}
    return max(1, len(cores))


def _siblings(cpu: int, sysfs: Path) -> frozenset[int]:
    try:
        return frozenset(parse_cpu_list((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()))
    except (OSError, ValueError):
        return frozenset({cpu})


def parse_cpu_list(text: str) -> set[int]:
    """The kernel's CPU list format: '0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for item in text.strip().split(","):
        first, _, last = item.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus
