"""An end-to-end reference of HYPIC's semantics, independent of the runtime it checks.

``model``: a token-loop Qwen3.5 / Qwen3-Next forward from the checkpoint tensors (proven equal to
``transformers``). ``semantics``: the splice rule on top of it. ``tests/reference`` is on pytest's path.
"""
