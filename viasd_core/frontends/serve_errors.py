"""The server's errors, in the shape of OpenAI's error object, each with its HTTP status.

  {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

An ApiError is raised anywhere a request is refused (validation, queue, time limit, shutdown);
the app turns it into that body. The status decides what the client does: 4xx are the
request's fault (do not retry as is), 503 asks it to come back (`Retry-After`), 504 says the
request's time limit passed.
"""

from __future__ import annotations

INVALID = "invalid_request_error"
SERVER = "server_error"


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = INVALID, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds (503 only): the Retry-After header

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        out = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        if self.status == 401:
            out["WWW-Authenticate"] = "Bearer"
        return out


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unauthorized() -> ApiError:
    return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' with the server's --api-key",
                    code="invalid_api_key")


def queue_full(retry_after: int) -> ApiError:
    return ApiError(503, f"the server is busy (its queue is full): retry in {retry_after} s", type=SERVER,
                    code="queue_full", retry_after=retry_after)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", type=SERVER, code="shutting_down", retry_after=5)


def timed_out(limit: float, tokens: int) -> ApiError:
    where = f"after {tokens} new tokens" if tokens else "before any token"
    return ApiError(504, f"the request exceeded its time limit of {limit:g} s ({where}); the server's --timeout sets it",
                    type="timeout_error", code="timeout")


def internal(error: BaseException) -> ApiError:
    return ApiError(500, f"internal error: {type(error).__name__}: {error}", type=SERVER)
