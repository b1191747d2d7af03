"""Bearer-token check shared by the OTLP receivers and the metrics endpoint, and the tenants behind the tokens.

``bearer_token`` (or ``bearer_token_file``) admits every job. Each entry of ``tenants`` is a token of its own that
may write only the jobs it lists: an exact ``straggler.job.id`` or a prefix ending in ``*``. With ``job_secret``
(or ``job_secret_file``), every job has a token of its own, derived from the secret and the job id
(``otel_straggler_schema.job_token``), that writes that job alone: no job is listed anywhere. A request that names
another job (any of its resources) is refused as a whole (``receiver.tenants``)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, field_validator, model_validator

import otel_straggler_schema as s
from collector_processor.config.types import Strict
from collector_processor.tenancy import JOB_TOKENS, job_share, reserved

MAX_TENANTS = 1024
MAX_JOBS_PER_TENANT = 1024
MAX_TOKEN_BYTES = 4096


def _read_token(inline: str, path: str, what: str) -> str:
    token = inline
    if path:
        token = Path(path).read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"{what} {path} is empty")
    return token


class TenantConfig(Strict):
    """One token and the jobs it may write."""

    name: str = Field("", max_length=128)  # shown in logs; never the token
    bearer_token: str = Field("", max_length=MAX_TOKEN_BYTES)
    bearer_token_file: str = ""
    jobs: list[str] = Field(min_length=1, max_length=MAX_JOBS_PER_TENANT)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if reserved(name):
            raise ValueError(f"tenant name {name[:40]!r}: 'all-jobs', 'job-tokens' and names starting 'job:' are "
                             "the collector's own")
        return name

    @field_validator("jobs")
    @classmethod
    def _patterns(cls, jobs: list[str]) -> list[str]:
        for j in jobs:
            if not j or "*" in j[:-1] or len(j) > 256:
                raise ValueError(f"job pattern {j[:40]!r}: an exact job id or a prefix ending in '*' "
                                 "(at most 256 characters)")
        return jobs

    @model_validator(mode="after")
    def _one(self) -> TenantConfig:
        if bool(self.bearer_token) == bool(self.bearer_token_file):
            raise ValueError("a tenant needs exactly one of bearer_token, bearer_token_file")
        return self

    def __repr__(self) -> str:  # never show the secret
        return f"TenantConfig(name={self.name!r}, jobs={self.jobs!r})"


class AuthConfig(Strict):
    bearer_token: str = Field("", max_length=MAX_TOKEN_BYTES)
    bearer_token_file: str = ""
    tenants: list[TenantConfig] = Field(default_factory=list, max_length=MAX_TENANTS)
    # the cluster's job secret: each job's own token is derived from it (otel_straggler_schema.job_token)
    job_secret: str = Field("", max_length=MAX_TOKEN_BYTES)
    job_secret_file: str = ""

    @model_validator(mode="after")
    def _one(self) -> AuthConfig:
        if self.bearer_token and self.bearer_token_file:
            raise ValueError("set bearer_token or bearer_token_file, not both")
        if self.job_secret and self.job_secret_file:
            raise ValueError("set job_secret or job_secret_file, not both")
        if self.job_secret and len(self.job_secret.encode()) < s.JOB_SECRET_MIN_BYTES:
            raise ValueError(f"job_secret: at least {s.JOB_SECRET_MIN_BYTES} bytes (e.g. openssl rand -hex 32)")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.bearer_token or self.bearer_token_file or self.tenants or self.job_secret
                    or self.job_secret_file)

    def __repr__(self) -> str:  # never show the secret
        return (f"AuthConfig(enabled={self.enabled}, tenants={len(self.tenants)}, "
                f"job_tokens={bool(self.job_secret or self.job_secret_file)})")


@dataclass(frozen=True)
class Tenant:
    """Who a request's token belongs to and what it may write."""

    name: str
    jobs: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()
    every_job: bool = False
    share: str = ""  # whose share of shared queues its requests take ("" for the all-jobs token); default: name
    label: str = ""  # how counters name it (bounded); default: name

    def __post_init__(self) -> None:
        object.__setattr__(self, "share", self.share or self.name)
        object.__setattr__(self, "label", self.label or self.name)

    def allows(self, job: str) -> bool:
        if self.every_job or job in self.jobs:
            return True
        return any(job.startswith(p) for p in self.prefixes)


