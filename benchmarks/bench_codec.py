"""Message codec cost: today's hand-written codec against the declared one (``tiermem.protocol.spec``) and msgspec.

For STEP (one group, clipping, 64 tensor ids), BUCKET_READY (64 tensor ids, one
group), STEP_DONE (two timings) and REGISTER (200 tensors, two groups), the CPU
time of this thread per message to encode a whole frame (header + JSON
payload) and to decode one with every field checked:

- ``today``: ``encode_message`` / ``decode_message(decode_frame(...))``, the
  hand-written ``to_payload``/``from_payload`` of ``tiermem.protocol``;
- ``spec``: the same frame and JSON functions around the declared classes of
  ``tests/spec_messages.py`` (the generated ``to_payload``/``from_payload``,
  the ones the equivalence tests hold to today's answers);
- ``spec, closures``: the same declarations compiled into nested closures
  (one small function per field kind, written in this script) instead of
  generated source: the design ``tiermem.protocol.spec`` did not take;
- ``spec, checks only``: decoding through the interpreted checks alone
  (``RecordSpec.decode_checked``), the cost of a declarative layer without
  generated code: what a payload needing conversion (an int for a float) or
  carrying an error pays;
- ``msgspec`` (when importable): ``msgspec.json`` with ``Struct`` types and
  ``Meta`` constraints, which parses and validates in one C pass.  It differs
  on the wire: it refuses the ``NaN``/``Infinity`` tokens the protocol allows
  (``STEP_DONE.grad_norm``) and encodes non-finite floats as ``null``.

A second table isolates the field checks: payload dict -> object, no JSON.

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
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import spec_messages as declared

from tiermem.protocol import (
    MESSAGE_CLASSES,
    MsgType,
    decode_frame,
    decode_message,
    decode_payload,
    encode_frame,
    encode_message,
    encode_payload,
)
from tiermem.protocol.records import (
    DTYPES,
    FLOAT_MAX,
    MAX_DIM,
    MAX_GROUPS,
    MAX_NAME,
    MAX_NDIM,
    MAX_STEP,
    MAX_TENSORS,
    MAX_TIMINGS,
    PLACEMENTS,
)
from tiermem.protocol.spec import Bool, Choice, Float, Int, Kind, List, Map, Opt, RecordSpec, Str, Tuple

try:
    import msgspec
except ImportError:  # the msgspec rows are left out
    msgspec = None  # type: ignore[assignment]


# --------------------------------------------------------------------------- the messages


def messages() -> list[tuple[str, Any]]:
    """(name, declared message); today's and msgspec's are decoded from its payload."""
    group = declared.ParamGroup(lr=3e-4, weight_decay=0.1)
    groups = (group, declared.ParamGroup(lr=1e-4, weight_decay=0.0, adamw=False))
    tensors = tuple(
        declared.TensorSpec(f"model.layers.{i // 8}.mlp.w{i % 8}", (4096, 4096), "bfloat16", "auto", i % 2)
        for i in range(200)
    )
    return [
        (
            "STEP (1 group, clipping, 64 ids)",
            declared.Step(
                step=1000, groups=(group,), loss_scale=65536.0, max_grad_norm=1.0, tensor_ids=tuple(range(64))
            ),
        ),
        (
            "BUCKET_READY (64 ids, 1 group)",
            declared.BucketReady(step=1000, attempt=0, bucket=3, tensor_ids=tuple(range(64)), groups=(group,)),
        ),
        (
            "STEP_DONE (2 timings)",
            declared.StepDone(
                step=1000, attempt=0, found_inf=False, grad_norm=0.8731, timings=(("wait", 1.2e-4), ("update", 0.0312))
            ),
        ),
        ("REGISTER (200 tensors)", declared.Register(tensors=tensors, groups=groups)),
    ]


# --------------------------------------------------------------------------- msgspec declarations

if msgspec is not None:
    # No defaults: msgspec treats a field with a default as optional on the wire, and every key is required here.
    from msgspec import Meta, Struct

    StepNo = Annotated[int, Meta(ge=0, le=MAX_STEP)]
    TensorId = Annotated[int, Meta(ge=0, le=MAX_TENSORS - 1)]
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

    class MStep(Struct, forbid_unknown_fields=True):
        step: StepNo
        attempt: StepNo
        groups: Annotated[tuple[MParamGroup, ...], Meta(max_length=MAX_GROUPS)]
        loss_scale: Positive
        max_grad_norm: Positive | None
        skip_nonfinite: bool
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
        found_inf: bool
        grad_norm: Annotated[float, Meta(ge=0.0)] | None
        params_ready: bool
        timings: Annotated[dict[TimingName, NonNeg], Meta(max_length=MAX_TIMINGS)]

    MSGSPEC_TYPES: dict[str, Any] = {
        "Step": MStep,
        "BucketReady": MBucketReady,
        "StepDone": MStepDone,
        "Register": MRegister,
    }


# --------------------------------------------------------------------------- the closure alternative

_FAIL: Any = object()


def closure(kind: Kind) -> Callable[[Any], Any]:
    """A function checking and decoding one value of ``kind``: the value, or ``_FAIL`` (no error wording)."""
    if isinstance(kind, Int):
        lo, hi = kind.lo, kind.hi
        return lambda v: v if type(v) is int and lo <= v <= hi else _FAIL
    if isinstance(kind, Float):
        return lambda v: v if type(v) is float and _passes(kind, v) else _FAIL
    if kind is Bool:
        return lambda v: v if type(v) is bool else _FAIL
    if isinstance(kind, Str) and kind.pattern is None:
        short, long = kind.min_len, kind.max_len
        return lambda v: v if type(v) is str and short <= len(v) <= long else _FAIL
    if isinstance(kind, Choice) and kind.plain:
        names = frozenset(kind.names)
        return lambda v: v if type(v) is str and v in names else _FAIL
    if isinstance(kind, Opt):
        inner = closure(kind.kind)
        return lambda v: None if v is None else inner(v)
    if isinstance(kind, List):
        return _list_closure(closure(kind.item), kind.min_len, kind.max_len)
    if isinstance(kind, Tuple):
        items = [closure(k) for k in kind.items]
        return lambda v: _tuple_of(items, v) if type(v) is list and len(v) == len(items) else _FAIL
    if isinstance(kind, Map):
        key, value, most = closure(kind.key), closure(kind.value), kind.max_len
        return lambda v: _map_of(key, value, v) if type(v) is dict and len(v) <= most else _FAIL
    if isinstance(kind, RecordSpec) and not kind.array:
        return _record_closure(kind)
    raise NotImplementedError(kind)


def _passes(kind: Float, v: float) -> bool:
    lo, hi = max(kind.lo, -FLOAT_MAX), min(kind.hi, FLOAT_MAX)
    return (v > lo if kind.lo_open else v >= lo) and (v < hi if kind.hi_open else v <= hi)


def _list_closure(item: Callable[[Any], Any], short: int, long: int) -> Callable[[Any], Any]:
    def decode(v: Any) -> Any:
        if type(v) is not list or not short <= len(v) <= long:
            return _FAIL
        out = []
        for x in v:
            y = item(x)
            if y is _FAIL:
                return _FAIL
            out.append(y)
        return tuple(out)

    return decode


def _tuple_of(items: list[Callable[[Any], Any]], v: list[Any]) -> Any:
    out = tuple([f(x) for f, x in zip(items, v, strict=True)])
    return _FAIL if any(y is _FAIL for y in out) else out


def _map_of(key: Callable[[Any], Any], value: Callable[[Any], Any], v: dict[str, Any]) -> Any:
    out = tuple([(key(k), value(x)) for k, x in v.items()])
    return _FAIL if any(k is _FAIL or x is _FAIL for k, x in out) else out


def _record_closure(spec: RecordSpec) -> Callable[[Any], Any]:
    fields = [(f.key, closure(f.kind)) for f in spec.fields]
    count, ctor, validates = len(fields), spec.cls, spec.validates

    def decode(d: Any, ctor: Any = ctor) -> Any:
        if type(d) is not dict or len(d) != count:
            return _FAIL
        values = []
        for key, f in fields:
            if key not in d:
                return _FAIL
            value = f(d[key])
            if value is _FAIL:
                return _FAIL
            values.append(value)
        obj = ctor(*values)
        if validates:
            obj.validate()
        return obj

    return decode


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


Codec = tuple[Callable[[], bytes] | None, Callable[[bytes], Any], Callable[[Any], Any]]


def codecs(msg: Any) -> dict[str, Codec]:
    """name -> (encode this message to a frame (None: as the row above), decode a frame, payload dict -> object)."""
    cls = type(msg)
    msg_type: MsgType = cls.TYPE
    payload = json.loads(json.dumps(msg.to_payload()))
    old_cls = MESSAGE_CLASSES[msg_type]
    old = old_cls.from_payload(payload)
    spec = cls.__wire__

    def spec_decode(data: bytes) -> Any:
        return cls.from_payload(decode_payload(decode_frame(data).payload))

    by_closures = _record_closure(spec)

    def closure_from_dict(d: Any) -> Any:
        obj = by_closures(d, cls)
        return spec.decode_checked(cls, d) if obj is _FAIL else obj

    def closure_decode(data: bytes) -> Any:
        return closure_from_dict(decode_payload(decode_frame(data).payload))

    def checked_decode(data: bytes) -> Any:
        return spec.decode_checked(cls, decode_payload(decode_frame(data).payload))

    out: dict[str, Codec] = {
        "today": (
            lambda: encode_message(old, 1),
            lambda data: decode_message(decode_frame(data)),
            old_cls.from_payload,
        ),
        "spec": (
            lambda: encode_frame(msg_type, 1, encode_payload(msg.to_payload())),
            spec_decode,
            cls.from_payload,
        ),
        "spec, closures": (None, closure_decode, closure_from_dict),
        "spec, checks only": (
            None,
            checked_decode,
            lambda d: spec.decode_checked(cls, d),
        ),
    }
    if msgspec is not None:
        mtype = MSGSPEC_TYPES[cls.__name__]
        encoder, decoder = msgspec.json.Encoder(), msgspec.json.Decoder(mtype)
        mmsg = msgspec.json.decode(json.dumps(payload), type=mtype)

        def msgspec_decode(data: bytes) -> Any:
            return decoder.decode(decode_frame(data).payload)

        out["msgspec"] = (
            lambda: encode_frame(msg_type, 1, encoder.encode(mmsg)),
            msgspec_decode,
            lambda d: msgspec.convert(d, mtype),
        )
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal wire content (objects of different classes compared through their JSON)."""

    def plain(x: Any) -> Any:
        if msgspec is not None and isinstance(x, msgspec.Struct):
            return json.loads(msgspec.json.encode(x))
        return json.loads(json.dumps(x.to_payload()))

    return bool(plain(a) == plain(b))


