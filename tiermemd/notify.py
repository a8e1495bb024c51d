"""sd_notify without libsystemd: readiness, status and watchdog messages.

systemd passes ``NOTIFY_SOCKET`` (a filesystem path, or an abstract socket
written with a leading "@") to services of ``Type=notify``; a message is one
datagram of newline-separated ``KEY=VALUE`` assignments.  Without the variable
every call is a no-op, so the daemon runs the same under systemd, by hand and
in tests (which point ``NOTIFY_SOCKET`` at a datagram socket of their own).

``WATCHDOG_USEC`` tells how often systemd wants ``WATCHDOG=1``; the daemon's
main loop sends it at half that period, and only while no worker thread is
wedged (``tiermemd.health``: sessions in a request, the CPU scheduler, rank
pipelines, the pidfd watcher), so a wedged thread, like a wedged loop, gets the
daemon restarted.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

__all__ = ["Notifier"]

log = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify datagrams to the socket named at construction (or nowhere)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + address[1:] if address.startswith("@") else address
        self._sock: socket.socket | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        wanted = usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid()))
        self.watchdog_interval_s: float | None = int(usec) / 2e6 if wanted else None

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=VALUE`` lines; returns whether a datagram went out."""
        if not self._address:
            return False
        text = "\n".join(f"{key}={value}" for key, value in fields.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(text.encode(), self._address)
        except OSError as exc:
            log.warning("sd_notify to %s failed: %s", self._address.replace("\0", "@"), exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status, MAINPID=os.getpid())

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def stopping(self, status: str = "stopping") -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def reloading(self) -> bool:
        return self.send(RELOADING=1)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
