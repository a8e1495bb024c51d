"""Compressed Adam moments (``state_dtype``): their formats and one update over them, in plain torch.  Pure.

``fp32`` keeps ``exp_avg`` and ``exp_avg_sq`` as they are (exact AdamW).  The two
compressed forms keep the fp32 master where the model's dtype is lower, and
store only the moments smaller:

- ``bf16``: each moment in bfloat16, 2 bytes an element (8 bytes of state a
  param with the master, against 12).
- ``int8``: block-wise 8-bit codes, the scheme of 8-bit Adam (Dettmers et al.,
  "8-bit Optimizers via Block-wise Quantization", ICLR 2022): each block of
  ``BLOCK`` (256, torchao's ``AdamW8bit`` default) elements is normalised by
  its largest magnitude, kept in fp32 beside the codes, so an outlier costs
  only its own block; the codes are non-linear, so that small values keep
  their relative precision instead of rounding to zero (the zero-point
  problem of the second moment, Li et al., "Memory Efficient Optimizers with
  4-bit States", NeurIPS 2023).  Here a code is a minifloat relative to the
  block's largest: the top bits of the normalised value's fp32 form, its
  exponent and 3 mantissa bits (eight codes an octave, 6.25-12.5% apart),
  counted down from the largest, 0 standing for zero.  ``exp_avg`` has 127
  magnitudes and a sign (int8 -127..127), a range of 2**-15.7 below its
  block's largest; ``exp_avg_sq`` 255 (uint8), 2**-31.7.  Both directions are
  integer operations on the fp32 bits (no logarithms).  1 + 1 + 8/256 bytes an
  element: 6.03 bytes of state a param with the master.

Rounding is stochastic and unbiased in the stored value (a value between two
neighbouring codes takes the upper one with the probability of its linear
distance from the lower), as in low-precision training since Gupta et al.,
"Deep Learning with Limited Numerical Precision" (ICML 2015).  Why: the
second moment moves by ``1 - beta2`` = 0.1% a step, far below either format's
step (0.4% for bf16, 9% for the codes); rounded to the nearest, it would stop
moving after the first few dozen steps and the bias correction would then
grow every update; rounded stochastically its expectation is the exact EMA.
The random bits are a 32-bit hash of the element's index in its tensor's
state and its step count (the low half rounds ``exp_avg``, the high half
``exp_avg_sq``), so a run is reproducible bit for bit, and an element's
rounding does not depend on how the state is cut into chunks.

Checkpoints carry the moments as AdamW's fp32 values (``dequantize``), so a
state dict loads into ``torch.optim.AdamW`` and AdamW's into this; a resume
is exact because quantizing those values gives back the codes and scales
they came from, whatever the random numbers:

- a block's largest is its scale times 1, exact, so the scale comes back;
- any other value, code value times scale, normalised by a product with the
  scale's reciprocal, misses its code's value by three roundings (a unit of
  the fp32 bits, measured), and ``_HALF_STEP`` lands anything within 8 units
  of a code on it;
- bf16 moments are fp32 values ``round_bf16`` keeps as they are.

The bound: the dequantized values must be normal fp32 numbers (a block's
largest ``exp_avg`` at least ``2**-110``, ``exp_avg_sq`` ``2**-94``, about
5e-29); below, fp32 rounds the smallest codes' values themselves.  Carrying
the raw codes and scales under keys of their own instead was turned down:
AdamW would ignore them, but a state dict made or changed elsewhere (AdamW's,
a resharded one, a cast) would then disagree with its own ``exp_avg``, a
second home for one fact.  An int8 block must be quantized from all of its
values at once: quantizing part of a block against the part's largest, then
again with the rest against the whole block's, moves the first part (the
state transfer cuts moments on blocks: ``tiermem.client.offload.transfer``).

Non-finite moments (a step's grads held inf or NaN and nothing skipped it)
poison what they touch, as they poison AdamW's state: a bf16 moment keeps the
inf or NaN; an int8 block holding one reads back as NaN in every element.

A step with ``v`` exactly zero after the update moves its element by the
weight decay only: in exact arithmetic ``m`` is then zero too, but a
compressed ``v`` may round to zero while ``m`` does not, and ``m / eps``
would throw the element away.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiermem.core.adam_math import AdamScalars, adam_update
from tiermem.core.errors import InvalidArgument
from tiermem.core.modes import STATE_DTYPES

__all__ = [
    "BLOCK",
    "PER_OCTAVE",
    "STATE_DTYPES",
    "LowbitMoments",
    "blocks_of",
    "dequantize_signed",
    "dequantize_unsigned",
    "hash32",
    "lowbit_update",
    "moment_nbytes",
    "quantize_signed",
    "quantize_unsigned",
    "random_halves",
    "round_bf16",
]

BLOCK = 256
"""Elements per quantization block of ``int8`` (one fp32 scale each)."""
PER_OCTAVE = 8
"""Codes per factor of two (3 mantissa bits)."""
SIGNED_LEVELS = 127
"""Magnitude codes of ``exp_avg`` (the sign makes it int8)."""
UNSIGNED_LEVELS = 255
"""Codes of ``exp_avg_sq`` (uint8)."""
_SHIFT = 20
"""fp32 mantissa bits below a code's 3."""
_ONE = 127 << 3
"""The top 12 bits (exponent and 3 mantissa bits) of fp32 1.0: the code of a block's largest plus its base."""
_HALF_STEP = 1 << (_SHIFT - 16 - 1)
"""Half the step of the random numbers (a 16-bit number moves the fp32 bits in units of ``2**4``), added
before the bits are cut: the chance of rounding up is the distance to the lower code rounded to the nearest
``2**-16`` (cut, it was biased down by half a unit), and a value that misses a code by the few units of a
product's rounding (a dequantized value times the reciprocal of its scale) lands on it."""
_MASK32 = 0xFFFFFFFF
_NO_SCALES = torch.zeros(0)
"""The scales of fp32 and bf16 moments: none (shared: an empty tensor nothing writes)."""


