"""The exception classes HYPIC names in ``except`` clauses and imports, so that modules that import
them load where Ray is not installed; nothing raises them there."""


class RayError(Exception):
    pass


class GetTimeoutError(RayError):
    pass


class RayActorError(RayError):
    pass


class RayTaskError(RayError):
    pass
