"""Moving one document's cache entry between two worker processes: Ray's object store (what
``hypic.router`` uses) against point-to-point ``torch.distributed`` (gloo) into a buffer the
receiver allocated up front.

Three ways: Ray's object store with torch's own pickling, the same with ``hypic.router``'s
serializer (tensors as numpy arrays, what the router registers), and gloo. Each sender holds the
tensors of one entry of a ``--doc-tokens``-token document of the default
model's shapes (per linear layer T_C and S_C|0 in fp32 and a conv tail; per attention layer the
interior K and V); the receiver gets them ``--repeats`` times. Object store: the sender returns
the tensors and the receiver's task takes the ref (as the combine node's ``install`` does).
gloo: ``send`` / ``recv`` of one flat fp32 buffer (the tensors packed once on the sender).

    python eval/bench_transfer.py
"""
import argparse
import statistics
import sys
import time

import ray
import torch
import torch.distributed as dist

from hypic import default_model_path
from hypic.loading.loader import read_config
from hypic.router.serialization import register_tensor_serializer


def entry_tensors(tokens: int) -> list[torch.Tensor]:
    """The tensors of one cached document of the default model (random values, exact shapes)."""
    config = read_config(default_model_path())
    heads, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    channels = 2 * config.linear_num_key_heads * dk + heads * dv
    tensors = []
    for kind in config.layer_types:
        if kind == "linear_attention":
            tensors += [torch.randn(heads, dk, dk), torch.randn(heads, dk, dv), torch.randn(config.linear_conv_kernel_dim - 1, channels)]
        else:
            tensors += [torch.randn(config.num_key_value_heads, tokens, config.head_dim) for _ in range(2)]
    return tensors


@ray.remote(num_cpus=0)
class Peer:
    """One end of both transports."""

    def __init__(self, rank: int, port: int, tokens: int, numpy_path: bool = False) -> None:
        self.rank, self.tensors = rank, entry_tensors(tokens)
        self.flat = torch.cat([t.reshape(-1) for t in self.tensors])
        if numpy_path:
            register_tensor_serializer()
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def entry(self) -> list[torch.Tensor]:
        return self.tensors

    def take(self, tensors: list[torch.Tensor]) -> int:
        return sum(t.numel() for t in tensors)


    def gloo_send(self, repeats: int) -> None:
        for _ in range(repeats):
            dist.send(self.flat, dst=1)

    def gloo_recv(self, repeats: int) -> list[float]:
        buffer, times = torch.empty_like(self.flat), []
        for _ in range(repeats):
            start = time.perf_counter()
            dist.recv(buffer, src=0)
            times.append(time.perf_counter() - start)
        return times

    def nbytes(self) -> int:
        return self.flat.numel() * 4


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--doc-tokens", type=int, default=2400, help="tokens of the document (default: 2400)")
    parser.add_argument("--repeats", type=int, default=20, help="transfers per transport (default: 20)")
    parser.add_argument("--port", type=int, default=29611, help="gloo rendezvous port (default: 29611)")
    args = parser.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        sender, receiver = (Peer.remote(rank, args.port, args.doc_tokens) for rank in (0, 1))
        nbytes = ray.get(sender.nbytes.remote())
        store = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            ray.get(receiver.take.remote(sender.entry.remote()))
            store.append(time.perf_counter() - start)
        arrays = []
        numpy_sender, numpy_receiver = (Peer.remote(rank, args.port, args.doc_tokens, True) for rank in (0, 1))
        for _ in range(args.repeats):
            start = time.perf_counter()
            ray.get(numpy_receiver.take.remote(numpy_sender.entry.remote()))
            arrays.append(time.perf_counter() - start)
        sending = sender.gloo_send.remote(args.repeats)
        gloo = ray.get(receiver.gloo_recv.remote(args.repeats))
        ray.get(sending)
    finally:
        ray.shutdown()
    results = {"entry_bytes": nbytes, "object_store_ms": 1000 * statistics.median(store),
               "object_store_numpy_ms": 1000 * statistics.median(arrays),
               "gloo_ms": 1000 * statistics.median(gloo[1:])}
    print(f"entry of {args.doc_tokens} tokens: {nbytes / 2**20:.1f} MiB")
    print(f"Ray object store (returned by the sender, taken by the receiver's task): {results['object_store_ms']:.1f} ms")
    print(f"Ray object store, tensors as numpy arrays (hypic.router's serializer): {results['object_store_numpy_ms']:.1f} ms")
    print(f"torch.distributed gloo send/recv into a preallocated buffer: {results['gloo_ms']:.1f} ms")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
