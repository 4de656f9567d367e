"""``hypic generate``: its timings are the prompts' own, not the process's one-time warm-up."""
from pathlib import Path
from typing import Any

import pytest

import hypic.cli as cli
import hypic.cpus as cpus
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



@pytest.mark.parametrize(("argv", "threads"), [([], 6), (["--threads", "2"], 2)])
def test_generate_runs_on_the_physical_cores_it_may_use(tiny_checkpoint: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, argv: list[str],
                                                       threads: int) -> None:
    """Without --threads, one torch thread per physical core the process may use (here a fake
    topology of 6 cores of 2 threads each), not torch's count of the machine's logical CPUs."""
    for cpu in range(12):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(f"{cpu % 6},{cpu % 6 + 6}")
    monkeypatch.setattr(cpus, "allowed_cpus", lambda: set(range(12)))
    monkeypatch.setattr(cpus, "CPU_SYSFS", tmp_path)
    seen: list[int] = []

    def engine(args: Any, *_: Any, **__: Any) -> Engine:
        seen.append(args.threads)
        raise cli.HypicError("stopped before loading")

    monkeypatch.setattr(cli, "_engine", engine)
    assert cli.main(["generate", "--model", str(tiny_checkpoint), *argv, "x"]) == 2
    assert seen == [threads]
