"""Tensor parallelism: a model split by heads over N ranks (processes), each holding and computing
its share of every layer; the shares meet in one all-reduce after each token mixer and each
feed-forward block, and in the vocabulary-parallel embedding and LM head (``sharding``: how the
model is cut; ``group``: the ranks and their collectives)."""
from .group import TensorParallel, all_gather_last, all_reduce

__all__ = ["TensorParallel", "all_gather_last", "all_reduce"]
