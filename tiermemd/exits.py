"""``tiermemd``'s exit codes: a contract with the supervisor (systemd's ``RestartPreventExitStatus`` uses 2).

====  ==================================================================
0     clean shutdown (SIGTERM/SIGINT), or --check-config/--print-config ok
1     unexpected internal error (a bug: the traceback is logged)
2     invalid configuration (the message names the field), names included
      that this node lacks (``tiermemd.main.check_names``): not restarted
3     resources: the pool could not be allocated, or it and its staging windows
      do not fit the memory the daemon may use (``tiermemd.memfit``)
4     swap: a swap or state directory is unusable, another user could change
      it, another tiermemd holds it, or ``swap.dirs`` was reordered under a
      job's state (``tiermemd.durability``)
5     socket: the socket path is in use by a live daemon or cannot be bound, or
      its directory is one another user could change (``tiermem.net.sockpath``);
      or the metrics endpoint cannot be served
6     stopped, but the commit of some NVMe state at shutdown failed: the log
      names each rank and the step the next start serves (its last commit)
====  ==================================================================

A module of their own, so that the service (which raises them at start) and the command line (which
returns them) both import them, and neither imports the other for them.
"""

from __future__ import annotations

__all__ = [
    "EXIT_CONFIG",
    "EXIT_DATA_LOST",
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_RESOURCES",
    "EXIT_SOCKET",
    "EXIT_SWAP",
]

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_CONFIG = 2
EXIT_RESOURCES = 3
EXIT_SWAP = 4
EXIT_SOCKET = 5
EXIT_DATA_LOST = 6
