"""Whose a job is: the tenant of the receivers' ``auth.tenants`` whose token may write it (exact job ids before
prefixes, the longest prefix first); with a ``job_secret`` (per-job tokens) a job no tenant lists is its own
tenant; else ``""`` (the all-jobs token, or no auth). Shared state (cohorts) is budgeted per tenant with it, so one
tenant's load evicts only its own. Counters label a per-job tenant ``JOB_TOKENS`` (their series stay bounded) and
the jobs no tenant lists ``ALL_JOBS`` (no series has an empty label value)."""

from __future__ import annotations

from collections.abc import Iterable

NO_TENANT = ""
JOB_TOKENS = "job-tokens"  # the label of every job that is its own tenant
ALL_JOBS = "all-jobs"  # the label of the jobs no tenant lists (written with the all-jobs token, or without auth)
_MAX_REMEMBERED = 4096  # jobs whose tenant is remembered (cleared when full)


def job_share(job: str) -> str:
    """The tenant a job with its own token is (``auth.job_secret``)."""
    return f"job:{job}"


def label_of(tenant: str) -> str:
    """A tenant as counters label it: its name, ``JOB_TOKENS`` for a job that is its own tenant, ``ALL_JOBS`` for
    the jobs no tenant lists."""
    return JOB_TOKENS if tenant.startswith("job:") else tenant or ALL_JOBS


def reserved(name: str) -> bool:
    """A tenant name the collector uses itself (``label_of``, ``job_share``)."""
    return name.startswith("job:") or name in (ALL_JOBS, JOB_TOKENS)


class Tenancy:
    def __init__(self, tenants: Iterable[tuple[str, Iterable[str]]] = (), per_job: bool = False) -> None:
        """``tenants``: (name, job patterns), a pattern an exact job id or a prefix ending in ``*``; ``per_job``: a
        job no tenant lists is a tenant of its own (``job:<id>``)."""
        self.per_job = per_job
        self._exact: dict[str, str] = {}
        prefixes: list[tuple[str, str]] = []
        self.names: list[str] = []
        for name, jobs in tenants:
            if name not in self.names:
                self.names.append(name)
            for j in jobs:
                if j.endswith("*"):
                    prefixes.append((j[:-1], name))
                else:
                    self._exact.setdefault(j, name)
        self._prefixes = sorted(prefixes, key=lambda p: -len(p[0]))
        self._memo: dict[str, str] = {}

    def __bool__(self) -> bool:
        return bool(self.names) or self.per_job

    def share(self, total: int) -> int:
        """A tenant's share of a structure holding ``total`` entries: ``total`` over the tenants listed plus one
        (the jobs none lists), and with per-job tokens at most a quarter per job; ``total`` without tenants."""
        if not self:
            return total
        n = len(self.names) + 1
        return max(1, min(total // n, total // 4 if self.per_job else total))

    label = staticmethod(label_of)

    def __call__(self, job: str) -> str:
        name = self._memo.get(job)
        if name is None:
            name = self._exact.get(job)
            if name is None:
                name = next((n for p, n in self._prefixes if job.startswith(p)),
                            job_share(job) if self.per_job else NO_TENANT)
            if len(self._memo) >= _MAX_REMEMBERED:
                self._memo.clear()
            self._memo[job] = name
        return name


def from_receivers(configs: Iterable[object]) -> Tenancy:
    """The tenants of every receiver config that has ``auth.tenants`` (named as the receivers log them)."""
    tenants: list[tuple[str, list[str]]] = []
    per_job = False
    for cfg in configs:
        auth = getattr(cfg, "auth", None)
        for i, t in enumerate(getattr(auth, "tenants", None) or ()):
            tenants.append((t.name or f"tenants[{i}]", list(t.jobs)))
        per_job = per_job or bool(getattr(auth, "job_secret", "") or getattr(auth, "job_secret_file", ""))
    return Tenancy(tenants, per_job)
