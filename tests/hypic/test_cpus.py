"""The cores a process may compute on, read from a CPU topology laid out as Linux's sysfs lays it out."""
from pathlib import Path

from hypic.cpus import parse_cpu_list, physical_cores


def _topology(root: Path, siblings: dict[int, str]) -> Path:
    """A fake /sys/devices/system/cpu: each CPU's thread_siblings_list."""
    for cpu, listed in siblings.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(listed + "\n")
    return root


def test_hyper_threads_of_one_core_count_once(tmp_path: Path) -> None:
    # 4 cores with 2 threads each, numbered as Intel machines do: core i holds CPUs i and i + 4
    sysfs = _topology(tmp_path, {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)})
    assert physical_cores(set(range(8)), sysfs) == 4
    assert physical_cores({0, 4}, sysfs) == 1  # both threads of core 0
    assert physical_cores({0, 1, 5}, sysfs) == 2  # an affinity mask of three CPUs on two cores


def test_ranges_and_unreadable_topologies(tmp_path: Path) -> None:
    sysfs = _topology(tmp_path, {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"})
    assert physical_cores({0, 1, 2, 3}, sysfs) == 2
    assert physical_cores({0, 1, 2, 3}, tmp_path / "missing") == 4  # no topology: every CPU is a core
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
