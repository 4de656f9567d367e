"""The shell examples of README.md and docs/*.md, run as a new user would run them (an example
nobody runs drifts: one once promised reuse that its too-short documents could not show).

Cheap ones run for real against the shipped default model: the README's quick-start ``curl`` calls
on a ``hypic serve`` process, the ``hypic generate`` example and the sharing example of
docs/operations.md, each checked for what the text around it claims. Every other ``hypic`` /
``python -m`` command line (sweeps of minutes to hours) is parsed by the real command-line parser,
so a renamed or removed option fails here. A command of a kind this test does not know fails too:
a new example must come with its check.
"""
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hypic.cli import _parser
from hypic_data import synthetic_qa
from hypic.evaluation import scaling
from hypic.server.launch import ServerProcess, start_server

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text()
         for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
SEAMS = 16  # max(w, k - 1) + w at the default w = 8 and the shipped model's conv width 4


def shell_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.DOTALL)


def command_lines(*texts: str) -> list[list[str]]:
    """Every command of every shell block of ``texts`` (default: the README and every page of docs/),
    split into argv lists (comments dropped, ``&&`` split)."""
    commands = []
    for block in [block for text in (texts or PAGES.values()) for block in shell_blocks(text)]:
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:cut])
                words = words[cut + 1:]
    return commands


def _parses(argv: list[str]) -> None:
    """``argv`` as the real parsers read it (SystemExit on a bad option)."""
    if argv[0] == "hypic":
        args, rest = _parser().parse_known_args(argv[1:])
        if args.command == "eval" and args.study == "scaling":
            scaling.parse_args(rest)
        else:
            assert not rest, f"unrecognized arguments {rest} in documented command {argv}"
    elif argv[:3] == ["python", "-m", "hypic_data.synthetic_qa"]:
        synthetic_qa._parse_args(argv[3:])
    elif argv[0] == "pip":
        assert argv in (["pip", "install", "-e", "."], ["pip", "install", "-e", ".[test]"]), argv
    elif argv[0] == "sh":
        assert argv == ["sh", "scripts/system-deps.sh"] and (ROOT / argv[1]).is_file()
        assert "sh scripts/system-deps.sh" in (ROOT / ".ci" / "run").read_text()
    elif argv[0] == "pytest":
        assert argv == ["pytest", "-q"] and "pytest -q" in (ROOT / ".ci" / "run").read_text()
    elif argv[0] != "curl":  # the curl calls run for real below
        pytest.fail(f"documented command {argv} has no check in tests/docs/test_readme.py")


def test_every_documented_command_parses() -> None:
    commands = command_lines()
    assert sum(argv[0] == "hypic" for argv in commands) >= 12  # the blocks were found and read
    for argv in commands:
        _parses(argv)


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(["--log-level", "warning"], tmp_path_factory.mktemp("readme") / "server.log")
    yield server
    server.stop()


def _curl(argv: list[str]) -> dict:
    """The call's JSON answer: run by curl, or, on a machine without it, the same POST
    (``curl -s URL [-H HEADER] -d BODY``)."""
    if shutil.which("curl"):
        return json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout)
    options = dict(zip(argv[3::2], argv[4::2]))
    assert argv[1] == "-s" and set(options) <= {"-H", "-d"} and len(argv) % 2 == 1, argv
    headers = dict([options["-H"].split(": ", 1)]) if "-H" in options else {}
    return httpx.post(argv[2], content=options["-d"], headers=headers, timeout=120).json()


def _local(argv: list[str], server: ServerProcess) -> list[str]:
    return [server.url + "/" + word.rsplit("/", 1)[1] if word.startswith("localhost:30000") else word for word in argv]


def test_quick_start_curl_calls_cache_both_documents(default_server: ServerProcess) -> None:
    """The quick start warms two documents, then sends them reordered: "here both documents are hits"."""
    calls = [argv for argv in command_lines(README) if argv[0] == "curl" and "-H" not in argv]
    assert [argv[2].rsplit("/", 1)[1] for argv in calls] == ["warmup", "generate"]
    outputs = []
    for argv in calls:
        outputs.append(_curl(_local(argv, default_server)))
    counts, meta = outputs[0]["token_counts"], outputs[1]["meta_info"]
    assert all(count > SEAMS for count in counts)  # each has an interior to cache
    assert (meta["segments_hit"], meta["segments_missed"]) == (2, 0)
    assert meta["cached_tokens"] == sum(count - SEAMS for count in counts)  # the two interiors
    assert outputs[1]["text"] and meta["completion_tokens"] <= 8


def test_generate_example_shows_the_reuse_it_promises() -> None:
    """"The second prompt shows the reuse (``cached=``, ``segments hit/missed=2/0``)"."""
    (argv,) = [argv for argv in command_lines() if argv[:2] == ["hypic", "generate"] and "--tp-size" not in argv]
    done = subprocess.run([*argv, "--threads", "1"], capture_output=True, text=True, timeout=300, check=True, cwd=ROOT)
    reports = re.findall(r"cached=(\d+) .* segments hit/missed=(\d+)/(\d+)", done.stdout)
    assert [(hit, missed) for _, hit, missed in reports] == [("0", "2"), ("2", "0")], done.stdout
    assert int(reports[0][0]) == 0 < int(reports[1][0])
    assert "segments hit/missed=2/0" in OPERATIONS and "cached=" in OPERATIONS


def test_sharing_example_serves_keys_and_namespaces(tmp_path: Path) -> None:
    """The sharing example's server, started as written (its keys file made here), answers the
    example's call with a key and refuses it without one."""
    (serve,) = [argv for argv in command_lines() if "--api-key-file" in argv]
    (call,) = [argv for argv in command_lines() if argv[0] == "curl" and "-H" in argv]
    key = "sk-readme-3f9a"
    (tmp_path / "keys.txt").write_text(key + "\n")
    args = [str(tmp_path / "keys.txt") if word == "keys.txt" else word for word in serve[2:]]
    server = start_server([*args, "--log-level", "warning"], tmp_path / "server.log")
    try:
        call = [word.replace("$KEY", key) for word in _local(call, server)]
        answer = _curl(call)
        assert answer["text"] and answer["meta_info"]["prompt_tokens"] > 0, answer
        header = call.index("-H")
        refused = _curl(call[:header] + call[header + 2:])
        assert refused["error"]["code"] == "invalid_api_key"
    finally:
        server.stop()


def test_readme_front_page_keeps_the_two_quick_start_commands() -> None:
    """A fresh machine's two commands, exactly: run the server, and run the tests as CI does."""
    blocks = shell_blocks(README)
    assert "pip install -e . && hypic serve\n" in blocks
    test_command = 'sh scripts/system-deps.sh && pip install -e ".[test]" && pytest -q\n'
    assert test_command in blocks
    assert test_command in (ROOT / ".ci" / "run").read_text()


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_pages_resolve() -> None:
    """Every relative link of the README and docs/ names a file that exists, and a heading of it."""
    for name, text in PAGES.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            file = (ROOT / name).parent / path if path else ROOT / name
            assert file.exists(), f"{name} links to {target}: no such file"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", file.read_text(), re.MULTILINE)
                assert anchor in {_anchor(h) for h in headings}, f"{name} links to {target}: no such heading"
