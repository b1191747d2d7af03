"""Optional bearer-token check shared by the OTLP receivers and the metrics endpoint."""

from __future__ import annotations

import hmac
from pathlib import Path

from pydantic import model_validator

from collector_processor.config.types import Strict


class AuthConfig(Strict):
    bearer_token: str = ""
    bearer_token_file: str = ""

    @model_validator(mode="after")
    def _one(self) -> AuthConfig:
        if self.bearer_token and self.bearer_token_file:
            raise ValueError("set bearer_token or bearer_token_file, not both")
        return self

    def __repr__(self) -> str:  # never show the secret
        return f"AuthConfig(enabled={bool(self.bearer_token or self.bearer_token_file)})"


class BearerAuth:
    """Constant-time comparison of the token in ``Authorization: Bearer <token>`` (the scheme is case-insensitive,
    RFC 9110 section 11.1). No token configured -> everyone passes."""

    def __init__(self, cfg: AuthConfig | None) -> None:
        token = ""
        if cfg is not None:
            token = cfg.bearer_token
            if cfg.bearer_token_file:
                token = Path(cfg.bearer_token_file).read_text(encoding="utf-8").strip()
                if not token:
                    raise ValueError(f"bearer_token_file {cfg.bearer_token_file} is empty")
        self._expected = token.encode() if token else b""

    @property
    def enabled(self) -> bool:
        return bool(self._expected)

    def check(self, header: str | None) -> bool:
        if not self._expected:
            return True
        if not header:
            return False
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode("utf-8", "replace"), self._expected)
