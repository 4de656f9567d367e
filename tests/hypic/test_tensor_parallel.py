"""Tensor parallelism around the model (every family's model: test_tensor_parallel_families.py): a rank
that dies, refused sizes, stored shards per rank, and an engine group driven from one process, each
against one process (TP=1)."""
import re

import pytest

from hypic.parallel import TensorParallel
from hypic.parallel.launch import run_ranks
from hypic_testing import tp as rank_code



def test_a_rank_killed_mid_collective_fails_the_group_quickly_and_leaves_no_process() -> None:
    import time
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 died"):
        run_ranks(rank_code.dies_on_rank_one, 2)
    assert time.monotonic() - start < 30
    time.sleep(0.5)
    assert not _live_children()


@pytest.mark.parametrize(("follow", "cause"), [(rank_code.dies_on_rank_one, r"rank 1 \(pid \d+\) died"),
                                              (rank_code.stops_on_rank_one, r"rank 1 \(pid \d+\) hangs")])
def test_a_rank_that_dies_or_hangs_under_rank_zero_here_fails_the_group_naming_it(follow, cause: str,
                                                                                 monkeypatch) -> None:
    """This process as rank 0 (``hypic eval --tp-size``): a follower killed or stopped while rank 0
    waits for it in a collective fails the group within 15 s (a hang: ``HYPIC_RANK_HANG_S`` of 6 s,
    against 20 by default), naming the rank; no process is left."""
    import time
    from hypic.parallel.group import GroupFailure
    from hypic.parallel.ranks import run_as_rank_zero
    monkeypatch.setenv("HYPIC_RANK_HANG_S", "6")
    start = time.monotonic()
    with pytest.raises(GroupFailure, match=cause):
        run_as_rank_zero(follow, 2)
    assert time.monotonic() - start < 15
    time.sleep(0.5)
    assert not _live_children()


def test_a_follower_that_dies_before_joining_fails_the_group_in_seconds_not_at_the_rendezvous_timeout() -> None:
    """A follower that exits before it joins (here: refused thread count; in life an import error, an
    out-of-memory kill while loading) no longer holds rank 0 in the rendezvous for 300 s."""
    import time
    from hypic.parallel.group import GroupFailure
    from hypic.parallel.ranks import run_as_rank_zero
    start = time.monotonic()
    with pytest.raises(GroupFailure, match=r"rank 1 \(pid \d+\) died \(exit code 1\)"):
        run_as_rank_zero(rank_code.dies_on_rank_one, 2, threads=0)  # torch.set_num_threads(0) raises
    assert time.monotonic() - start < 30
    time.sleep(0.5)
    assert not _live_children()


def _live_children() -> list[int]:
    """Processes (not zombies) whose parent is this test process, but multiprocessing's resource tracker
    (one per parent, kept for its whole life)."""
    import os
    from pathlib import Path
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == str(os.getpid()) and fields[0] != "Z" and b"resource_tracker" not in _cmdline(entry):
            found.append(int(entry.name))
    return found


def _cmdline(entry) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""


def test_heads_that_do_not_divide_the_ranks_are_refused_naming_the_count(checkpoint_factory) -> None:
    from hypic.errors import UnsupportedModel
    from hypic.loading.loader import load_model
    with pytest.raises(UnsupportedModel, match=r"num_attention_heads = 4 is not divisible by the tensor-parallel size 3"):
        load_model(checkpoint_factory("qwen3_5_text-ratio2"), tp=TensorParallel(0, 3))


def test_a_restart_on_the_same_cache_dir_hits_each_rank_shard_and_another_tp_size_misses(checkpoint_factory,
                                                                                           tmp_path) -> None:
    path, cache_dir = str(checkpoint_factory("qwen3_5_text-ratio2")), str(tmp_path / "cache")
    first = run_ranks(rank_code.pic_through_disk, 2, path, cache_dir)
    again = run_ranks(rank_code.pic_through_disk, 2, path, cache_dir)  # new processes: only the disk remembers
    alone = rank_code.pic_through_disk(TensorParallel(), path, cache_dir)
    documents = first[0][2]
    assert documents > 0 and first[0][1] == 0
    assert all(rank == (first[0][0], documents, 0) for rank in again)  # every document a hit, same answer
    assert alone == (first[0][0], 0, documents)  # one process never reads a rank's shard as a whole entry


