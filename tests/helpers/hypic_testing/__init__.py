"""Helpers the tests share that the serving package does not need: a long-memory rewrite of a tiny
checkpoint (``checkpoints``) and drivers of stepwise prefills (``steps``). On the tests' import path
through ``pythonpath`` in pyproject.toml: ``import hypic_testing``."""
