"""Control-path round trip between two processes, and the cost of the message codec.

Round trips (one client process, one server process, one request in flight),
p50/p99 per request, medians over --repeats runs taken round-robin so every
mode sees the same machine state; ratios to the blocking SEQPACKET echo:

- ``echo stream blocking``:  AF_UNIX SOCK_STREAM, blocking recv/send, 64-byte messages;
- ``echo seqpacket blocking``: the same over SOCK_SEQPACKET (the baseline);
- ``echo asyncio streams``:  asyncio.start_unix_server (STREAM), readexactly + write/drain;
- ``echo asyncio reader`` / ``echo uvloop reader``: SEQPACKET, non-blocking socket,
  ``loop.add_reader`` callback (asyncio's stream API does not do SEQPACKET);
- ``proto <server> PING`` / ``proto <server> STEP``: the full protocol through
  ``tiermem.net.frames.Connection`` (encode, send, server decode + encode the
  reply, client decode and checks), the server being ``thread`` (a blocking
  thread per connection: ``Listener``/``Peer``), ``asyncio`` or ``uvloop``
  (``Peer`` non-blocking + ``add_reader``).  STEP carries one param group and
  clipping; the reply is a STEP_DONE with timings.

- ``tiermemd PING``: the real daemon (an embedded ``tiermemd`` child with a
  64 MiB pool), PING through ``Connection``; skipped with ``--no-daemon`` or
  when the daemon cannot start.

Goal (the daemon issue): the daemon's control round trip <= 2x the blocking echo.

Codec table: encode + decode (frame and message, all field checks) per message,
in one process, in CPU time of the measuring thread (robust to other tenants
of a shared machine), against ``marshal`` on the same payload as a C-speed
lower bound (marshal is not safe for untrusted input and is not an option).

Bytes per byte of gradient on the step path are counted on a real OffloadAdam
and tiermemd (``copies_per_gradient_byte``): copies the client makes, and bytes
that cross the socket.

    .venv/bin/python benchmarks/bench_ipc.py [--requests 3000] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import marshal
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_codec import run_us, tensor_slots

from tiermem.client.connection import Connection
from tiermem.core import protocol
from tiermem.core.errors import ConnectionClosed
from tiermemd.listener import Listener, Peer

ECHO_NBYTES = 64
STEP = protocol.Step(
    step=1000,
    attempt=1000,
    groups=(protocol.ParamGroup(lr=3e-4, weight_decay=0.1),),
    loss_scale=65536.0,
    max_grad_norm=1.0,
)
STEP_DONE = protocol.StepDone(step=1000, attempt=1000, grad_norm=0.8731, timings=(("wait", 1.2e-4), ("update", 0.0312)))


# --------------------------------------------------------------------------- servers (run in a child process)


def handle(msg: protocol.Message) -> protocol.Message:
    return STEP_DONE if isinstance(msg, protocol.Step) else protocol.Pong()


def reply_to(raw: bytes) -> bytes:
    frame = protocol.decode_frame(raw)
    return protocol.encode_message(handle(protocol.decode_message(frame)), frame.request_id)


def serve_blocking_echo(path: str, kind: int) -> None:
    lst = socket.socket(socket.AF_UNIX, kind)
    lst.bind(path)
    lst.listen()
    print("ready", flush=True)
    while True:
        conn, _ = lst.accept()
        threading.Thread(target=_echo_blocking, args=(conn, kind), daemon=True).start()


def _echo_blocking(conn: socket.socket, kind: int) -> None:
    buf = bytearray(65536)
    while True:
        n = _recv_exact(conn, buf, ECHO_NBYTES) if kind == socket.SOCK_STREAM else conn.recv_into(buf)
        if not n:
            return
        conn.sendall(buf[:n])


def _recv_exact(conn: socket.socket, buf: bytearray, nbytes: int) -> int:
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = conn.recv_into(view[got:nbytes])
        if not n:
            return 0
        got += n
    return got


async def serve_asyncio_streams(path: str) -> None:
    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError):
            while True:
                data = await reader.readexactly(ECHO_NBYTES)
                writer.write(data)
                await writer.drain()

    await asyncio.start_unix_server(on_client, path)
    print("ready", flush=True)
    await asyncio.Event().wait()


async def serve_reader(path: str, framed: bool) -> None:
    loop = asyncio.get_running_loop()
    if framed:
        lst = Listener.bind(path, mode=0o600)
        lst.sock.setblocking(False)
    else:
        raw_lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        raw_lst.bind(path)
        raw_lst.listen()
        raw_lst.setblocking(False)

    def on_accept() -> None:
        if framed:
            peer = lst.accept()
            peer.set_blocking(False)
            loop.add_reader(peer.fileno(), on_peer, peer)
        else:
            conn, _ = raw_lst.accept()
            conn.setblocking(False)
            loop.add_reader(conn.fileno(), on_echo, conn)

    def on_echo(conn: socket.socket) -> None:
        try:
            data = conn.recv(65536)
        except BlockingIOError:
            return
        if not data:
            loop.remove_reader(conn.fileno())
            conn.close()
            return
        conn.send(data)

    def on_peer(peer: Peer) -> None:
        try:
            raw = peer.recv()
        except BlockingIOError:
            return
        except ConnectionClosed:
            loop.remove_reader(peer.fileno())
            peer.close()
            return
        peer.send(reply_to(raw))

    loop.add_reader(lst.fileno() if framed else raw_lst.fileno(), on_accept)
    print("ready", flush=True)
    await asyncio.Event().wait()


def serve_proto_threads(path: str) -> None:
    lst = Listener.bind(path, mode=0o600)
    print("ready", flush=True)
    while True:
        peer = lst.accept()
        threading.Thread(target=_serve_peer, args=(peer,), daemon=True).start()


def _serve_peer(peer: Peer) -> None:
    try:
        while True:
            peer.send(reply_to(peer.recv()))
    except ConnectionClosed:
        peer.close()


def run_server(mode: str, path: str) -> None:
    if mode == "stream":
        serve_blocking_echo(path, socket.SOCK_STREAM)
    elif mode == "seqpacket":
        serve_blocking_echo(path, socket.SOCK_SEQPACKET)
    elif mode == "asyncio-streams":
        asyncio.run(serve_asyncio_streams(path))
    elif mode in ("asyncio-reader", "proto-asyncio"):
        asyncio.run(serve_reader(path, framed=mode.startswith("proto")))
    elif mode in ("uvloop-reader", "proto-uvloop"):
        import uvloop

        uvloop.run(serve_reader(path, framed=mode.startswith("proto")))
    elif mode == "proto-thread":
        serve_proto_threads(path)
    else:
        raise SystemExit(f"unknown server mode {mode}")


# --------------------------------------------------------------------------- clients (in this process)


def time_requests(one: Callable[[], object], count: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        one()
    clock = time.perf_counter_ns
    out = []
    for _ in range(count):
        start = clock()
        one()
        out.append((clock() - start) / 1000.0)
    return out


def echo_client(path: str, kind: int) -> tuple[Callable[[], object], Callable[[], None]]:
    sock = socket.socket(socket.AF_UNIX, kind)
    sock.connect(path)
    msg = b"x" * ECHO_NBYTES
    buf = bytearray(65536)
    if kind == socket.SOCK_STREAM:

        def one() -> object:
            sock.sendall(msg)
            return _recv_exact(sock, buf, ECHO_NBYTES)
    else:

        def one() -> object:
            sock.send(msg)
            return sock.recv_into(buf)

    return one, sock.close


def proto_client(path: str, msg: protocol.Message) -> tuple[Callable[[], object], Callable[[], None]]:
    conn = Connection.open(path, timeout_s=30)
    return (lambda: conn.request(msg)), conn.close


CASES: list[tuple[str, str, Callable[[str], tuple[Callable[[], object], Callable[[], None]]]]] = [
    ("echo stream blocking", "stream", lambda p: echo_client(p, socket.SOCK_STREAM)),
    ("echo seqpacket blocking", "seqpacket", lambda p: echo_client(p, socket.SOCK_SEQPACKET)),
    ("echo asyncio streams", "asyncio-streams", lambda p: echo_client(p, socket.SOCK_STREAM)),
    ("echo asyncio reader", "asyncio-reader", lambda p: echo_client(p, socket.SOCK_SEQPACKET)),
    ("echo uvloop reader", "uvloop-reader", lambda p: echo_client(p, socket.SOCK_SEQPACKET)),
    ("proto thread PING", "proto-thread", lambda p: proto_client(p, protocol.Ping())),
    ("proto thread STEP", "proto-thread", lambda p: proto_client(p, STEP)),
    ("proto asyncio PING", "proto-asyncio", lambda p: proto_client(p, protocol.Ping())),
    ("proto asyncio STEP", "proto-asyncio", lambda p: proto_client(p, STEP)),
    ("proto uvloop PING", "proto-uvloop", lambda p: proto_client(p, protocol.Ping())),
    ("proto uvloop STEP", "proto-uvloop", lambda p: proto_client(p, STEP)),
]
BASELINE = "echo seqpacket blocking"


def have_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def start_servers(modes: list[str], where: Path) -> dict[str, tuple[subprocess.Popen[str], str]]:
    servers = {}
    for mode in modes:
        path = str(where / f"{mode}.sock")
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", mode, "--path", path], stdout=subprocess.PIPE, text=True
        )
        servers[mode] = (proc, path)
    for mode, (proc, _) in servers.items():
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            raise SystemExit(f"server {mode} did not start")
    return servers


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


DAEMON_CASE = "tiermemd PING"


def start_daemon() -> tuple[Any, str] | None:
    """An embedded tiermemd (the real server) or None when it cannot start here."""
    try:
        from tiermem.client.link import EmbeddedDaemon

        daemon = EmbeddedDaemon(pool_size=64 << 20)
    except Exception as exc:  # the row is optional: report and go on
        print(f"(tiermemd PING skipped: {type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    return daemon, daemon.socket


def measure_round_trips(requests: int, repeats: int, only: str = "", daemon: bool = True) -> list[dict[str, Any]]:
    cases = [c for c in CASES if have_uvloop() or "uvloop" not in c[1]]
    if daemon:
        cases.append((DAEMON_CASE, "tiermemd", lambda p: proto_client(p, protocol.Ping())))
    if only:
        cases = [c for c in cases if c[0] == BASELINE or any(word in c[0] for word in only.split(","))]
    modes = [m for m in dict.fromkeys(mode for _, mode, _ in cases) if m != "tiermemd"]
    with tempfile.TemporaryDirectory(prefix="bench-ipc-") as tmp:
        servers: dict[str, tuple[Any, str]] = dict(start_servers(modes, Path(tmp)))
        if any(c[0] == DAEMON_CASE for c in cases):
            started = start_daemon()
            if started is None:
                cases = [c for c in cases if c[0] != DAEMON_CASE]
            else:
                servers["tiermemd"] = started
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in cases}
        try:
            for _ in range(repeats):
                for name, mode, make in cases:
                    one, close = make(servers[mode][1])
                    times = time_requests(one, requests, warmup=max(100, requests // 10))
                    close()
                    samples[name].append((percentile(times, 0.5), percentile(times, 0.99)))
        finally:
            for mode, (proc, _) in servers.items():
                if mode == "tiermemd":
                    proc.stop()
                else:
                    proc.terminate()
                    proc.wait()
    base = statistics.median(p50 for p50, _ in samples[BASELINE])
    rows = []
    for name, runs in samples.items():
        p50 = statistics.median(r[0] for r in runs)
        p99 = statistics.median(r[1] for r in runs)
        rows.append({"case": name, "p50_us": p50, "p99_us": p99, "p50_vs_blocking_echo": p50 / base})
    return rows


# --------------------------------------------------------------------------- codec cost


def codec_cases() -> list[tuple[str, protocol.Message]]:
    tensors = tuple(
        protocol.TensorSpec(f"model.layers.{i // 8}.mlp.w{i % 8}", (4096, 4096), "bfloat16") for i in range(1000)
    )
    return [
        ("PING", protocol.Ping()),
        ("STEP (1 group, clipping)", STEP),
        ("STEP_DONE (2 timings)", STEP_DONE),
        (
            "BUCKET_READY (64 tensor ids)",
            protocol.BucketReady(step=1000, attempt=1000, bucket=3, tensor_ids=tuple(range(64)), groups=STEP.groups),
        ),
        ("REGISTER (1000 tensors)", protocol.Register(tensors=tensors, groups=(protocol.ParamGroup(lr=3e-4),))),
        ("REGISTER_OK (1000 slots)", protocol.RegisterOk(slots=tensor_slots(1000))),
    ]


def per_call_us(fn: Callable[[], object], runs: int = 7, run_s: float = 0.05) -> float:
    """Median over ``runs`` runs of the CPU time per call in a run of at least ``run_s`` of CPU time
    (``bench_codec.run_us``: CPU time of this thread, not wall time)."""
    return statistics.median(run_us(fn, run_s) for _ in range(runs))


def measure_codec() -> list[dict[str, Any]]:
    rows = []
    for name, msg in codec_cases():
        data = protocol.encode_message(msg, 1)
        payload = msg.to_payload()
        packed = marshal.dumps(payload)
        rows.append(
            {
                "message": name,
                "frame_bytes": len(data),
                "encode_us": per_call_us(lambda m=msg: protocol.encode_message(m, 1)),
                "decode_us": per_call_us(lambda d=data: protocol.decode_message(protocol.decode_frame(d))),
                "marshal_round_trip_us": per_call_us(lambda p=payload, b=packed: (marshal.dumps(p), marshal.loads(b))),
            }
        )
    return rows


def copies_per_gradient_byte(steps: int = 20) -> dict[str, float]:
    """Bytes moved per byte of gradient on the step path, counted on a real OffloadAdam and tiermemd.

    Every copy the client makes is counted where it happens (``SharedFeed._copy_in``: a fresh grad into
    the shared grad buffer; there is no param copy: the params live in the shared storage the daemon
    updates in place), and every byte that crosses the socket in either direction (``FrameSocket.send``/
    ``recv`` of the client's connection).  The daemon reads grads and writes params in place in the
    update's own pass, so it makes no copy of its own.  With ``zero_grad(set_to_none=True)`` each
    backward makes fresh grads: 1 grad copy per byte; with ``set_to_none=False`` backward accumulates
    straight into the shared buffer: 0.  Socket bytes are a vanishing fraction (no tensor is serialised).
    """
    import torch

    from tiermem.client.link import connect
    from tiermem.client.offload import OffloadAdam
    from tiermem.client.offload.shared import SharedFeed
    from tiermem.net.frames import FrameSocket

    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    grad_bytes_per_step = sum(p.numel() * p.element_size() for p in model.parameters())
    counted = {"grad": 0, "socket": 0}
    client = connect(pool_size=256 << 20, settings={"adam.compile": False})
    opt = OffloadAdam(model.parameters(), lr=1e-3, client=client, bucket_nbytes=1 << 20)
    orig_copy = SharedFeed._copy_in
    orig_send, orig_recv = FrameSocket.send, FrameSocket.recv

    def copy_in(target: Any, grad: Any, *, accumulate: bool) -> None:
        counted["grad"] += grad.numel() * grad.element_size()
        orig_copy(target, grad, accumulate=accumulate)

    def send(self: Any, data: bytes, fds: Any = ()) -> None:
        counted["socket"] += len(data)
        orig_send(self, data, fds)

    def recv(self: Any) -> Any:
        data, fds = orig_recv(self)
        counted["socket"] += len(data)
        return data, fds

    x = torch.randn(64, 512)
    model(x).square().mean().backward()  # the first step: not counted
    opt.step()
    opt.zero_grad()
    SharedFeed._copy_in = staticmethod(copy_in)  # type: ignore[method-assign,assignment]
    FrameSocket.send, FrameSocket.recv = send, recv  # type: ignore[method-assign]
    try:
        for _ in range(steps):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    finally:
        SharedFeed._copy_in = staticmethod(orig_copy)  # type: ignore[method-assign,assignment]
        FrameSocket.send, FrameSocket.recv = orig_send, orig_recv  # type: ignore[method-assign]
        opt.close()
        client.close()
    total = grad_bytes_per_step * steps
    return {
        "steps": steps,
        "gradient_bytes_per_step": grad_bytes_per_step,
        "grad_copies_per_byte": counted["grad"] / total,
        "param_copies_per_byte": 0.0,
        "socket_bytes_per_gradient_byte": counted["socket"] / total,
        "socket_bytes_per_step": counted["socket"] / steps,
    }


# --------------------------------------------------------------------------- report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000, help="timed requests per case and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--only", default="", help="comma-separated substrings of case names to run (and the baseline)")
    parser.add_argument("--no-codec", action="store_true", help="skip the codec table")
    parser.add_argument("--no-daemon", action="store_true", help="skip the row against a real (embedded) tiermemd")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        run_server(args.serve, args.path)
        return

    trips = measure_round_trips(args.requests, args.repeats, args.only, daemon=not args.no_daemon)
    print(f"round trip, {args.requests} requests x {args.repeats} repeats (medians), cpus={os.cpu_count()}")
    print(f"{'case':<28} {'p50 us':>8} {'p99 us':>8} {'p50 / blocking echo':>20}")
    for row in trips:
        print(f"{row['case']:<28} {row['p50_us']:>8.1f} {row['p99_us']:>8.1f} {row['p50_vs_blocking_echo']:>20.2f}")
    if not have_uvloop():
        print("(uvloop not installed: pip install uvloop to add its rows)")

    codec = [] if args.no_codec else measure_codec()
    if codec:
        print_codec(codec)
    copies = copies_per_gradient_byte() if not args.no_daemon else None
    if copies is not None:
        print(
            f"\nbytes per gradient byte over {copies['steps']} steps of a {copies['gradient_bytes_per_step']} B model: "
            f"grad copies {copies['grad_copies_per_byte']:.3f}, param copies {copies['param_copies_per_byte']:.3f}, "
            f"socket {copies['socket_bytes_per_gradient_byte']:.5f} ({copies['socket_bytes_per_step']:.0f} B/step)"
        )

    if args.json:
        out = {
            "round_trip": trips,
            "codec": codec,
            "copies_per_gradient_byte": copies,
            "config": {"requests": args.requests, "repeats": args.repeats, "cpus": os.cpu_count()},
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


def print_codec(codec: list[dict[str, Any]]) -> None:
    print("\ncodec: CPU us per message, encode / decode with all field checks (json), vs a marshal round trip")
    print(f"{'message':<30} {'bytes':>7} {'encode us':>10} {'decode us':>10} {'marshal us':>11}")
    for row in codec:
        print(
            f"{row['message']:<30} {row['frame_bytes']:>7} {row['encode_us']:>10.1f} "
            f"{row['decode_us']:>10.1f} {row['marshal_round_trip_us']:>11.1f}"
        )


if __name__ == "__main__":
    main()
