"""Every error a client can see, each with the status it maps to; and the integrity error.

Each transport maps a :class:`ServingError` to its status with one lookup
(gRPC: ``grpc.StatusCode[err.status]``; the HTTP API: a table from these names to HTTP
codes); nothing depends on the order of ``except`` clauses. The
status is a gRPC status code *name*, so this module stays free of grpc (the scheduler
process imports it). Any other exception reaching a transport is a server bug and is
reported as ``INTERNAL``. This follows vLLM v1's ``engine/exceptions.py`` in spirit: one
module says what the client sees.
"""

from __future__ import annotations

from typing import ClassVar


class ServingError(Exception):
    """Base of the errors a client sees.

    Attributes:
        status: name of the ``grpc.StatusCode`` the client receives.
        recoverable: False when the server cannot serve anything until it is restarted.
        param: the offending request field, when known (the HTTP API reports it).
    """

    status: ClassVar[str] = "INTERNAL"
    recoverable: ClassVar[bool] = True

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidRequest(ServingError, ValueError):
    """A malformed request or an out-of-range field; the message names the field."""

    status = "INVALID_ARGUMENT"


class ModelNotFound(ServingError):
    """The request names a model this server does not serve."""

    status = "NOT_FOUND"


class RequestRejected(ServingError):
    """A well-formed request that can never be served here (e.g. one sequence needs more
    KV slots than any worker's pool holds)."""

    status = "RESOURCE_EXHAUSTED"


class DuplicateRequest(ServingError):
    """A request id that is already in flight."""

    status = "ALREADY_EXISTS"


class ClusterUnavailable(ServingError):
    """No worker (or no scheduler) is alive to serve the request."""

    status = "UNAVAILABLE"
    recoverable = False


class NoOutputStream(ClusterUnavailable):
    """``add_request`` named a subscriber with no open output stream: the scheduler was
    restarted (it starts with none) or dropped the stream; the frontend subscribes again."""


class IntegrityError(AssertionError):
    """The scheduler's or block manager's bookkeeping is inconsistent: a bug, never a
    user error. Raised instead of silently skipping a state that cannot happen."""