def measure(runs: int, run_s: float) -> list[dict[str, Any]]:
    rows = []
    for name, msg in messages():
        if MESSAGE_CLASSES[msg.TYPE].KEYS != type(msg).KEYS:
            print(f"{name}: skipped, tiermem.protocol declares it with other fields than tests/spec_messages.py")
            continue
        table = codecs(msg)
        reference = encode_message(MESSAGE_CLASSES[msg.TYPE].from_payload(msg.to_payload()), 1)
        payload = decode_payload(decode_frame(reference).payload)
        fns: dict[tuple[str, str], Callable[[], object]] = {}
        for codec, (encode, decode, from_dict) in table.items():
            frame = encode() if encode is not None else reference
            decoded = decode(reference)
            if not _same(decoded, decode(frame)) or not _same(decoded, table["today"][1](reference)):
                raise SystemExit(f"{codec} decodes {name} differently from today's codec")
            if encode is not None:
                fns[codec, "encode"] = encode
            fns[codec, "decode"] = lambda d=reference, f=decode: f(d)
            fns[codec, "checks"] = lambda p=payload, f=from_dict: f(p)
            rows.append(
                {"message": name, "codec": codec, "frame_bytes": len(frame), "same_bytes_as_today": frame == reference}
            )
        times = medians_us(fns, runs, run_s)
        for row in rows[-len(table) :]:
            for what in ("encode", "decode", "checks"):
                mine, base = times.get((row["codec"], what)), times[("today", what)]
                row[f"{what}_us"] = mine
                row[f"{what}_vs_today"] = None if mine is None else mine / base
    return rows


def _us(value: float) -> str:
    return f"{value / 1000:.2f} ms" if value >= 1000 else f"{value:.1f} us"


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| message | codec | bytes | encode | decode | encode / today | decode / today | checks | checks / today |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "" if r["same_bytes_as_today"] else " (differ)"
        encode = "" if r["encode_us"] is None else _us(r["encode_us"])
        encode_ratio = "" if r["encode_vs_today"] is None else f"{r['encode_vs_today']:.2f}"
        print(
            f"| {r['message']} | {r['codec']} | {r['frame_bytes']}{same} | {encode} | "
            f"{_us(r['decode_us'])} | {encode_ratio} | {r['decode_vs_today']:.2f} | "
            f"{_us(r['checks_us'])} | {r['checks_vs_today']:.2f} |"
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
