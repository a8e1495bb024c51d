"""A training client of tiermemd, run as its own process by the daemon integration tests.

It speaks to the daemon with ``tiermem.net.frames`` and ``tiermem.core.protocol`` and
moves data through the mapped window with numpy (no torch import, so a client
process starts in about a second).  The numbers it trains on are pure functions
of (seed, step), so a test can replay the same run through
``torch.optim.AdamW`` and compare.  Tests also use ``Trainer`` in-process.

    daemon_client.py train  --socket S --job J --sizes 300,40 --steps 20 [--reattach] ...
    daemon_client.py attach --socket S --job J --target K       # tries to join job K

``train`` writes a progress file (JSON: token, last completed step, the step
whose request is going out, pid) after attaching and around every step, so a test can SIGKILL it mid-run and a second
process can reattach with the token.  The final params go to ``--out`` (.npy,
the tensors concatenated).  ``--grads fixed`` reuses one gradient for every step
(cheap for large models, when only the load matters); ``--stop-file`` ends the
loop early, cleanly, once that file exists.  A typed error from the daemon ends
the run with exit code 3 and ``{"error": <class name>, ...}`` on stdout.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import secrets
import sys
import time

import numpy as np

from tiermem.client.connection import Connection
from tiermem.core.errors import TiermemError
from tiermem.core.modes import Placement
from tiermem.core.protocol import (
    Attach,
    AttachOk,
    Detach,
    MemRef,
    ParamGroup,
    Register,
    RegisterOk,
    Stats,
    StatsReply,
    Step,
    StepDone,
    TensorSlot,
    TensorSpec,
)

LR = 1e-2
WEIGHT_DECAY = 0.1
EXIT_DAEMON_ERROR = 3


def init_params(seed: int, sizes: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, 0])
    return [rng.standard_normal(n).astype(np.float32) for n in sizes]


def grads_for(seed: int, step: int, sizes: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, step])
    return [rng.standard_normal(n).astype(np.float32) for n in sizes]


def adamw_reference(seed: int, sizes: list[int], steps: int) -> np.ndarray:
    """The same run through ``torch.optim.AdamW`` (imported here only: client processes never need torch)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors, and the machine is shared
    try:
        params = [torch.nn.Parameter(torch.from_numpy(p)) for p in init_params(seed, sizes)]
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
        for step in range(1, steps + 1):
            for p, g in zip(params, grads_for(seed, step, sizes), strict=True):
                p.grad = torch.from_numpy(g)
            opt.step()
        return torch.cat([p.detach() for p in params]).numpy()
    finally:
        torch.set_num_threads(threads)


WINDOW_NBYTES = 64 * 1024
"""The staging window these clients ask for (they move no state through it)."""


class Trainer:
    """One rank of one job: fp32 tensors of ``sizes`` elements, AdamW(LR, WEIGHT_DECAY).

    Its params and grads live in the shared storage the daemon hands over at REGISTER, as OffloadAdam's do.
    """

    def __init__(
        self, socket: str, job: str, sizes: list[int], *, seed: int = 0, timeout_s: float = 60.0, progress: str = ""
    ) -> None:
        self.job = job
        self.sizes = sizes
        self.seed = seed
        self.progress_path = progress
        self.conn = Connection.open(socket, timeout_s=timeout_s)
        self.token = ""
        self.window_id = 0
        self.window = np.empty(0, dtype=np.uint8)
        self.storage = np.empty(0, dtype=np.uint8)
        self.slots: list[TensorSlot] = []
        self.last_step = 0
        self.reattached_at: int | None = None

    def _map(self, reply: AttachOk, fds: list[int]) -> None:
        mm = mmap.mmap(fds[0], reply.window_nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fds[0])
        self.window = np.frombuffer(mm, dtype=np.uint8)
        self.token = reply.job_token
        self.window_id = reply.window_id

    def region(self, ref: MemRef) -> np.ndarray:
        return self.storage[ref.offset : ref.offset + ref.length].view(np.float32)

    def progress(self, pending: int | None = None) -> None:
        """Record the last completed step (and ``pending``: the step whose request is about to go out)."""
        if not self.progress_path:
            return
        tmp = self.progress_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"token": self.token, "step": self.last_step, "pending": pending, "pid": os.getpid()}, f)
        os.replace(tmp, self.progress_path)

    def _register(self) -> None:
        specs = tuple(TensorSpec(f"p{i}", (n,), "float32", Placement.CPU, 0) for i, n in enumerate(self.sizes))
        ok, fds = self.conn.request_fds(Register(specs, (ParamGroup(lr=LR, weight_decay=WEIGHT_DECAY),), 1))
        assert isinstance(ok, RegisterOk) and len(fds) == 1
        mm = mmap.mmap(fds[0], ok.storage_nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fds[0])
        self.storage = np.frombuffer(mm, dtype=np.uint8)
        self.slots = list(ok.slots)

    def start_fresh(self) -> None:
        """Attach, register, write the initial params into the shared storage."""
        reply, fds = self.conn.request_fds(Attach(job_id=self.job, rank=0, world_size=1, window_nbytes=WINDOW_NBYTES))
        assert isinstance(reply, AttachOk)
        self._map(reply, fds)
        self._register()
        for p, slot in zip(init_params(self.seed, self.sizes), self.slots, strict=True):
            self.region(slot.param)[:] = p
        self.progress()

    def reattach(self, token: str) -> None:
        """Reattach with ``token`` and register again (the same storage comes back); continue from the
        daemon's last step of the rank.

        No retry: while the dead process's last step is still finishing, the daemon waits for it.
        """
        reply, fds = self.conn.request_fds(
            Attach(job_id=self.job, rank=0, world_size=1, window_nbytes=WINDOW_NBYTES, token=token)
        )
        assert isinstance(reply, AttachOk)
        if not reply.reattached:
            raise SystemExit("reattach did not report reattached=True")
        self._map(reply, fds)
        self._register()
        stats = self.conn.request(Stats())
        assert isinstance(stats, StatsReply)
        assert stats.rank is not None
        self.last_step = self.reattached_at = stats.rank.last_step
        self.progress()

    def step(self, step: int, grads: list[np.ndarray]) -> StepDone:
        for g, slot in zip(grads, self.slots, strict=True):
            self.region(slot.grads[0])[:] = g
        self.progress(pending=step)
        done = self.conn.request(Step(step=step, attempt=step))
        assert isinstance(done, StepDone)
        self.last_step = step
        self.progress()
        return done

    def run(self, last: int, *, fixed_grads: bool = False, delay_s: float = 0.0, stop_file: str = "") -> None:
        fixed = grads_for(self.seed, 1, self.sizes) if fixed_grads else None
        for step in range(self.last_step + 1, last + 1):
            self.step(step, fixed if fixed is not None else grads_for(self.seed, step, self.sizes))
            if delay_s:
                time.sleep(delay_s)
            if stop_file and os.path.exists(stop_file):
                break

    def params(self) -> np.ndarray:
        return np.concatenate([self.region(slot.param).copy() for slot in self.slots])

    def detach(self) -> None:
        self.conn.request(Detach(keep_state=False))
        self.close()

    def close(self) -> None:
        self.window = np.empty(0, dtype=np.uint8)
        self.storage = np.empty(0, dtype=np.uint8)
        self.conn.close()


