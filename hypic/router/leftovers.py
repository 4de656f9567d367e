"""What a local Ray runtime leaves if its start or stop is cut short: processes of its own below this
one that outlive ``ray.shutdown`` (Ray's agents, once the raylet that started them was killed, are
left to the init process), and its session folder, named after the process that started it."""
import contextlib
import os
import signal
import time
from pathlib import Path

RAY_NAMES = ("gcs_server", "raylet")  # Ray's daemons; its workers and agents are named ray::...
PACKAGES = ("site-packages", "dist-packages")  # where Ray's own scripts (log monitor) are run from
GRACE_S = 1.0  # a process sent SIGTERM has this long to exit before it is sent SIGKILL


def _processes(proc: Path) -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, command name, command line) of every process (read from ``proc``)."""
    found = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found[int(entry.name)] = (int(stat[stat.rindex(")") + 2 :].split()[1]),
                                          stat[stat.index("(") + 1 : stat.rindex(")")], line)
    return found


def _of_ray(name: str, line: str) -> bool:
    return name in RAY_NAMES or name.startswith("ray::") or any(f"/{d}/ray/" in line for d in PACKAGES)


def ray_processes_below(root: int, proc: Path = Path("/proc")) -> list[int]:
    """Ray's processes below ``root``, reached through Ray's processes alone: its daemons, its ``ray::``
    workers and agents, and Python processes running one of Ray's own scripts (log monitor); not the
    runtime of another program this process started (a server in a test), nor what is below it."""
    table = _processes(proc)
    below, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, (parent, name, line) in table.items()
                    if parent in frontier and _of_ray(name, line)} - below
        below |= frontier
    return sorted(below)


def processes_naming(folders: list[Path], proc: Path = Path("/proc")) -> list[int]:
    """Processes whose command line names one of ``folders`` (a Ray session's daemons and agents name
    it, also once they were left to the init process)."""
    names = [str(folder) for folder in folders]
    return sorted(pid for pid, (_, _, line) in _processes(proc).items()
                  if pid != os.getpid() and any(n in line for n in names))


def end_processes(pids: list[int], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM to each of ``pids`` still alive, then SIGKILL to those alive after ``grace_s``; the
    pids that had to be killed."""
    alive = [pid for pid in pids if _signal(pid, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if _signal(pid, 0)]
    return [pid for pid in alive if _signal(pid, signal.SIGKILL)]


def _signal(pid: int, sig: int) -> bool:
    """Send ``sig`` (0: none, only look); False if the process is gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process that took the pid since: not ours
        return False
    return True


def sessions_of(pid: int, temp_dir: Path) -> list[Path]:
    """The session folders under ``temp_dir`` of Ray runtimes that process ``pid`` started (Ray
    names each session after its start time and the starting process)."""
    return sorted(temp_dir.glob(f"session_*_{pid}")) if temp_dir.is_dir() else []
