"""tiermem.client: the trainer side.

- ``link``: ``Client``, one connection to tiermemd (attach, register, the window, the shared storage),
  and ``connect``, which starts a private embedded daemon when none answers;
- ``offload``: ``OffloadAdam`` (the one optimizer), its grad feeds (shared storage, staged ring, paged)
  and ``offload_params`` (ZeRO-3/Infinity param paging);
- ``distributed``: the sharding strategies over torch.distributed (ZeRO-2, ZeRO-3 by layer, ZeRO-3 paged);
- ``cli``, ``status``, ``estimate_cli``, ``capacity``: the ``tiermem`` command; ``demo``: the main job.

The trainer side imports the cores and ``tiermem.net``; of the engines only what it must (pinning the
window for CUDA, the pool's sizing rule for a private daemon).
"""
