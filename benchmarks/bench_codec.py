"""Message codec cost: the declarative codec of ``tiermem.core.protocol`` against a plain json-only baseline
(and msgspec).

For STEP (one group, clipping, 64 tensor ids), BUCKET_READY (64 tensor ids, one
group), STEP_DONE (two timings), REGISTER (200 tensors, two groups) and
REGISTER_OK (200 slots), the CPU time of this thread per message to encode a
whole frame (header + JSON payload) and to decode one:

- ``json only``: the baseline, the same frame functions and ``json`` with no
  message classes at all: encode a ready payload dict, decode to a dict, no
  field checked.  What is left above it is the codec's own cost (building the
  payload from the object, checking every field, building the objects);
- ``declared``: ``encode_message`` / ``decode_message(decode_frame(...))``,
  the ``to_payload``/``from_payload`` that ``@wire`` generates from each
  message's declaration (``tiermem.core.protocol.spec``);
- ``declared, checks only``: decoding through the interpreted checks alone
  (``RecordSpec.decode_checked``), what a payload needing conversion (an int
  for a float) or carrying an error pays;
- ``msgspec`` (when importable): ``msgspec.json`` with ``Struct`` types and
  ``Meta`` constraints, which parses and validates in one C pass.  It differs
  on the wire: it refuses the ``NaN``/``Infinity`` tokens the protocol allows
  (``STEP_DONE.grad_norm``), encodes non-finite floats as ``null`` and writes
  ``1e-08`` as ``1e-8``.

The ``checks`` column isolates the field checks: payload dict -> object, no JSON.

Run from the repository root (msgspec rows only where msgspec is installed;
a side install works: ``pip install --target DIR msgspec`` and ``PYTHONPATH=DIR``):

    .venv/bin/python benchmarks/bench_codec.py [--runs 21] [--run-ms 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from tiermem.core import protocol
from tiermem.core.modes import Placement
from tiermem.core.protocol.records import (
    DTYPES,
    MAX_DIM,
    MAX_GROUPS,
    MAX_NAME,
    MAX_NBYTES,
    MAX_NDIM,
    MAX_STEP,
    MAX_TENSORS,
    MAX_TIMINGS,
    MAX_WINDOW_ID,
    PLACEMENTS,
    STATE_KEYS,
)
from tiermem.core.protocol.spec import FLOAT_MAX

try:
    import msgspec
except ImportError:  # the msgspec rows are left out
    msgspec = None  # type: ignore[assignment]

BASELINE = "json only"

# --------------------------------------------------------------------------- the messages


def tensor_slots(count: int) -> tuple[protocol.TensorSlot, ...]:
    """A REGISTER_OK's ``count`` slots: tensor ``i``'s param at ``i`` x 32 MiB of window 1, one grad buffer."""
    return tuple(
        protocol.TensorSlot(
            i, protocol.MemRef(1, i << 25, 1 << 25), (protocol.MemRef(1, (i << 25) + (1 << 24), 1 << 24),)
        )
        for i in range(count)
    )


def messages() -> list[tuple[str, protocol.Message]]:
    group = protocol.ParamGroup(lr=3e-4, weight_decay=0.1)
    groups = (group, protocol.ParamGroup(lr=1e-4, weight_decay=0.0, adamw=False))
    tensors = tuple(
        protocol.TensorSpec(f"model.layers.{i // 8}.mlp.w{i % 8}", (4096, 4096), "bfloat16", Placement.AUTO, i % 2)
        for i in range(200)
    )
    slots = tensor_slots(200)
    return [
        (
            "STEP (1 group, clipping, 64 ids)",
            protocol.Step(
                step=1000, groups=(group,), loss_scale=65536.0, max_grad_norm=1.0, tensor_ids=tuple(range(64))
            ),
        ),
        (
            "BUCKET_READY (64 ids, 1 group)",
            protocol.BucketReady(step=1000, attempt=0, bucket=3, tensor_ids=tuple(range(64)), groups=(group,)),
        ),
        (
            "STEP_DONE (2 timings)",
            protocol.StepDone(step=1000, attempt=0, grad_norm=0.8731, timings=(("wait", 1.2e-4), ("update", 0.0312))),
        ),
        ("REGISTER (200 tensors)", protocol.Register(tensors=tensors, groups=groups)),
        ("REGISTER_OK (200 slots)", protocol.RegisterOk(slots=slots, storage_nbytes=200 << 25)),
    ]


# --------------------------------------------------------------------------- msgspec declarations

if msgspec is not None:
    # No defaults: msgspec treats a field with a default as optional on the wire, and every key is required here.
    from msgspec import Meta, Struct

    StepNo = Annotated[int, Meta(ge=0, le=MAX_STEP)]
    TensorId = Annotated[int, Meta(ge=0, le=MAX_TENSORS - 1)]
    NBytes = Annotated[int, Meta(ge=0, le=MAX_NBYTES)]
    NonNeg = Annotated[float, Meta(ge=0.0, le=FLOAT_MAX)]
    Beta = Annotated[float, Meta(ge=0.0, lt=1.0)]
    Positive = Annotated[float, Meta(gt=0.0, le=FLOAT_MAX)]
    GradBuffer = Annotated[int, Meta(ge=0, le=1)]
    Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
    TimingName = Annotated[str, Meta(max_length=MAX_NAME)]

    class MParamGroup(Struct, forbid_unknown_fields=True, frozen=True):
        lr: NonNeg
        betas: tuple[Beta, Beta]
        eps: NonNeg
        weight_decay: NonNeg
        adamw: bool
        maximize: bool

    class MTensorSpec(Struct, forbid_unknown_fields=True, frozen=True):
        name: Name
        shape: Annotated[tuple[Annotated[int, Meta(ge=0, le=MAX_DIM)], ...], Meta(max_length=MAX_NDIM)]
        dtype: Literal[DTYPES]
        placement: Literal[PLACEMENTS]
        group: Annotated[int, Meta(ge=0, le=MAX_GROUPS - 1)]

    class MRegister(Struct, forbid_unknown_fields=True):
        tensors: Annotated[tuple[MTensorSpec, ...], Meta(max_length=MAX_TENSORS)]
        groups: Annotated[tuple[MParamGroup, ...], Meta(min_length=1, max_length=MAX_GROUPS)]
        grad_buffers: Annotated[int, Meta(ge=1, le=2)]
        exchange: Literal["shared"]

        def __post_init__(self) -> None:
            seen: set[str] = set()
            for index, tensor in enumerate(self.tensors):
                if tensor.group >= len(self.groups):
                    raise ValueError(f"tensors[{index}].group: expected a group index < {len(self.groups)}")
                if tensor.name in seen:
                    raise ValueError(f"tensors[{index}].name: expected a name not used before in this message")
                seen.add(tensor.name)

    class MMemRef(Struct, array_like=True, frozen=True):
        window: Annotated[int, Meta(ge=0, le=MAX_WINDOW_ID)]
        offset: NBytes
        length: NBytes

    class MTensorSlot(Struct, array_like=True, frozen=True):
        tensor_id: TensorId
        param: MMemRef
        grads: Annotated[tuple[MMemRef, ...], Meta(min_length=1, max_length=2)]

    class MRegisterOk(Struct, forbid_unknown_fields=True):
        slots: Annotated[tuple[MTensorSlot, ...], Meta(max_length=MAX_TENSORS)]
        placement: Literal["cpu", "nvme"]
        state_keys: Annotated[tuple[Literal[STATE_KEYS], ...], Meta(max_length=len(STATE_KEYS))]
        storage_nbytes: NBytes

    class MStep(Struct, forbid_unknown_fields=True):
        step: StepNo
        attempt: StepNo
        groups: Annotated[tuple[MParamGroup, ...], Meta(max_length=MAX_GROUPS)]
        loss_scale: Positive
        max_grad_norm: Positive | None
        clip_coef: Annotated[float, Meta(ge=0.0, le=1.0)] | None
        skip: bool
        tensor_ids: Annotated[tuple[TensorId, ...], Meta(max_length=MAX_TENSORS)]
        delayed: bool
        grad_buffer: GradBuffer

    class MBucketReady(Struct, forbid_unknown_fields=True):
        step: StepNo
        attempt: StepNo
        bucket: Annotated[int, Meta(ge=0, le=MAX_TENSORS)]
        tensor_ids: Annotated[tuple[TensorId, ...], Meta(min_length=1, max_length=MAX_TENSORS)]
        grad_buffer: GradBuffer
        groups: Annotated[tuple[MParamGroup, ...], Meta(min_length=1, max_length=MAX_GROUPS)]

    class MStepDone(Struct, forbid_unknown_fields=True):
        step: StepNo
        attempt: StepNo
        skipped: bool
        nonfinite: bool
        skipped_steps: StepNo
        grad_norm: Annotated[float, Meta(ge=0.0)] | None
        params_ready: bool
        timings: Annotated[dict[TimingName, NonNeg], Meta(max_length=MAX_TIMINGS)]

    MSGSPEC_TYPES: dict[str, Any] = {
        "Step": MStep,
        "BucketReady": MBucketReady,
        "StepDone": MStepDone,
        "Register": MRegister,
        "RegisterOk": MRegisterOk,
    }


# --------------------------------------------------------------------------- codecs


def run_us(fn: Callable[[], object], run_s: float) -> float:
    """Thread CPU time per call over a run of at least ``run_s``.

    CPU time, not wall time: the codec is pure computation, and on a shared
    machine wall time would mostly measure the other tenants.
    """
    count, start = 0, time.thread_time()
    while True:
        fn()
        count += 1
        elapsed = time.thread_time() - start
        if elapsed >= run_s:
            return elapsed / count * 1e6


def medians_us(fns: dict[Any, Callable[[], object]], runs: int, run_s: float) -> dict[Any, float]:
    """Median per-call time of each function, the runs taken round-robin so all see the same machine."""
    times: dict[Any, list[float]] = {key: [] for key in fns}
    for _ in range(runs):
        for key, fn in fns.items():
            times[key].append(run_us(fn, run_s))
    return {key: statistics.median(t) for key, t in times.items()}


Codec = tuple[Callable[[], bytes] | None, Callable[[bytes], Any], Callable[[Any], Any] | None]


def codecs(msg: protocol.Message) -> dict[str, Codec]:
    """name -> (encode this message to a frame (None: as ``declared``), decode a frame, payload dict -> object)."""
    cls, msg_type = type(msg), msg.TYPE
    payload = json.loads(json.dumps(msg.to_payload()))
    spec = cls.__wire__

    def json_decode(data: bytes) -> Any:
        return protocol.decode_payload(protocol.decode_frame(data).payload)

    def checked_decode(data: bytes) -> Any:
        return spec.decode_checked(cls, protocol.decode_payload(protocol.decode_frame(data).payload))

    out: dict[str, Codec] = {
        BASELINE: (lambda: protocol.encode_frame(msg_type, 1, protocol.encode_payload(payload)), json_decode, None),
        "declared": (
            lambda: protocol.encode_message(msg, 1),
            lambda data: protocol.decode_message(protocol.decode_frame(data)),
            cls.from_payload,
        ),
        "declared, checks only": (None, checked_decode, lambda d: spec.decode_checked(cls, d)),
    }
    if msgspec is not None:
        mtype = MSGSPEC_TYPES[cls.__name__]
        encoder, decoder = msgspec.json.Encoder(), msgspec.json.Decoder(mtype)
        mmsg = msgspec.json.decode(json.dumps(payload), type=mtype)

        def msgspec_decode(data: bytes) -> Any:
            return decoder.decode(protocol.decode_frame(data).payload)

        out["msgspec"] = (
            lambda: protocol.encode_frame(msg_type, 1, encoder.encode(mmsg)),
            msgspec_decode,
            lambda d: msgspec.convert(d, mtype),
        )
    return out


def _plain(x: Any) -> Any:
    """The wire content of a decoded message (a dict, a declared message or a msgspec Struct)."""
    if isinstance(x, dict):
        return x
    if msgspec is not None and isinstance(x, msgspec.Struct):
        return json.loads(msgspec.json.encode(x))
    return json.loads(json.dumps(x.to_payload()))


def measure(runs: int, run_s: float) -> list[dict[str, Any]]:
    rows = []
    for name, msg in messages():
        table = codecs(msg)
        reference = protocol.encode_message(msg, 1)
        payload = protocol.decode_payload(protocol.decode_frame(reference).payload)
        fns: dict[tuple[str, str], Callable[[], object]] = {}
        for codec, (encode, decode, from_dict) in table.items():
            frame = encode() if encode is not None else reference
            expected = _plain(protocol.decode_message(protocol.decode_frame(reference)))
            if _plain(decode(reference)) != expected or _plain(decode(frame)) != expected:
                raise SystemExit(f"{codec} decodes {name} differently from the declared codec")
            if encode is not None:
                fns[codec, "encode"] = encode
            fns[codec, "decode"] = lambda d=reference, f=decode: f(d)
            if from_dict is not None:
                fns[codec, "checks"] = lambda p=payload, f=from_dict: f(p)
            rows.append({"message": name, "codec": codec, "frame_bytes": len(frame), "same_bytes": frame == reference})
        times = medians_us(fns, runs, run_s)
        for row in rows[-len(table) :]:
            for what in ("encode", "decode", "checks"):
                row[f"{what}_us"] = times.get((row["codec"], what))
            for what in ("encode", "decode"):
                mine, base = row[f"{what}_us"], times[(BASELINE, what)]
                row[f"{what}_vs_json"] = None if mine is None else mine / base
    return rows


def _us(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.1f} us"


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| message | codec | bytes | encode | decode | encode / json | decode / json | checks |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "" if r["same_bytes"] else " (differ)"
        print(
            f"| {r['message']} | {r['codec']} | {r['frame_bytes']}{same} | {_us(r['encode_us'])} | "
            f"{_us(r['decode_us'])} | {_ratio(r['encode_vs_json'])} | {_ratio(r['decode_vs_json'])} | "
            f"{_us(r['checks_us'])} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--runs", type=int, default=21, help="timed runs per figure, round-robin (the median is reported)"
    )
    parser.add_argument("--run-ms", type=float, default=20.0, help="CPU time of one run")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args()
    rows = measure(args.runs, args.run_ms / 1000)
    print(
        f"codec: thread CPU time per message, median of {args.runs} runs of >= {args.run_ms:g} ms; "
        f"python {platform.python_version()}, msgspec {msgspec.__version__ if msgspec else 'not installed'}, "
        f"cpus={os.cpu_count()}"
    )
    print("(encode/decode: whole frames; checks: payload dict -> object, no JSON)\n")
    print_table(rows)
    if args.json:
        out = {
            "rows": rows,
            "config": {
                "runs": args.runs,
                "run_ms": args.run_ms,
                "python": platform.python_version(),
                "msgspec": msgspec.__version__ if msgspec else None,
                "cpus": os.cpu_count(),
            },
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
