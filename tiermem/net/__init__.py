"""tiermem.net: the control channel's operating-system side, shared by the trainer and the service.

- ``frames``: SEQPACKET framing, fd passing, peer identity (the client's blocking request/reply,
  ``Connection``, is ``tiermem.client.connection``; the service's ``Listener``/``Peer`` are
  ``tiermemd.listener``);
- ``sockpath``: where sockets live and which of them a client may trust;
- ``privatedir``: the private directory of an embedded daemon.
"""
