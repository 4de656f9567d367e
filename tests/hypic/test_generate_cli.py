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


def _answers(out: str) -> list[str]:
    """Each prompt's text and counts, without its timing."""
    return [line.split(" ttft=")[0] for line in out.splitlines()]


def test_generate_over_two_ranks_answers_as_one_process(tiny_checkpoint: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    prompts = [f"system{SEP} a document about owls{SEP} which bird?", "plain words, then"] * 2
    argv = ["generate", "--model", str(tiny_checkpoint), "--max-new-tokens", "4", "--dtype", "float32", *prompts]
    assert cli.main(argv) == 0
    one = _answers(capsys.readouterr().out)
    assert cli.main([*argv, "--tp-size", "2"]) == 0
    assert _answers(capsys.readouterr().out) == one
    counts = [line for line in one if "cached=" in line]
    assert "cached=0 " in counts[0] and "cached=0 " not in counts[2]  # the repeated PIC prompt hit the cache


def test_generate_refuses_a_tp_size_the_heads_do_not_divide(tiny_checkpoint: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "--model", str(tiny_checkpoint), "--tp-size", "3", "x"]) == 2
    assert "num_attention_heads = 4 is not divisible by the tensor-parallel size 3" in capsys.readouterr().err
