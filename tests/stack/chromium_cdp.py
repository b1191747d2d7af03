"""Headless Chromium driven through the DevTools protocol, with nothing but the standard library: open a page,
wait for an expression to hold, click, read the DOM, save a screenshot.

Debian's ``chromium`` package; ``chromium()`` skips with the command that installs it where no browser is
installed. The browser runs with a throw-away profile, no sandbox (the tests run as root), its
DevTools endpoint on a loopback port of its choosing."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str:
    """Path of a Chromium binary, or skip with the command that installs one."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless Chromium on PATH (Debian: apt-get install -y chromium)")


class _WebSocket:
    """A client WebSocket (RFC 6455) for the DevTools endpoint: text frames out (masked), text frames in."""

    def __init__(self, url: str, timeout_s: float) -> None:
        m = re.fullmatch(r"ws://([^/:]+):(\d+)(/.*)", url)
        if not m:
            raise ValueError(f"not a ws:// URL: {url}")
        self.sock = socket.create_connection((m.group(1), int(m.group(2))), timeout=timeout_s)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {m.group(3)} HTTP/1.1\r\nHost: {m.group(1)}:{m.group(2)}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("DevTools closed the connection during the handshake")
            head += chunk
        status, _, self.buf = head.partition(b"\r\n\r\n")
        if b" 101 " not in status.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"DevTools refused the WebSocket: {status[:200]!r}")

    def _read(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("DevTools closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def send(self, text: str) -> None:
        payload = text.encode()
        n = len(payload)
        if n < 126:
            header = struct.pack("!BB", 0x81, 0x80 | n)
        elif n < 1 << 16:
            header = struct.pack("!BBH", 0x81, 0x80 | 126, n)
        else:
            header = struct.pack("!BBQ", 0x81, 0x80 | 127, n)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(header + mask + masked)

    def recv(self) -> str:
        parts = []
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack("!H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else b""
            data = self._read(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise ConnectionError("DevTools closed the WebSocket")
            if opcode in (0x9, 0xA):  # ping / pong: nothing to answer for this use
                continue
            parts.append(data)
            if b0 & 0x80:
                return b"".join(parts).decode()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class Page:
    """One tab of the browser."""

    def __init__(self, ws: _WebSocket) -> None:
        self.ws = ws
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression[:80]}: {res['exceptionDetails'].get('text')}")
        return res.get("result", {}).get("value")

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def wait_for(self, expression: str, timeout_s: float, interval_s: float = 0.05) -> Any:
        """Poll ``expression`` until truthy; its value, or TimeoutError with the last value."""
        deadline = time.monotonic() + timeout_s
        value: Any = None
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(interval_s)
        raise TimeoutError(f"{expression[:120]} still {value!r} after {timeout_s} s")

    def dom(self) -> str:
        return str(self.evaluate("document.documentElement.outerHTML"))

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))


@contextlib.contextmanager
def browser(tmp: Path, width: int = 1400, height: int = 900, timeout_s: float = 60.0) -> Iterator[Page]:
    """A headless Chromium with one blank tab, ended on exit."""
    binary = chromium()
    profile = tmp / "chromium-profile"
    profile.mkdir(parents=True, exist_ok=True)
    log = tmp / "chromium.log"
    argv = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", f"--user-data-dir={profile}",
            f"--window-size={width},{height}", "about:blank"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    ws: _WebSocket | None = None
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not open DevTools:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout_s) as r:
            pages = [t for t in json.loads(r.read()) if t.get("type") == "page"]
        ws = _WebSocket(pages[0]["webSocketDebuggerUrl"], timeout_s)
        page = Page(ws)
        page.call("Page.enable")
        page.call("Runtime.enable")
        yield page
    finally:
        if ws is not None:
            ws.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
