"""Helpers the tests share that the serving package does not need: the matrix of tiny random
checkpoints and writers for architectures ``transformers`` has no class of (``tiny_models``), a
long-memory rewrite of a tiny checkpoint (``checkpoints``), drivers of stepwise prefills (``steps``),
quantized copies of checkpoints (``quantized``) and the fidelity tests' layouts and oracle
(``fidelity``). On the tests' import path through ``pythonpath`` in pyproject.toml: ``import
hypic_testing``."""