EVERYONE = Tenant("", every_job=True)  # no token configured, or the all-jobs token


def _tenant(cfg: TenantConfig, i: int) -> Tenant:
    exact = frozenset(j for j in cfg.jobs if not j.endswith("*"))
    prefixes = tuple(j[:-1] for j in cfg.jobs if j.endswith("*"))
    return Tenant(cfg.name or f"tenants[{i}]", exact, prefixes, every_job="" in prefixes)


class BearerAuth:
    """Constant-time comparison of the token in ``Authorization: Bearer <token>`` (the scheme is case-insensitive,
    RFC 9110 section 11.1) against every configured token, and, with a job secret, against the token derived for
    the job a job token names. No token configured -> everyone passes, for every job."""

    def __init__(self, cfg: AuthConfig | None) -> None:
        self._tokens: list[tuple[bytes, Tenant]] = []
        self._job_secret = b""
        if cfg is None:
            return
        secret = _read_token(cfg.job_secret, cfg.job_secret_file, "job_secret_file").strip()
        if secret and not s.JOB_SECRET_MIN_BYTES <= len(secret.encode()) <= MAX_TOKEN_BYTES:
            raise ValueError(f"job_secret_file: {s.JOB_SECRET_MIN_BYTES} to {MAX_TOKEN_BYTES} bytes")
        self._job_secret = secret.encode()
        token = _read_token(cfg.bearer_token, cfg.bearer_token_file, "bearer_token_file")
        if token:
            self._tokens.append((token.encode(), EVERYONE))
        for i, t in enumerate(cfg.tenants):
            tok = _read_token(t.bearer_token, t.bearer_token_file, f"tenants[{i}].bearer_token_file")
            self._tokens.append((tok.encode(), _tenant(t, i)))
        seen: set[bytes] = set()
        for tok, _ in self._tokens:
            if tok in seen:
                raise ValueError("two auth entries share one token: each tenant needs its own")
            seen.add(tok)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens or self._job_secret)

    @property
    def scoped(self) -> bool:
        """Some token is limited to some jobs: requests must be checked against the tenant's jobs."""
        return bool(self._job_secret) or any(not t.every_job for _, t in self._tokens)

    @property
    def job_tokens(self) -> bool:
        """Each job's derived token is accepted (a job secret is configured)."""
        return bool(self._job_secret)

    def identify(self, header: str | None) -> Tenant | None:
        """The tenant whose token the header carries; None when it carries none of them. Every token is compared
        (in constant time each), whichever matches. A job token that matches none of them is its job's tenant when
        its MAC is the one derived for the job it names."""
        if not self.enabled:
            return EVERYONE
        if not header:
            return None
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode("utf-8", "replace")
        found: Tenant | None = None
        for expected, tenant in self._tokens:
            if hmac.compare_digest(given, expected):
                found = tenant
        if found is None and self._job_secret:
            found = self._job_tenant(token.strip())
        return found

    def _job_tenant(self, token: str) -> Tenant | None:
        parts = s.job_token_parts(token)
        if parts is None:
            return None
        job, mac = parts
        if not hmac.compare_digest(mac.encode("ascii", "replace"), s.job_token_mac(self._job_secret, job).encode()):
            return None
        return Tenant(f"job {job[:80]!r}", frozenset((job,)), share=job_share(job), label=JOB_TOKENS)

    def check(self, header: str | None) -> bool:
        return self.identify(header) is not None
