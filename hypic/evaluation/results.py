"""Per-sample results as JSONL, appended as they are made: a rerun skips what is already there."""
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
Key = tuple[str, str, str]  # dataset, sample id, method label


class ResultLog:
    """The records of one study's file (``path``), keyed by dataset, sample and method."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: dict[Key, dict[str, Any]] = {}
        if path.is_file():
            self._read()

    def _read(self) -> None:
        for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                record = json.loads(line)
                self.records[(record["dataset"], record["sample"], record["method"])] = record
            except (json.JSONDecodeError, KeyError, TypeError):  # e.g. a line cut by a crash: redone
                log.warning("%s:%d: unreadable result line skipped (its sample runs again)", self.path, number)

    def get(self, key: Key) -> dict[str, Any] | None:
        return self.records.get(key)

    def add(self, record: dict[str, Any]) -> None:
        """Keep ``record`` and append it to the file at once (a crash loses at most the sample in flight)."""
        self.records[(record["dataset"], record["sample"], record["method"])] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
