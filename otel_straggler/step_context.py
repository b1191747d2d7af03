"""Step and workload the training thread publishes; bound to an interval at its stop.

``binding`` is one immutable tuple ``(step, tokens, sequences, microbatches)`` replaced (never mutated)
by ``set_step``, so a stop stores a single reference into the ring slot and a later ``set_step`` cannot
change what an already-stopped interval belongs to. Written and read on the training thread only.

Auto step: until ``set_step`` is called once, every start of the step timer (``forward-backward`` by
default) advances the step by one (the first step is 1; intervals before it belong to step 0), so a
pure drop-in of the timers still gets steps.

Device sampling: ``device_on`` is decided when the step changes (every ``device_every``-th step), not
per call. Without CUDA it is always False and ``host_reason`` is ``no_cuda``.
"""

from __future__ import annotations

from otel_straggler.counters import NO_CUDA, SAMPLED_OUT


class StepContext:
    __slots__ = ("_cuda", "_every", "auto", "binding", "device_on", "host_reason", "step")

    def __init__(self, *, device_every: int = 4, cuda: bool = False) -> None:
        self._every = max(1, int(device_every))
        self._cuda = bool(cuda)
        self.auto = True
        self._apply(0, None, None, None)

    def _apply(self, step: int, tokens: int | None, sequences: int | None, microbatches: int | None) -> None:
        self.step = step
        self.binding = (step, tokens, sequences, microbatches)
        on = self._cuda and step % self._every == 0
        self.device_on = on
        self.host_reason = None if on else (SAMPLED_OUT if self._cuda else NO_CUDA)

    def set_step(
        self,
        step: int,
        tokens: int | None = None,
        sequences: int | None = None,
        microbatches: int | None = None,
    ) -> None:
        """Publish the current step (and optional workload); turns the auto step off."""
        self.auto = False
        self._apply(int(step), _opt_int(tokens), _opt_int(sequences), _opt_int(microbatches))

    def step_timer_started(self) -> None:
        if self.auto:
            self._apply(self.step + 1, None, None, None)


def _opt_int(v: int | None) -> int | None:
    return None if v is None else int(v)
