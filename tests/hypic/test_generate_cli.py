"""``hypic generate``: its timings are the prompts' own, not the process's one-time warm-up."""
from pathlib import Path
from typing import Any

import pytest

import hypic.cli as cli
from hypic import DEFAULT_SEPARATOR as SEP, Engine


def test_generate_warms_the_model_before_its_timed_prompts_and_keeps_nothing_of_it(
        tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    engines: list[Engine] = []
    make, generate = cli._engine, Engine.generate
    monkeypatch.setattr(cli, "_engine", lambda *args, **options: engines.append(make(*args, **options)) or engines[-1])
    namespaces: list[str] = []

    def recorded(self: Engine, prompt: str, **options: Any):
        namespaces.append(options.get("namespace", ""))
        return generate(self, prompt, **options)

    monkeypatch.setattr(Engine, "generate", recorded)
    prompt = f"system{SEP} a document about owls{SEP} which bird?"
    assert cli.main(["generate", "--model", str(tiny_checkpoint), "--max-new-tokens", "2", prompt, prompt]) == 0
    out = capsys.readouterr()
    assert namespaces == [cli.WARM_UP_NAMESPACE, "", ""]  # warmed first, apart from the prompts
    assert "warm-up:" in out.err and "not in the timings below" in out.err
    first, second = [line for line in out.out.splitlines() if "cached=" in line]
    assert "cached=0 " in first and "cached=0 " not in second  # the first prompt is cold, as without a warm-up
    public, private, _ = engines[0].flush(cli.WARM_UP_NAMESPACE)
    assert (public, private) == (0, 0)  # the warm-up's entries were dropped
