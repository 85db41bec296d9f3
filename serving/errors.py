"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, for every failure the server answers."""

from __future__ import annotations

import json
from typing import Any


class ApiError(Exception):
    """An error answered as OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body_bytes(self) -> bytes:
        # ASCII escapes: a message that quotes the client's input (a lone surrogate, say) must still encode
        return json.dumps(self.body(), ensure_ascii=True).encode()


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)
