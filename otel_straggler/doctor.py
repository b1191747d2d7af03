"""``otel-straggler doctor``: what the emitter will do on this node, from the environment a rank would see.

Each check is one line, ``ok``, ``warn`` or ``FAIL``: whether it is enabled, its settings, which hot path runs,
torch and CUDA, the job and run ids and where they come from, the ranks the launcher gave, and whether the OTLP
endpoint takes trace exports (one empty export, as the ranks' exporter would send it: its round trip, and over
the collector's name and its clock against this one). Exit status 1 when a check failed, else 0. Nothing here starts the
emitter: run it beside the training command, with the same environment.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from otel_straggler.export.probe import TlsFiles, redact

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str


def _headers(env: Mapping[str, str]) -> dict[str, str]:
    """``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` else ``OTEL_EXPORTER_OTLP_HEADERS``: ``k=v,k2=v2``, URL-encoded."""
    raw = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS") or ""
    out = {}
    for part in raw.split(","):
        k, sep, v = part.partition("=")
        if sep and k.strip():
            out[urllib.parse.unquote(k.strip())] = urllib.parse.unquote(v.strip())
    return out


def _tls(env: Mapping[str, str]) -> TlsFiles:
    """The exporter's TLS files, the per-signal variable before the general one (as the SDK reads them)."""
    def var(key: str) -> str | None:
        return env.get(f"OTEL_EXPORTER_OTLP_TRACES_{key}") or env.get(f"OTEL_EXPORTER_OTLP_{key}") or None
    return TlsFiles(var("CERTIFICATE"), var("CLIENT_KEY"), var("CLIENT_CERTIFICATE"))


def checks(env: Mapping[str, str] | None = None, *, timeout_s: float = 5.0) -> list[Check]:
    from otel_straggler import hot_path
    from otel_straggler.config import EmitterConfig
    from otel_straggler.export.otel_env import OtelSettings
    from otel_straggler.export.probe import probe_otlp
    from otel_straggler.identity import job_id_from_env, run_id_from_env

    env = os.environ if env is None else env
    out: list[Check] = []
    cfg = EmitterConfig.from_env(env)
    out.append(Check("enabled", OK if cfg.enabled else WARN,
                     "OTEL_STRAGGLER_ENABLED is on" if cfg.enabled
                     else "off: install_megatron/configure do nothing (set OTEL_STRAGGLER_ENABLED=1)"))
    out.append(Check("settings", FAIL if cfg.config_errors else OK,
                     f"invalid, their defaults used: {', '.join(cfg.config_errors)}" if cfg.config_errors
                     else "every OTEL_STRAGGLER_* setting is valid"))
    out.append(Check("hot path", OK if hot_path.NAME == "native" else WARN,
                     "the C start/stop" if hot_path.NAME == "native"
                     else f"the Python start/stop ({hot_path.REASON}); the C one costs less between launches"))
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
        detail = f"torch {torch.__version__}, " + (
            f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s): device time measured" if cuda
            else "no CUDA: stages are timed on the host only")
        out.append(Check("torch", OK if cuda else WARN, detail))
    except Exception as exc:  # not installed, or a broken install
        out.append(Check("torch", WARN, f"not importable ({type(exc).__name__}): host-only timing"))
    world = int(env.get("WORLD_SIZE") or 1) if (env.get("WORLD_SIZE") or "1").isdigit() else 1
    ranks = {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE",
                                 "SLURM_PROCID", "SLURM_NTASKS") if env.get(k)}
    out.append(Check("ranks", OK if ranks else WARN,
                     ", ".join(f"{k}={v}" for k, v in ranks.items()) if ranks
                     else "no launcher variables here (torchrun/srun set RANK, WORLD_SIZE): one rank"))
    job = job_id_from_env(env, world)
    job_status = FAIL if job.source == "local" and world > 1 else (OK if job.per_launch else WARN)
    why = f" from {job.basis}" if job.basis else ""
    repeat = "" if job.per_launch else "; the same id comes back in a later launch like this one"
    out.append(Check("job id", job_status, f"{job.value!r} ({job.source}{why}){repeat}"))
    run = run_id_from_env(env, world)
    out.append(Check("run id", OK if run.per_launch else WARN,
                     f"{run.value!r} ({run.source})" + ("" if run.per_launch else
                                                        ": re-runs cannot be told apart; set OTEL_STRAGGLER_RUN_ID")))
    otel = OtelSettings.from_env(env, warn=False)
    sig = otel.traces
    if otel.sdk_disabled or sig.exporter != "otlp":
        out.append(Check("endpoint", FAIL, "trace export is off (OTEL_SDK_DISABLED or OTEL_TRACES_EXPORTER)"))
        return out
    tls = _tls(env)
    unreadable = [f"{f.name} {getattr(tls, f.name)}" for f in fields(tls)
                  if getattr(tls, f.name) and not os.access(getattr(tls, f.name), os.R_OK)]
    if unreadable:
        out.append(Check("tls", FAIL, f"cannot read the exporter's TLS file(s): {', '.join(unreadable)}"))
    elif tls.certificate or tls.client_certificate:
        out.append(Check("tls", OK, "trusting " + (tls.certificate or "the system's CAs")
                         + (f", client certificate {tls.client_certificate}" if tls.client_certificate else "")))
    answer = probe_otlp(sig.endpoint, sig.protocol, timeout_s, _headers(env), tls)
    out.append(Check("endpoint", OK if answer.ok else FAIL,
                     f"{redact(sig.endpoint)} ({sig.protocol}): " + (f"{answer.detail}, {answer.rtt_ms} ms" if answer.ok
                                                              else f"no collector takes exports: {answer.detail}")))
    if not answer.ok:
        return out
    ours = bool(answer.server and answer.server.startswith("otel-straggler-collector/"))
    out.append(Check("collector", OK if ours else WARN,
                     answer.server.replace("/", " ", 1) if ours and answer.server else
                     f"{answer.server or 'it does not say what it is'}: not an otel-straggler collector? "
                     "(a gateway in front of one is fine)"))
    if answer.clock_offset_s is not None:
        off = answer.clock_offset_s
        out.append(Check("clock", OK if abs(off) < 2 else WARN,
                         f"the collector's clock is {off:+.3f} s from this node's"
                         + ("" if abs(off) < 2 else ": wall-clock windows and trace times will disagree (NTP?)")))
    return out


def run(env: Mapping[str, str] | None = None, *, as_json: bool = False, timeout_s: float = 5.0) -> int:
    """Print the checks; 1 when one failed."""
    found = checks(env, timeout_s=timeout_s)
    if as_json:
        print(json.dumps({"checks": [asdict(c) for c in found], "ok": all(c.status != FAIL for c in found)}))
    else:
        width = max(len(c.name) for c in found)
        for c in found:
            print(f"{c.status:>4}  {c.name:<{width}}  {c.detail}")
    return 1 if any(c.status == FAIL for c in found) else 0
