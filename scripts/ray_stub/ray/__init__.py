"""Stand-in for Ray where it is not installed (the GPU machine: Ray's wheel is larger than what a device
call can carry). Importable, and its names resolve (for annotations and ``except`` clauses), but
calling anything raises: one-instance serving and the CUDA tests never call Ray."""


class _Unavailable(type):
    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"ray.{cls.__name__}: Ray is not installed on this machine")

    def __getattr__(cls, name):
        return _Unavailable(f"{cls.__name__}.{name}", (), {})


def __getattr__(name):
    return _Unavailable(name, (), {})
