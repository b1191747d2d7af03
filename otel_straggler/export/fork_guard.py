"""What every export sink shares: it works only in the process that created it, until it is closed.

A forked copy (a DataLoader worker) sees a different pid and turns inert: it never exports the parent's
intervals twice and never touches the parent's pipe, threads or exporters.
"""

from __future__ import annotations

import os


class ForkGuarded:
    _pid: int
    _closed: bool
    _inert: bool

    def _init_guard(self) -> None:
        self._pid = os.getpid()
        self._closed = False
        self._inert = False

    def _usable(self) -> bool:
        if self._inert or os.getpid() != self._pid:
            self._inert = True
            return False
        return not self._closed
