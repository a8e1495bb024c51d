"""The environment of a process a test starts (a daemon, a CLI, a rank, a demo).

The test process's own environment without the caller's ``TIERMEM_*`` settings (and without the other
prefixes a test names), except ``TIERMEM_CONFIG``: the session's empty settings file
(``conftest.no_node_settings``), so that no child reads the node's ``/etc/tiermem/tiermemd.toml``.
"""

from __future__ import annotations

import os

__all__ = ["child_env"]


def child_env(*drop: str) -> dict[str, str]:
    """``os.environ`` without ``TIERMEM_*`` and the prefixes in ``drop``, keeping ``TIERMEM_CONFIG``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERMEM_", *drop))}
    if "TIERMEM_CONFIG" in os.environ:
        env["TIERMEM_CONFIG"] = os.environ["TIERMEM_CONFIG"]
    return env
