"""tiermemd: the per-node tiermem service."""