def test_an_engine_group_driven_from_one_process_answers_as_one_engine(checkpoint_factory) -> None:
    from hypic.engine import Engine
    from hypic.errors import HypicError
    path = checkpoint_factory("qwen3_5_text-ratio2")
    prompt = rank_code.PROMPTS[1][0]
    alone = Engine.from_pretrained(path, dtype="float32")
    expected = [alone.generate(prompt, max_new_tokens=6) for _ in range(2)]
    with Engine.from_pretrained(path, dtype="float32", tp_size=2) as group:
        got = [group.generate(prompt, max_new_tokens=6) for _ in range(2)]
        with pytest.raises(HypicError, match="decode_step is not served"):
            group.decode_step(None, 0)
        with pytest.raises(HypicError, match="serves mode hypic, not full"):  # one mode per group, as a server's
            group.generate(prompt, mode="full", max_new_tokens=6)
    assert [(r.output_ids, r.cached_tokens, r.segments_hit, r.segments_missed) for r in got] == \
        [(r.output_ids, r.cached_tokens, r.segments_hit, r.segments_missed) for r in expected]
    assert got[0].segments_missed > 0 and got[1].cached_tokens > 0  # built, then reused, on both ranks


def test_an_unseeded_sample_is_the_same_on_every_rank(checkpoint_factory) -> None:
    first, second = run_ranks(rank_code.unseeded_sample, 2, str(checkpoint_factory("qwen3_5_text-ratio2")))
    assert first == second


def test_a_failure_on_a_follower_alone_fails_the_engine_group_fast(checkpoint_factory, monkeypatch) -> None:
    """A follower whose call fails while rank 0's succeeds leaves the group out of step: rank 0 raises
    at once (not at a later collective that would hang), the follower exits."""
    import os
    import time
    from pathlib import Path
    from hypic.engine import Engine
    from hypic.errors import HypicError
    helpers = Path(rank_code.__file__).parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(helpers / "faults"), str(helpers.parents[1]),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HYPIC_TEST_FAULT", "follower_warmup")
    group = Engine.from_pretrained(checkpoint_factory("qwen3_5_text-ratio2"), dtype="float32", tp_size=2)
    start = time.monotonic()
    with pytest.raises(HypicError, match="cannot go on"):
        group.warmup(["a document long enough to be cached on every rank " * 2])
    with pytest.raises(HypicError, match="out of step"):
        group.generate("next", max_new_tokens=2)
    group.close()
    assert time.monotonic() - start < 30
    time.sleep(0.5)
    assert not _live_children()


def _group_raises_within(call, seconds: float) -> Exception | None:
    """What ``call()`` raised, run on a thread given ``seconds`` to end (None: it returned; it must end)."""
    import threading
    raised: list[Exception | None] = []

    def run() -> None:
        try:
            call()
            raised.append(None)
        except Exception as err:  # noqa: BLE001 - handed to the test
            raised.append(err)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert raised, f"the call neither returned nor raised within {seconds} s"
    return raised[0]


@pytest.mark.parametrize(("stop", "cause"), [("SIGKILL", r"rank 1 \(pid \d+\) died"),
                                            ("SIGSTOP", r"rank 1 \(pid \d+\) hangs")])
def test_a_follower_killed_or_stopped_fails_the_engine_group_naming_it_and_leaves_no_process(
        checkpoint_factory, stop: str, cause: str, monkeypatch) -> None:
    """The next call after a follower is killed, or a call pending while it is stopped, raises within 15 s
    (a hang: ``HYPIC_RANK_HANG_S`` of 6 s) naming the rank; so does every later one; this process goes
    on, and no rank is left."""
    import os
    import signal
    import time
    from hypic.engine import Engine
    from hypic.errors import HypicError
    monkeypatch.setenv("HYPIC_RANK_HANG_S", "6")
    group = Engine.from_pretrained(checkpoint_factory("qwen3_5_text-ratio2"), dtype="float32", tp_size=2)
    try:
        assert group.generate("before", max_new_tokens=2).output_ids  # the group runs
        start = time.monotonic()
        os.kill(group.ranks.pids[0], getattr(signal, stop))
        raised = _group_raises_within(lambda: group.generate("after", max_new_tokens=2), 15)
        assert isinstance(raised, HypicError), raised
        assert re.search(cause, str(raised)) and "cannot go on" in str(raised)
        with pytest.raises(HypicError, match=cause):
            group.warmup(["a document long enough to be cached on every rank " * 2])
    finally:
        group.close()
    assert time.monotonic() - start < 15
    time.sleep(0.5)
    assert not _live_children()


@pytest.mark.parametrize(("value", "says"), [("soon", "must be a number of seconds, got soon"),
                                             ("0.5", "must be at least 1 s")])
def test_a_bad_rank_hang_bound_is_refused_naming_the_variable(monkeypatch, value: str, says: str) -> None:
    from hypic.errors import HypicError
    from hypic.parallel.ranks import hang_s
    monkeypatch.setenv("HYPIC_RANK_HANG_S", value)
    with pytest.raises(HypicError, match=f"HYPIC_RANK_HANG_S {says}"):
        hang_s()
