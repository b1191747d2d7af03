"""``node``: most ranks of one host slow together are one fault of the node (a bad host: cooling, power, a PCIe
switch, a noisy neighbour), said once.

``NodeVerdicts.observe`` follows every batch of verdicts before they are emitted: per (job, host) the ranks
holding a straggler alert (a straggler verdict opens one on its stage, a recovered verdict closes it). When
more than ``node_min_fraction`` of the host's ranks known to the job's cohorts, and at least
``node_min_ranks``, hold one together, one node verdict is added: ``straggler``/``node_slow`` on stage
``node``, naming the host, its convicted ranks and their GPUs (``node_ranks``, ``node_gpus``), with the cost
of its worst rank verdict counted once (the job waits for its slowest rank, not for each). Every rank
verdict of the host while the node verdict holds carries ``node`` (the host), and so does every alert of the
host refreshed meanwhile (``cover``): its Prometheus series says ``covered_by="node:<host>"`` and carries no
cost, so the node pages once, through the node verdict's own series (``alert``), not once per rank. When the
host drops below the threshold the node verdict ends with ``recovered``/``within_tolerance`` on stage ``node``.

Bounded: at most ``node_max_hosts`` (job, host) entries, least recently touched first out (counted,
``node_hosts_evicted``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import otel_straggler_schema as s
from collector_processor.processor.straggler.cohort import Cohort
from collector_processor.processor.straggler.config import Config
from collector_processor.processor.straggler.model import NODE_SLOW, WITHIN_TOLERANCE, Verdict


@dataclass(slots=True)
class _Host:
    active: dict[int, set[str]] = field(default_factory=dict)  # rank -> stages holding an alert
    latest: dict[int, Verdict] = field(default_factory=dict)  # rank -> its latest straggler verdict
    verdict: Verdict | None = None  # the active node verdict
    recovered: Verdict | None = None  # the latest rank recovery on the host


class NodeVerdicts:
    def __init__(self, config: Config, counters: dict[str, int]) -> None:
        self.cfg = config
        self.c = counters
        self.hosts: OrderedDict[tuple[str, str], _Host] = OrderedDict()

    def observe(self, verdicts: list[Verdict], cohorts: Iterable[Cohort]) -> list[Verdict]:
        """``verdicts`` with each node verdict that opened or ended in this batch added, and the rank
        verdicts of a host under a node verdict marked with it."""
        cfg = self.cfg
        if not cfg.node_verdicts:
            return verdicts
        touched: set[tuple[str, str]] = set()
        for v in verdicts:
            if not v.host or v.stage == s.NODE_STAGE or v.verdict == s.VERDICT_UNCERTAIN or v.derived:
                continue
            key = (v.job, v.host)
            h = self.hosts.get(key)
            if v.verdict == s.VERDICT_STRAGGLER:
                if h is None:
                    h = self.hosts[key] = _Host()
                    self._bound()
                h.active.setdefault(v.rank, set()).add(v.stage)
                h.latest[v.rank] = v
            elif h is not None:  # recovered
                h.recovered = v
                stages = h.active.get(v.rank)
                if stages is not None:
                    stages.discard(v.stage)
                    if not stages:
                        del h.active[v.rank]
                        h.latest.pop(v.rank, None)
            else:
                continue
            self.hosts.move_to_end(key)
            touched.add(key)
        if not touched:
            return verdicts
        added: list[Verdict] = []
        for key in touched:
            h = self.hosts[key]
            slow = len(h.active)
            if h.verdict is None and slow >= cfg.node_min_ranks:
                known = self._ranks_of(key, cohorts)
                if slow >= max(cfg.node_min_ranks, math.floor(cfg.node_min_fraction * known) + 1):
                    h.verdict = self._node_verdict(key, h)
                    added.append(h.verdict)
                    self.c["node_verdicts"] = self.c.get("node_verdicts", 0) + 1
            elif h.verdict is not None:
                known = self._ranks_of(key, cohorts)
                if slow < max(cfg.node_min_ranks, math.floor(cfg.node_min_fraction * known) + 1):
                    last = h.recovered or h.verdict
                    added.append(replace(h.verdict, verdict=s.VERDICT_RECOVERED, reason=WITHIN_TOLERANCE,
                                         step_time_lost_ms=0.0, gpu_seconds_per_hour=0.0, window_gpu_seconds=0.0,
                                         window_start=last.window_start, window_end=last.window_end,
                                         step=last.step, trace_id=last.trace_id,
                                         emitted_unix_ns=last.emitted_unix_ns))
                    h.verdict = None
            if not h.active and h.verdict is None:
                del self.hosts[key]
        out: list[Verdict] = []
        for v in verdicts:
            h = self.hosts.get((v.job, v.host))
            if h is not None and h.verdict is not None and v.stage != s.NODE_STAGE and v.verdict != s.VERDICT_UNCERTAIN:
                v = replace(v, node=v.host)
            out.append(v)
        out.extend(added)
        return out

    def cover(self, v: Verdict) -> Verdict:
        """``v`` (a rank's alert or verdict) marked with its host's node verdict while one holds."""
        if v.node or not v.host or v.stage == s.NODE_STAGE or v.verdict == s.VERDICT_UNCERTAIN:
            return v
        h = self.hosts.get((v.job, v.host))
        return replace(v, node=v.host) if h is not None and h.verdict is not None else v

    def alert(self, job: str, host: str, alerts: Iterable[Verdict]) -> Verdict | None:
        """The node verdict holding on ``host`` as its alert series shows it now: the cost of the worst of
        the host's rank ``alerts`` judged in this batch (the job waits for its slowest rank, counted once);
        None when no node verdict holds there."""
        h = self.hosts.get((job, host))
        if h is None or h.verdict is None:
            return None
        worst = max((a for a in alerts if a.job == job and a.host == host and a.verdict == s.VERDICT_STRAGGLER),
                    key=lambda a: a.step_time_lost_ms, default=None)
        if worst is None:
            return h.verdict
        return replace(h.verdict, step_time_lost_ms=worst.step_time_lost_ms,
                       gpu_seconds_per_hour=worst.gpu_seconds_per_hour, window_gpu_seconds=worst.window_gpu_seconds,
                       deviation=worst.deviation)

    @staticmethod
    def _ranks_of(key: tuple[str, str], cohorts: Iterable[Cohort]) -> int:
        job, host = key
        return sum(1 for c in cohorts if c.job == job for info in c.ranks.values() if info.host == host)

    @staticmethod
    def _node_verdict(key: tuple[str, str], h: _Host) -> Verdict:
        ranks = sorted(h.active)
        worst = max((h.latest[r] for r in ranks if r in h.latest), key=lambda v: v.step_time_lost_ms)
        gpus = tuple(h.latest[r].gpu for r in ranks if r in h.latest)
        attributions = [h.latest[r].attribution for r in ranks if r in h.latest]
        attribution = max(set(attributions), key=attributions.count)
        return replace(worst, stage=s.NODE_STAGE, group="other", reason=NODE_SLOW, attribution=attribution,
                       cohort="", rank=ranks[0], gpu=",".join(gpus), node=key[1], node_ranks=tuple(ranks),
                       node_gpus=gpus, collective_evidence="")

    def _bound(self) -> None:
        while len(self.hosts) > self.cfg.node_max_hosts:
            self.hosts.popitem(last=False)
            self.c["node_hosts_evicted"] = self.c.get("node_hosts_evicted", 0) + 1
