"""OpenAI's error objects with their status codes: what the official SDKs turn into
`BadRequestError`, `AuthenticationError`, `NotFoundError`, `RateLimitError` …"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse

RETRY_AFTER_S = 1
"""What a 429 asks a client to wait (OpenAI's SDKs honour `Retry-After`)."""


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, code: str | None = None, param: str | None = None) -> APIError:
    return APIError(404, message, code=code, param=param)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")


def too_many(message: str) -> APIError:
    return APIError(
        429,
        message,
        kind="requests",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def unavailable(message: str) -> APIError:
    return APIError(503, message, kind="server_error", code="service_unavailable")


ENDED_STATUS: dict[str, int] = {
    "invalid_request": 400,
    "input_too_long": 400,
    "deadline_exceeded": 408,
}
"""A job's `error` entry code → the status of a reply not yet begun (others: 500)."""


def job_error(code: str, message: str) -> APIError:
    status = ENDED_STATUS.get(code, 500)
    kind = "invalid_request_error" if status == 400 else "server_error"
    return APIError(status, message, kind=kind, code=code)