def moment_nbytes(state_dtype: str) -> float:
    """Bytes one element of one moment takes (codes and their share of the block scales)."""
    if state_dtype == "fp32":
        return 4.0
    if state_dtype == "bf16":
        return 2.0
    if state_dtype == "int8":
        return 1.0 + 4.0 / BLOCK
    raise InvalidArgument(f"state_dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}")


def blocks_of(numel: int) -> int:
    return -(-numel // BLOCK)


def hash32(index: torch.Tensor, step: int) -> torch.Tensor:
    """A 32-bit integer hash (int64 values in [0, 2**32)) of int64 ``index`` and the step count:
    multiply-xorshift rounds.  Products wrap modulo 2**64; only their low 32 bits are kept, which the wrap
    does not change."""
    h = (index * 0x9E3779B1 + ((step * 0x85EBCA77 + 0x3C6EF372) & _MASK32)) & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & _MASK32
    return h ^ (h >> 16)


def random_halves(index: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent 16-bit random integers per index (int64): ``exp_avg``'s and ``exp_avg_sq``'s."""
    h = hash32(index, step)
    return h & 0xFFFF, h >> 16


def round_bf16(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded to bfloat16 stochastically: up with the probability of its distance from the
    value below, given uniform 16-bit integers ``r16``; exact values stay exact, inf and NaN stay."""
    bits = x.view(torch.int32).to(torch.int64) & _MASK32
    rounded = (bits + r16) & 0xFFFF0000  # a carry out of the low half (P = low / 2**16) rounds the magnitude up
    # the magnitude rounds (sign-magnitude): a carry into the exponent is the next binade, as it should be
    special = ~torch.isfinite(x)
    out = (rounded & _MASK32).to(torch.int32).view(torch.float32)
    out = torch.where(special, x, out)
    return out.to(torch.bfloat16)


def _base(levels: int) -> int:
    return _ONE - levels


def _code_value(code: torch.Tensor, levels: int) -> torch.Tensor:
    """The normalised value of codes ``code`` (integers >= 0): 0 for 0, else the fp32 number whose top 12
    bits are ``code + base``."""
    top = code.to(torch.int32) + _base(levels)
    return torch.where(code > 0, (top << _SHIFT).view(torch.float32), 0.0)


def _quantize_magnitude(n: torch.Tensor, r16: torch.Tensor, levels: int) -> torch.Tensor:
    """Codes 0..levels (int32) of normalised magnitudes ``n`` in [0, 1], rounded stochastically (unbiased in
    ``n``) with uniform 16-bit integers ``r16``; ``n`` within ``_HALF_STEP`` units of a code's value takes
    that code, whatever ``r16`` (see the module note on checkpoints)."""
    bits = n.view(torch.int32)
    code = ((bits + _HALF_STEP + (r16.to(torch.int32) << (_SHIFT - 16))) >> _SHIFT) - _base(levels)
    smallest = float(_code_value(torch.ones(1, dtype=torch.int32), levels))
    # below the smallest code: zero or the smallest, with P = n / smallest
    below = (r16.to(torch.float32) * (smallest / 65536.0) < n).to(torch.int32)
    return torch.where(n < smallest, below, code.clamp(max=levels))


def _blocked(x: torch.Tensor) -> torch.Tensor:
    """``x`` (flat) as [blocks, BLOCK], zero-padded at the end."""
    n = x.numel()
    pad = blocks_of(n) * BLOCK - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(-1, BLOCK)


def _normalised(magnitudes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``magnitudes`` ([blocks, BLOCK], >= 0) over their block's ``scale``, flat: a product with the scale's
    fp32 reciprocal (one division a block, not one an element), and exactly 1 for the block's largest."""
    inverse = 1.0 / torch.where(scale > 0, scale, 1.0)
    n = magnitudes * inverse[:, None]
    return torch.where(magnitudes == scale[:, None], 1.0, n).reshape(-1)


def _poison(blocks: torch.Tensor, scale: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A block holding inf or NaN reads back as NaN everywhere (scale NaN, codes 0), as AdamW's state would
    be poisoned by the same step."""
    bad = ~torch.isfinite(blocks).all(dim=1)
    if not bool(bad.any()):
        return codes, scale
    n = codes.numel()
    codes = torch.where(bad[:, None], 0, _blocked(codes))
    return codes.reshape(-1)[:n], torch.where(bad, torch.nan, scale)


def quantize_signed(x: torch.Tensor, r16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp_avg``'s form of flat fp32 ``x``: int8 codes (``x.numel()``) and fp32 block scales (the blocks'
    largest magnitude; NaN for a block holding inf or NaN)."""
    n = x.numel()
    blocks = _blocked(x)
    scale = blocks.abs().amax(dim=1)
    mag = _quantize_magnitude(_normalised(blocks.abs(), scale)[:n], r16, SIGNED_LEVELS)
    codes, scale = _poison(blocks, scale, torch.where(x < 0, -mag, mag))
    return codes.to(torch.int8), scale


def dequantize_signed(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n = codes.numel()
    mag = _code_value(codes.to(torch.int32).abs(), SIGNED_LEVELS)
    values = torch.where(codes < 0, -mag, mag)
    return (_blocked(values) * scale[:, None]).reshape(-1)[:n]


def quantize_unsigned(x: torch.Tensor, r16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp_avg_sq``'s form of flat fp32 ``x`` >= 0: uint8 codes and fp32 block scales (the blocks' max;
    NaN for a block holding inf or NaN)."""
    n = x.numel()
    blocks = _blocked(x)
    scale = blocks.amax(dim=1)
    codes = _quantize_magnitude(_normalised(blocks, scale)[:n], r16, UNSIGNED_LEVELS)
    codes, scale = _poison(blocks, scale, codes)
    return codes.to(torch.uint8), scale


def dequantize_unsigned(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n = codes.numel()
    values = _code_value(codes.to(torch.int32), UNSIGNED_LEVELS)
    return (_blocked(values) * scale[:, None]).reshape(-1)[:n]


@dataclass
class LowbitMoments:
    """The moments of ``numel`` elements in one ``state_dtype`` (flat tensors; ``int8`` with block scales).

    ``start``: the first element's index in its tensor's (or rank's) state, what the rounding hashes."""

    state_dtype: str
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_scale: torch.Tensor = field(default_factory=lambda: _NO_SCALES)
    """The blocks' largest ``exp_avg`` magnitudes (``int8``; empty otherwise)."""
    exp_avg_sq_scale: torch.Tensor = field(default_factory=lambda: _NO_SCALES)
    start: int = 0

    @classmethod
    def zeros(cls, numel: int, state_dtype: str, *, start: int = 0) -> LowbitMoments:
        moment_nbytes(state_dtype)  # refuses an unknown one
        if state_dtype == "fp32":
            return cls(state_dtype, torch.zeros(numel), torch.zeros(numel), start=start)
        if state_dtype == "bf16":
            return cls(
                state_dtype,
                torch.zeros(numel, dtype=torch.bfloat16),
                torch.zeros(numel, dtype=torch.bfloat16),
                start=start,
            )
        nb = blocks_of(numel)
        return cls(
            state_dtype,
            torch.zeros(numel, dtype=torch.int8),
            torch.zeros(numel, dtype=torch.uint8),
            torch.zeros(nb),
            torch.zeros(nb),
            start=start,
        )

    @property
    def numel(self) -> int:
        return self.exp_avg.numel()

    @property
    def nbytes(self) -> int:
        tensors = (self.exp_avg, self.exp_avg_sq, self.exp_avg_scale, self.exp_avg_sq_scale)
        return sum(t.numel() * t.element_size() for t in tensors)

    def piece(self, start: int, stop: int) -> LowbitMoments:
        """Elements [start, stop) as moments of their own (views; ``int8``: ``start`` on a block)."""
        if not 0 <= start <= stop <= self.numel:
            raise InvalidArgument(f"piece [{start}, {stop}) is not within [0, {self.numel}]")
        if self.state_dtype != "int8":
            return LowbitMoments(
                self.state_dtype, self.exp_avg[start:stop], self.exp_avg_sq[start:stop], start=self.start + start
            )
        if start % BLOCK:
            raise InvalidArgument(f"a piece of int8 moments must start on a block ({BLOCK} elements), got {start}")
        blocks = slice(start // BLOCK, start // BLOCK + blocks_of(stop - start))
        return LowbitMoments(
            self.state_dtype,
            self.exp_avg[start:stop],
            self.exp_avg_sq[start:stop],
            self.exp_avg_scale[blocks],
            self.exp_avg_sq_scale[blocks],
            start=self.start + start,
        )

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 copies of (exp_avg, exp_avg_sq): AdamW's form, what ``state_dict`` exports."""
        return self.dequantize_one("exp_avg"), self.dequantize_one("exp_avg_sq")

    def dequantize_one(self, key: str) -> torch.Tensor:
        """An fp32 copy of moment ``key`` (``exp_avg`` or ``exp_avg_sq``)."""
        if self.state_dtype != "int8":
            return self._codes(key).to(torch.float32)
        if key == "exp_avg":
            return dequantize_signed(self.exp_avg, self.exp_avg_scale)
        return dequantize_unsigned(self.exp_avg_sq, self.exp_avg_sq_scale)

    def store(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int) -> None:
        """Keep fp32 ``exp_avg`` and ``exp_avg_sq`` (an update's result, or a loaded checkpoint's), rounded
        with the numbers of ``step``."""
        if exp_avg.numel() != self.numel or exp_avg_sq.numel() != self.numel:
            raise InvalidArgument(
                f"moments of {exp_avg.numel()} and {exp_avg_sq.numel()} elements for a state of {self.numel}"
            )
        self.store_one("exp_avg", exp_avg, step=step)
        self.store_one("exp_avg_sq", exp_avg_sq, step=step)

    def store_one(self, key: str, values: torch.Tensor, *, step: int) -> None:
        """Keep fp32 ``values`` as moment ``key``, rounded with the numbers of ``step`` (the low half of the
        element's hash for ``exp_avg``, the high half for ``exp_avg_sq``, as ``store``)."""
        codes = self._codes(key)
        if values.numel() != self.numel:
            raise InvalidArgument(f"{key} of {values.numel()} elements for a state of {self.numel}")
        if self.state_dtype == "fp32":
            codes.copy_(values)
            return
        r_m, r_v = random_halves(torch.arange(self.start, self.start + self.numel, dtype=torch.int64), step)
        if self.state_dtype == "bf16":
            codes.copy_(round_bf16(values, r_m if key == "exp_avg" else r_v))
        elif key == "exp_avg":
            new, scale = quantize_signed(values, r_m)
            codes.copy_(new)
            self.exp_avg_scale.copy_(scale)
        else:
            new, scale = quantize_unsigned(values, r_v)
            codes.copy_(new)
            self.exp_avg_sq_scale.copy_(scale)

    def zero(self) -> None:
        """Reset both moments to zero (and an int8 state's scales)."""
        for t in (self.exp_avg, self.exp_avg_sq, self.exp_avg_scale, self.exp_avg_sq_scale):
            t.zero_()

    def _codes(self, key: str) -> torch.Tensor:
        if key == "exp_avg":
            return self.exp_avg
        if key == "exp_avg_sq":
            return self.exp_avg_sq
        raise InvalidArgument(f"a moment is 'exp_avg' or 'exp_avg_sq', got {key!r}")


def lowbit_update(
    param: torch.Tensor, grad: torch.Tensor, moments: LowbitMoments, s: AdamScalars, *, step: int
) -> torch.Tensor:
    """One Adam/AdamW step of fp32 ``param`` (flat, updated in place) over ``moments``: dequantize, update
    with ``adam_math.adam_update`` (float scalars: torch's op sequence, so ``fp32`` moments give AdamW's bits),
    round the new moments back.  The reference the fused kernel is held to; returns ``param``."""
    if moments.numel != param.numel() or grad.numel() != param.numel():
        raise InvalidArgument(
            f"param of {param.numel()}, grad of {grad.numel()} and moments of {moments.numel} elements differ"
        )
    m, v = moments.dequantize()
    p, m, v = adam_update(param, grad, m, v, s)
    if moments.state_dtype != "fp32":
        # see the module note: a v rounded to zero must not throw m / eps at the element
        p = torch.where(v > 0, p, param * s.decay)
    param.copy_(p)
    moments.store(m, v, step=step)
    return param
