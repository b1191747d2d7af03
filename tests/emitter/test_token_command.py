"""``otel-straggler token``: a launcher's way to the job's bearer token. It prints what
``otel_straggler_schema.job_token`` derives (bare or as ``OTEL_EXPORTER_OTLP_HEADERS``), reads the secret from a
file or the environment and never from the command line, and loads nothing of the collector."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from opentelemetry.util.re import parse_env_headers

import otel_straggler_schema as s

ROOT = Path(__file__).resolve().parents[2]
SECRET = "cluster-secret-0123456789abcdef0123456789"
CHECK_IMPORTS = """
import sys
from otel_straggler import cli
rc = cli.main(sys.argv[1:])
assert not [m for m in sys.modules if m.startswith(("collector_processor", "torch"))], "library only"
sys.exit(rc)
"""


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run([sys.executable, "-c", CHECK_IMPORTS, "token", *args], capture_output=True, text=True,
                          timeout=60, env={**base, "PYTHONPATH": str(ROOT), **env})


def test_the_token_is_the_schemas_derivation(tmp_path: Path) -> None:
    secret = tmp_path / "job-secret"
    secret.write_text(f"{SECRET}\n")
    proc = _run(["--job", "pretrain-gpt", "--secret-file", str(secret)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == s.job_token(SECRET, "pretrain-gpt") + "\n"
    # from the environment: the job id the ranks use, the secret's file or the secret itself
    by_file = _run(["--header"], OTEL_STRAGGLER_JOB_ID="pretrain-gpt", OTEL_STRAGGLER_JOB_SECRET_FILE=str(secret))
    by_value = _run(["--header"], OTEL_STRAGGLER_JOB_ID="pretrain-gpt", OTEL_STRAGGLER_JOB_SECRET=SECRET)
    assert by_file.returncode == by_value.returncode == 0 and by_file.stdout == by_value.stdout
    headers = parse_env_headers(by_file.stdout.strip(), liberal=True)
    assert headers == {"authorization": f"Bearer {s.job_token(SECRET, 'pretrain-gpt')}"}


def test_what_the_command_refuses(tmp_path: Path) -> None:
    weak = tmp_path / "weak"
    weak.write_text("short")
    cases = {
        "no job": (["--secret-file", str(weak)], {}, "no job id"),
        "no secret": (["--job", "j"], {}, "no job secret"),
        "missing file": (["--job", "j", "--secret-file", str(tmp_path / "nope")], {}, "cannot read"),
        "weak secret": (["--job", "j", "--secret-file", str(weak)], {}, "at least 32 bytes"),
    }
    for what, (args, env, says) in cases.items():
        proc = _run(args, **env)
        assert proc.returncode == 2 and says in proc.stderr and not proc.stdout, (what, proc.stderr)
        assert "short" not in proc.stderr, "the secret is never echoed"
    proc = _run(["--job", "j", "--secret", SECRET])
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr, "no secret on the command line"
