"""batchd's one error hierarchy: every failure a user's code may want to catch is a `BatchdError`.

    BatchdError (RuntimeError)
    |-- JobFailed       the job failed: a party died or refused; the message names the party and why
    |-- CoordinatorError a rank service could not get an answer from the coordinator it was given
    |-- RankServiceError a trainer could not reach (or was refused by) its rank service / node agent

Bad arguments and bad configs stay `ValueError`s (`ConfigError`, `ProtocolError` subclass it), as Python
code expects.
"""

from __future__ import annotations


class BatchdError(RuntimeError):
    """Base of the errors batchd raises at run time."""


class JobFailed(BatchdError):
    """The job failed; the message names the party (rank, trainer, coordinator) and why."""


class CoordinatorError(BatchdError):
    """A coordinator call failed for good; the message names the coordinator, `code` is the gRPC status."""

    def __init__(self, message: str, code: object = None) -> None:
        super().__init__(message)
        self.code = code


class RankServiceError(BatchdError):
    """A trainer's `BatchClient` could not reach, or was refused by, its rank service (or node agent);
    the message names the address, the rank and what was tried; `code` is the last gRPC status."""

    def __init__(self, message: str, code: object = None) -> None:
        super().__init__(message)
        self.code = code
