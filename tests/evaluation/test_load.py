"""``hypic eval load``: the trace's statistics in closed form, the capacity interpolation, and tiny
runs against real ``hypic serve`` processes that resume without restarting servers."""
import argparse
import json
import socket
import statistics
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import hypic.server.launch as launch
from hypic import DEFAULT_SEPARATOR
from hypic.cli import main
from hypic.evaluation.load import add_arguments, capacities, capacity_ratios, qps_at_slo, serving
from hypic.evaluation.methods import Method
from hypic.evaluation.trace import Trace, TraceConfig, TraceError


def test_prod_rag_trace_is_deterministic_zipf_skewed_and_sized() -> None:
    config = TraceConfig(documents=20, docs_per_request=4, mean_input_words=400, zipf=1.1, seed=3)
    trace = Trace(config)
    prompts = trace.prompts(400, 1)
    assert prompts == Trace(config).prompts(400, 1) and prompts != trace.prompts(400, 2)
    assert all(p.count(DEFAULT_SEPARATOR) == 4 + 1 for p in prompts)  # L, 4 documents, Q
    counts = [sum(doc in p for p in prompts) for doc in trace.documents]
    assert counts[0] > 3 * counts[-1]  # rank 1 is far more popular than rank 20
    words = [len(doc.split()) for doc in trace.documents]
    assert min(words) >= 0.5 * 100 - 1 and max(words) <= 1.5 * 100 + 1  # uniform in [0.5, 1.5] x 400 / 4
    assert statistics.mean(words) == pytest.approx(100, rel=0.15)
    assert TraceConfig(workload="shared-prefix").workload == "shared-prefix"
    plain = Trace(TraceConfig(workload="shared-prefix", groups=3, system_words=30)).prompts(60, 1)
    assert len(set(plain)) == 60 and not any(DEFAULT_SEPARATOR in p for p in plain)


