"""A commit checked out beside this tree (a git worktree), for the eval scripts that measure a
baseline commit in the same run as this tree, and removed again."""
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout(rev: str) -> Path:
    """``rev`` in a detached worktree of its own, in a new temporary folder."""
    tree = Path(tempfile.mkdtemp()) / "baseline"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), rev], check=True,
                   capture_output=True)
    return tree


def remove(tree: Path) -> None:
    """The worktree at ``tree`` gone (git forgets it too); a failure is left alone."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False,
                   capture_output=True)
