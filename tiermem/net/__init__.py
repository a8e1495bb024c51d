"""tiermem.net: the control channel's operating-system side, shared by the trainer and the service.

- ``transport``: SEQPACKET framing, fd passing, peer identity; ``Connection`` (the client's blocking
  request/reply) and ``Listener``/``Peer`` (the service's side);
- ``sockpath``: where sockets live and which of them a client may trust;
- ``privatedir``: the private directory of an embedded daemon.
"""
