"""The memory-growth diagnostic (``HYPIC_MEMORY_TRACE``): its second report names what grew
since the first, by object type and by the line that allocated it."""
import tracemalloc
from pathlib import Path

from hypic.memory_trace import MemoryTrace


class Hoarded:
    """Objects a test keeps, so that their count is known."""


def test_a_report_names_the_objects_and_the_line_that_grew(tmp_path: Path) -> None:
    tracemalloc.start(4)
    try:
        trace = MemoryTrace(tmp_path, every_s=60)
        trace.report()  # the baseline
        kept = [Hoarded() for _ in range(5000)]
        trace.report()
    finally:
        tracemalloc.stop()
    (written,) = tmp_path.iterdir()
    first, second = written.read_text().split("=== ")[1:]
    assert "rss=" in first and "malloc=" in first and "objects grown" not in first
    table = second.split("-- objects grown since the first report\n")[1].split("-- allocations")[0]
    grown = {line.split()[1]: int(line.split()[0]) for line in table.splitlines()}
    assert grown["Hoarded"] == 5000
    assert f"{Path(__file__)}:18" in second  # the line that made them, among the allocations that grew
    assert len(kept) == 5000