@pytest.mark.parametrize("burstiness", [1.0, 2.0])
def test_arrivals_have_the_rate_and_burstiness_asked_for(burstiness: float) -> None:
    trace = Trace(TraceConfig(burstiness=burstiness))
    times = trace.arrivals(40_000, qps=4.0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and statistics.mean(gaps) == pytest.approx(1 / 4, rel=0.03)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(burstiness, rel=0.06)
    slower = trace.arrivals(100, qps=2.0)
    assert slower == pytest.approx([2 * t for t in times[:100]])  # one trace, rescaled per QPS level


def test_bad_trace_parameters_are_refused() -> None:
    for bad in (dict(docs_per_request=50), dict(workload="chat"), dict(burstiness=0), dict(mean_input_words=3)):
        with pytest.raises(TraceError):
            TraceConfig(**bad)
    with pytest.raises(TraceError, match="QPS"):
        Trace(TraceConfig()).arrivals(3, qps=0)


def _row(method: str, qps: float, p50: float) -> dict:
    return {"method": method, "qps": qps, "ttft_p50_s": p50}


def test_capacity_interpolates_log_linearly_and_marks_lower_bounds() -> None:
    # p50 goes 0.25 -> 4 (factor 16) while QPS goes 1 -> 4: p50 = 1 is halfway in log space, QPS 2
    assert qps_at_slo([_row("m", 1, 0.25), _row("m", 4, 4.0)], 1.0) == (pytest.approx(2.0), False)
    assert qps_at_slo([_row("m", 1, 2.0)], 1.0) == (None, False)
    assert qps_at_slo([_row("m", 1, 0.1), _row("m", 2, 0.2)], 1.0) == (2, True)
    # a level back under the SLO past the first crossing (noise) does not count: still QPS 2
    assert qps_at_slo([_row("m", 1, 0.25), _row("m", 4, 4.0), _row("m", 8, 0.5), _row("m", 16, 2.0)],
                      1.0) == (pytest.approx(2.0), False)
    assert qps_at_slo([_row("m", 1, 1.5), _row("m", 2, 0.5)], 1.0) == (None, False)  # over it from the start
    rows = [_row("hypic:8", 1, 0.1), _row("hypic:8", 2, 0.2), _row("prefix", 1, 0.5), _row("prefix", 4, 2.0),
            _row("full", 1, 0.9)]
    capacity = capacities(rows, 1.0)
    assert capacity["prefix"] == {"qps": pytest.approx(2.0), "lower_bound": False}
    assert capacity_ratios(capacity) == {"hypic:8 / prefix": ">= 1.00x"}  # full's is only a lower bound


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


LOAD = ["--qps", "8", "16", "--requests", "4", "--warm-requests", "2", "--mean-input-words", "48",
        "--documents", "6", "--docs-per-request", "3", "--output-tokens", "2", "--no-progress"]


def test_load_runs_servers_records_every_request_and_resumes(tiny_checkpoint: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []
    real_start = launch.start_server

    def counting_start(args: list[str], *rest: object, **options: object) -> launch.ServerProcess:
        started.append(args)
        return real_start(args, *rest, **options)

    monkeypatch.setattr(launch, "start_server", counting_start)
    args = ["eval", "load", "--model", str(tiny_checkpoint), "--methods", "hypic:4", "full", "--out", str(tmp_path),
            *LOAD]
    assert main(args) == 0
    assert [a[:4] for a in started] == [["--mode", "hypic", "--seam-width", "4"], ["--mode", "full", "--seam-width", "8"]]
    records = _lines(tmp_path / "load.jsonl")
    assert len(records) == 2 * 2 * 4 and all(r["ok"] and r["ttft_source"] == "client" for r in records)
    # the server's TTFT (from the request's arrival) is the one its client saw: never more, within 50 ms
    # at the median; a single request's gap is the scheduling of two servers and a client on two cores
    # (65 ms seen once at 8 QPS), bounded by 250 ms
    gaps = sorted(r["ttft_s"] - r["server_ttft_s"] for r in records)
    assert all(r["server_ttft_s"] <= r["ttft_s"] for r in records), records
    assert gaps[len(gaps) // 2] <= 0.05 and gaps[-1] <= 0.25, gaps
    assert all(r["cached_tokens"] == 0 for r in records if r["method"] == "full")
    summary = json.loads((tmp_path / "load_summary.json").read_text())
    for row in summary["rows"]:
        assert row["failed"] == 0 and row["ttft_p50_s"] <= row["ttft_p90_s"] <= row["ttft_p99_s"]
        assert (row["hit_rate"] > 0.3) == (row["method"] == "hypic:4")  # warm documents are spliced
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    started.clear()
    assert main(args) == 0 and started == []  # every level is recorded: no server starts
    assert _lines(tmp_path / "load.jsonl") == records
    kept = [r for r in records if not (r["method"] == "full" and r["qps"] == 16)]
    (tmp_path / "load.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert main(args) == 0
    assert [a[1] for a in started] == ["full"]  # only the missing level ran again
    assert len(_lines(tmp_path / "load.jsonl")) == len(records)


def test_load_against_a_running_server_uses_its_mode(tiny_checkpoint: Path, tmp_path: Path) -> None:
    server = launch.start_server(["--model", str(tiny_checkpoint), "--mode", "hypic", "--seam-width", "2"],
                                 tmp_path / "server.log")
    try:
        assert main(["eval", "load", "--url", server.url, "--out", str(tmp_path), *LOAD]) == 0
    finally:
        server.stop()
    records = _lines(tmp_path / "load.jsonl")
    assert {r["method"] for r in records} == {"hypic:2"} and len(records) == 2 * 4 and all(r["ok"] for r in records)


@pytest.mark.parametrize("bad, message", [
    (["--qps", "0"], "--qps levels must be > 0"),
    (["--docs-per-request", "99"], "--docs-per-request"),
    (["--methods", "fast"], "unknown method 'fast'"),
    (["--url", "http://127.0.0.1:9"], "cannot reach the server"),
    (["--url", "http://127.0.0.1:9", "--port", "9"], "with --url nothing is started and the port is the URL's"),
    (["--port", "0"], "--port must be in 1..65535"),
    (["--methods", "hypic-bf16"], "hypic-bf16 runs in process only"),
])
def test_bad_load_input_is_a_clear_error(bad: list[str], message: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "load", "--out", str(tmp_path), "--no-progress", *bad]) == 2
    assert message in capsys.readouterr().err


def _load_args(*options: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(options))


def test_port_is_where_the_started_server_listens(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """``--port P``: the server started for a method answers on 127.0.0.1:P (asked there directly, not
    through the study's client) in that method's mode, and nothing answers there once it is stopped."""
    port = launch.free_port()
    args = _load_args("--model", str(tiny_checkpoint), "--port", str(port))
    assert args.port == port and _load_args().port is None  # default: a free port per server
    with serving(Method("hypic", 2), args, tmp_path) as target:
        assert target.url == f"http://127.0.0.1:{port}" and target.method == Method("hypic", 2)
        info = httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=30).json()
        assert (info["mode"], info["seam_width"]) == ("hypic", 2)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A port something else listens on for the test's duration."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_in_use_is_refused_before_a_server_starts(listening_port: int, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Another server there would answer the new one's health check: refused, pointing at --url."""
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a server process was started")

    monkeypatch.setattr("subprocess.Popen", refuse)
    assert main(["eval", "load", "--port", str(listening_port), "--out", str(tmp_path), *LOAD]) == 2
    err = capsys.readouterr().err
    assert f"port {listening_port} is in use" in err and f"--url http://127.0.0.1:{listening_port}" in err
