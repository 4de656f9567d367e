"""``hypic serve --dp-size 2 --tp-size 2``: two replicas, each a lockstep group of two ranks. A
replica split over ranks answers as one engine does (tensor parallelism is exact up to float32
reduction order, and greedy tokens are compared), so the oracle is one in-process engine per replica
that ran the same requests; each replica must hold a shard of the model, not all of it."""
from collections.abc import Iterator

import pytest

from hypic import Engine
from hypic.server.launch import ServerProcess, start_server

from .test_replicas import Replay, _generate, _prompt


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("replicas_tp") / "server.log"
    process = start_server(["--dp-size", "2", "--tp-size", "2", "--dtype", "float32", "--log-level", "warning",
                            "--allow-cpu-oversubscription"],  # four ranks on a 2-core machine
                           log, threads=1, timeout_s=300)
    yield process
    process.stop()


def test_replicas_of_two_ranks_answer_as_one_engine_and_follow_their_documents(cluster: ServerProcess) -> None:
    """Documents 0-2, then the same in another order: the second request goes to the replica that
    holds them and hits all three; every answer, hit and miss equals one engine's."""
    cluster.post("/flush_cache", {})
    replay, replicas = Replay(), []
    for indices in ([0, 1, 2], [2, 0, 1], [3, 4]):
        replicas.append(replay.check(_generate(cluster, _prompt(indices)), _prompt(indices))["replica"])
    assert replicas[1] == replicas[0]


def test_each_replica_holds_a_shard_of_the_model(cluster: ServerProcess) -> None:
    """/get_server_info: two replicas of two ranks; the weight bytes one rank holds are those of a
    shard: less than the whole model's (counted here in float32), more than half of it (embeddings
    and norms are held whole)."""
    info = cluster.get("/get_server_info")
    assert info["data_parallel"]["dp_size"] == 2 and info["tensor_parallel"]["tp_size"] == 2
    replicas = info["data_parallel"]["replicas"]
    assert len({r["pid"] for r in replicas}) == 2 and all(r["healthy"] for r in replicas)
    model = Engine.from_pretrained("default", dtype="float32").model
    whole = sum(t.numel() * 4 for t in (*model.parameters(), *model.buffers()))
    shard = info["tensor_parallel"]["per_rank"]["weight_bytes"]
    assert whole / 2 < shard < whole
    assert all(r["weight_bytes"] == shard for r in replicas)
