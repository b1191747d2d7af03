"""``otel-straggler token``: the bearer token of one job, derived from the cluster's job secret
(``otel_straggler_schema.job_token``), for a launcher to hand to the job's ranks.

The secret is read from a file (``--secret-file``, else ``OTEL_STRAGGLER_JOB_SECRET_FILE``) or from
``OTEL_STRAGGLER_JOB_SECRET``, never from the command line (which other users of the node can see). The job id is
``--job``, else ``OTEL_STRAGGLER_JOB_ID``: exactly the ``straggler.job.id`` the ranks send. ``--header`` prints the
value for ``OTEL_EXPORTER_OTLP_HEADERS`` instead of the bare token.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

import otel_straggler_schema as s

HELP = "print the bearer token of one job, derived from the cluster's job secret"
EXIT_USAGE = 2


def read_secret(path: str | None, env: Mapping[str, str]) -> str:
    """The job secret: ``path``, else the file ``OTEL_STRAGGLER_JOB_SECRET_FILE`` names, else
    ``OTEL_STRAGGLER_JOB_SECRET`` (surrounding whitespace stripped)."""
    path = path or env.get("OTEL_STRAGGLER_JOB_SECRET_FILE", "")
    secret = Path(path).read_text(encoding="utf-8") if path else env.get("OTEL_STRAGGLER_JOB_SECRET", "")
    return secret.strip()


def header(token: str) -> str:
    """``OTEL_EXPORTER_OTLP_HEADERS``'s form: the OTel SDKs percent-decode it into ``authorization: Bearer <token>``."""
    return f"authorization=Bearer%20{token}"


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    ap = argparse.ArgumentParser(prog="otel-straggler token", description=HELP, allow_abbrev=False)
    ap.add_argument("--job", default=None, help="the job id (default: OTEL_STRAGGLER_JOB_ID)")
    ap.add_argument("--secret-file", default=None,
                    help="file holding the job secret (default: OTEL_STRAGGLER_JOB_SECRET_FILE, else the secret in "
                         "OTEL_STRAGGLER_JOB_SECRET)")
    ap.add_argument("--header", action="store_true",
                    help="print authorization=Bearer%%20<token>, the value of OTEL_EXPORTER_OTLP_HEADERS")
    args = ap.parse_args(argv)
    job = (args.job if args.job is not None else env.get("OTEL_STRAGGLER_JOB_ID", "")).strip()
    if not job:
        print("otel-straggler token: no job id (--job or OTEL_STRAGGLER_JOB_ID)", file=sys.stderr)
        return EXIT_USAGE
    try:
        secret = read_secret(args.secret_file, env)
    except OSError as e:
        print(f"otel-straggler token: cannot read the job secret: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    if not secret:
        print("otel-straggler token: no job secret (--secret-file, OTEL_STRAGGLER_JOB_SECRET_FILE or "
              "OTEL_STRAGGLER_JOB_SECRET)", file=sys.stderr)
        return EXIT_USAGE
    try:
        token = s.job_token(secret, job)
    except ValueError as e:
        print(f"otel-straggler token: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(header(token) if args.header else token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