def train(args: argparse.Namespace) -> dict[str, object]:
    sizes = [int(x) for x in args.sizes.split(",")]
    trainer = Trainer(args.socket, args.job, sizes, seed=args.seed, timeout_s=args.timeout, progress=args.progress)
    try:
        if args.reattach:
            if args.wait_stdin:
                sys.stdin.readline()
            with open(args.progress) as f:
                trainer.reattach(json.load(f)["token"])
        else:
            trainer.start_fresh()
        trainer.run(args.steps, fixed_grads=args.grads == "fixed", delay_s=args.step_delay, stop_file=args.stop_file)
        if args.out:
            np.save(args.out, trainer.params())
        if args.detach:
            trainer.detach()
    except TiermemError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "last_step": trainer.last_step}
    return {"token": trainer.token, "last_step": trainer.last_step, "reattached_at": trainer.reattached_at}


def try_join(args: argparse.Namespace) -> dict[str, object]:
    """Start job ``--job``, then try to attach to job ``--target`` with no, our own, and a made-up token."""
    own = Trainer(args.socket, args.job, [16], timeout_s=args.timeout)
    own.start_fresh()
    errors: dict[str, str | None] = {}
    for label, token in (("none", None), ("own", own.token), ("random", secrets.token_hex(16))):
        conn = Connection.open(args.socket, timeout_s=args.timeout)
        try:
            _, fds = conn.request_fds(Attach(job_id=args.target, rank=0, world_size=1, window_nbytes=4096, token=token))
            for fd in fds:
                os.close(fd)
            errors[label] = None
        except TiermemError as exc:
            errors[label] = type(exc).__name__
        finally:
            conn.close()
    own.detach()
    return {"errors": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    train_p = sub.add_parser("train")
    attach_p = sub.add_parser("attach")
    for p in (train_p, attach_p):
        p.add_argument("--socket", required=True)
        p.add_argument("--job", required=True)
        p.add_argument("--timeout", type=float, default=60.0)
    train_p.add_argument("--sizes", default="300,40")
    train_p.add_argument("--steps", type=int, default=10)
    train_p.add_argument("--seed", type=int, default=0)
    train_p.add_argument("--grads", choices=["per-step", "fixed"], default="per-step")
    train_p.add_argument("--progress", default="")
    train_p.add_argument("--out", default="")
    train_p.add_argument("--step-delay", type=float, default=0.0)
    train_p.add_argument("--stop-file", default="")
    train_p.add_argument("--reattach", action="store_true")
    train_p.add_argument("--wait-stdin", action="store_true", help="with --reattach: start once a line arrives")
    train_p.add_argument("--no-detach", dest="detach", action="store_false")
    attach_p.add_argument("--target", required=True)
    args = parser.parse_args(argv)
    result = train(args) if args.cmd == "train" else try_join(args)
    print(json.dumps(result), flush=True)
    return EXIT_DAEMON_ERROR if result.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
