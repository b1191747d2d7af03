"""Options that cannot work are refused before anything starts (docs/demo.md, exit status 2): a negative
slowdown is not "no injection" (that is ``--inject-rank -1``) but a mistake the demo must name."""

from __future__ import annotations

import pytest

from otel_straggler.demo.options import DemoOptions, OptionError, check_options
from otel_straggler.demo.run import detector_settings


@pytest.mark.parametrize("slowdown", [-1.0, -0.1, 10.5])
def test_a_slowdown_out_of_range_is_refused(slowdown: float) -> None:
    det = detector_settings()
    with pytest.raises(OptionError, match="--inject-slowdown"):
        check_options(DemoOptions(inject_slowdown=slowdown), absolute_floor_ms=det.absolute_floor_ms,
                      window_steps=det.window_steps, persistence_windows=det.persistence_windows)


def test_a_negative_inject_ms_is_refused_even_without_a_slowdown() -> None:
    det = detector_settings()
    with pytest.raises(OptionError, match="--inject-ms"):
        check_options(DemoOptions(inject_slowdown=0.0, inject_ms=-5.0), absolute_floor_ms=det.absolute_floor_ms,
                      window_steps=det.window_steps, persistence_windows=det.persistence_windows)
