"""The backend's one error tree. Each class carries its HTTP status and internal-protocol code
(`schemas.backend.ErrorCode`), which the gateway maps to Workers AI codes.

    EngineError (500, internal)
    ├── InvalidRequest (400, invalid_request)
    │   └── Unsupported (400, unsupported)          images without a vision tower, bad schema, …
    ├── Unauthorized (401, unauthorized)
    ├── ContextWindowExceeded (413, context_window_exceeded)  names both numbers; the window is
    │                                               the model's, or the page pool's where smaller
    ├── TooLargeForPool (413, too_large_for_pool)   what could never fit besides the window:
    │   └── TooManyImagePatches                     the request's images past the patch cap
    ├── Busy (429, busy)                            reject_if_busy and no room this step
    ├── IntegrityAbort (500, integrity_abort)       a KV page tag mismatch
    ├── Aborted (499, aborted)
    └── CheckpointError (500, internal)             unknown architecture, missing tensor, …
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # msgspec stays out of the msgspec-free users of this tree (the training recipe)
    from schemas.backend import Error, ErrorCode


class EngineError(Exception):
    status: int = 500
    code: ErrorCode = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_event(self) -> Error:
        from schemas.backend import Error

        return Error(code=self.code, message=self.message, status=self.status)


class InvalidRequest(EngineError):
    status = 400
    code: ErrorCode = "invalid_request"  # declared: Unsupported narrows it


class Unsupported(InvalidRequest):
    code = "unsupported"


class Unauthorized(EngineError):
    status, code = 401, "unauthorized"


class ContextWindowExceeded(EngineError):
    status, code = 413, "context_window_exceeded"

    def __init__(self, num_requested: int, context_window: int) -> None:
        super().__init__(
            f"The estimated number of input and maximum output tokens ({num_requested}) "
            f"exceeded this model context window limit ({context_window})."
        )
        self.num_requested = num_requested
        self.context_window = context_window


class TooLargeForPool(EngineError):
    status, code = 413, "too_large_for_pool"


class TooManyImagePatches(TooLargeForPool):
    """A request whose images together cut into more patches than a request may have."""


class Busy(EngineError):
    status, code = 429, "busy"


class RanksDown(EngineError):
    """A rank of a tensor-parallel backend died or hung: the backend restarts; retry elsewhere."""

    status, code = 503, "busy"


class IntegrityAbort(EngineError):
    status, code = 500, "integrity_abort"


class Aborted(EngineError):
    status, code = 499, "aborted"


class CheckpointError(EngineError):
    status, code = 500, "internal"
