"""tiermem.core: the pure cores both halves share.  No sockets, syscalls, threads or I/O.

- ``errors``: the one error hierarchy (it crosses the socket as the same types);
- ``units``, ``dtypes``, ``modes``: sizes, working dtypes, placement/exchange/step modes;
- ``config``: typed configuration, one loader (file, then ``TIERMEM_*``, then flags);
- ``protocol``: the wire protocol (frames, messages, their codec; docs/protocol.md);
- ``layout``: the shared storage's byte layout; ``shard_plan``: how ZeRO ranks split params;
- ``adam_math``: one Adam/AdamW step as pure functions; ``step_rules``: skip, norm and grad scale
  (``clip_grad_norm_``'s and ``GradScaler``'s semantics);
- ``estimate``: memory estimates per mode; ``histogram``: fixed-bucket histograms for the figures.

Imports flow one way: nothing here imports ``tiermem.engine``, ``tiermem.net``, ``tiermem.client`` or
``tiermemd`` (``tests/unit/test_layering.py`` checks it).
"""
