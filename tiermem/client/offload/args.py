"""``OffloadAdam``'s constructor arguments: torch's rules and messages, and the contracts of the step modes.

Pure: no torch tensors, no daemon.  Everything a user can get wrong at
construction is refused here, before any connection is made.

- Hyper-parameters follow ``torch.optim.AdamW`` exactly: the same defaults
  (``weight_decay`` 0.01; ``torch.optim.Adam``'s 0 with ``adamw=False``), the
  same checks, the same ``ValueError`` messages, the same types: ``lr``,
  ``eps`` and ``weight_decay`` any real number (an int, a numpy scalar),
  ``betas`` two floats.  A tensor (torch's capturable form) is refused by name;
  a value that is no number (a string) is a ``TypeError``, as in torch.
- A param group's values are checked again as each step sends them
  (``check_group_values``): a string written into ``param_groups`` fails the
  step naming the group, the key and the value, as torch's step fails on it.
  So are its switches (``check_group_switches``): ``amsgrad`` set true later,
  or torch's ``decoupled_weight_decay`` edited apart from ``adamw`` (its name
  here), would change what torch computes but not what the daemon does.
- torch's implementation switches are accepted where they cannot change the
  result (``foreach``, ``fused``: the daemon's update is always one fused
  pass) and refused by name where they would (``amsgrad=True``,
  ``capturable=True``, ``differentiable=True``).
- The step mode is one ``StepMode``; ``overlap_update`` with ``max_grad_norm``
  or ``delayed_update`` is refused here (an update applied as its bucket lands
  cannot be clipped afterwards, and the delayed update already overlaps the
  whole update).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiermem.core.errors import InvalidArgument, InvalidType
from tiermem.core.lowbit import STATE_DTYPES
from tiermem.core.modes import StepMode

__all__ = [
    "Hyper",
    "optimizer_defaults",
    "check_group_switches",
    "torch_switch_name",
    "check_group_values",
    "check_hyper",
    "check_state_dtype",
    "check_torch_flags",
    "step_mode",
]

ADAMW_WEIGHT_DECAY = 1e-2


HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "maximize", "decoupled_weight_decay")
"""The keys of a param group that its updates read (what a wrapping optimizer copies into its inner one)."""


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """torch's ``step(closure)`` rule: the loss of ``closure`` run with grad enabled (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def hyper_of(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters (``HYPER_KEYS``): what an inner optimizer's group over the same
    params' shards takes."""
    return {key: group[key] for key in HYPER_KEYS}


def copy_hyper(
    source: Sequence[dict[str, Any]], target: Sequence[dict[str, Any]], pairs: Iterable[tuple[int, int]] | None = None
) -> None:
    """The hyper-parameters (``HYPER_KEYS``) of ``source[i]`` into ``target[j]`` for each ``(i, j)`` of ``pairs``
    (default: group by group); a sharding strategy's groups into its inner optimizer's before each update.
    Each source group is checked first (``check_group_values``), so an error names the strategy's own group."""
    for i, j in pairs if pairs is not None else enumerate(range(len(target))):
        check_group_values(source[i], source)
        for key in HYPER_KEYS:
            target[j][key] = source[i][key]


def optimizer_defaults(
    hyper: Hyper, *, foreach: bool | None, maximize: bool, fused: bool | None, adamw: bool
) -> dict[str, object]:
    """A param group's defaults in ``torch.optim.AdamW``'s keys (``amsgrad``, ``capturable`` and
    ``differentiable`` always False: refused by ``check_torch_flags``), plus ``adamw``."""
    return {
        "lr": hyper.lr,
        "betas": hyper.betas,
        "eps": hyper.eps,
        "weight_decay": hyper.weight_decay,
        "amsgrad": False,
        "foreach": foreach,
        "maximize": maximize,
        "capturable": False,
        "differentiable": False,
        "fused": fused,
        "decoupled_weight_decay": adamw,
    }


@dataclass(frozen=True)
class Hyper:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


def check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float | None, *, adamw: bool) -> Hyper:
    """torch.optim.AdamW's checks, in its order and with its messages (``ValueError``), on the types it takes:
    ``lr``, ``eps`` and ``weight_decay`` any real number (``np.float32(1e-3)``, an int), ``betas`` two floats
    (torch refuses a pair of numpy float32s too).  A tensor is refused (``InvalidArgument``) and a value that is
    no number is ``InvalidType`` (a ``TypeError``, as torch raises for a string); ``weight_decay=None`` takes
    torch's default."""
    if weight_decay is None:
        weight_decay = ADAMW_WEIGHT_DECAY if adamw else 0.0
    lr_value = _hyper_number("lr", lr)
    if not lr_value >= 0.0:
        raise InvalidArgument(f"Invalid learning rate: {lr}")
    eps_value = _hyper_number("eps", eps)
    if not eps_value >= 0.0:
        raise InvalidArgument(f"Invalid epsilon value: {eps}")
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise InvalidArgument(f"betas must be a pair of floats, got {betas!r}")
    beta_values = [_hyper_number(f"betas[{i}]", beta) for i, beta in enumerate(betas)]
    for i, beta in enumerate(beta_values):
        if not 0.0 <= beta < 1.0:
            raise InvalidArgument(f"Invalid beta parameter at index {i}: {betas[i]}")
    weight_decay_value = _hyper_number("weight_decay", weight_decay)
    if not weight_decay_value >= 0.0:
        raise InvalidArgument(f"Invalid weight_decay value: {weight_decay}")
    if not all(isinstance(b, float) for b in betas):
        raise InvalidArgument("betas must be either both floats or both Tensors")
    return Hyper(lr_value, (beta_values[0], beta_values[1]), eps_value, weight_decay_value)


def real_number(value: object) -> float | None:
    """``float(value)`` where ``value`` is one real number (a float, an int, a numpy scalar or 0-d array, a
    ``Fraction``); None for anything else: a string (``float("0.1")`` would parse it), None, a complex, a
    sequence, an array of more dimensions, a tensor."""
    if isinstance(value, str | bytes | bytearray | torch.Tensor) or getattr(value, "ndim", 0) != 0:
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None


def _hyper_number(name: str, value: object) -> float:
    """A constructor's hyper-parameter as a float: a tensor or a value that is no number refused by name."""
    if isinstance(value, torch.Tensor):
        raise InvalidArgument(
            f"{name} as a Tensor is not supported by OffloadAdam (the daemon's update takes numbers; torch's tensor "
            f"form is for capturable steps, which run on the device); pass float({name}), got {value!r}"
        )
    number = real_number(value)
    if number is None:
        raise InvalidType(
            f"{name} must be a real number (a float, an int or a numpy scalar), got {value!r} "
            f"of type {type(value).__name__}"
        )
    return number


GROUP_NUMBERS = ("lr", "eps", "weight_decay")
"""A param group's values a step sends as single numbers (with ``betas``, a pair of them)."""


def check_group_values(group: Mapping[str, Any], groups: Sequence[Mapping[str, Any]] = ()) -> None:
    """A param group's hyper-parameters as a step is about to send them: each of ``lr``, ``eps`` and
    ``weight_decay`` one real number (a numpy scalar or a one-element tensor too: what torch's step computes
    with), ``betas`` a pair of them, each in the range the constructor allows.

    Values written into ``param_groups`` after construction (a scheduler, a user, a loaded state dict) are
    checked here rather than converted with ``float()``: a string fails, as torch's step fails on it, with
    ``InvalidType`` (a ``TypeError``) naming the group (by its index in ``groups``, the optimizer's
    ``param_groups``), the key and the value; a value out of range is ``InvalidArgument`` with torch's
    message.  The group's index is looked up only to word an error: a step checks every group, and a search
    per group made a step of 4,000 groups cost 0.9 s."""

    def where() -> str:
        index = next((i for i, g in enumerate(groups) if g is group), None)
        return f"param_groups[{index}]" if index is not None else "a param group"

    values = {key: _group_number(where, f"['{key}']", group[key]) for key in GROUP_NUMBERS}
    betas = group["betas"]
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise InvalidType(f"{where()}['betas'] must be a pair of numbers, got {betas!r} of type {type(betas).__name__}")
    beta_values = [_group_number(where, f"['betas'][{i}]", beta) for i, beta in enumerate(betas)]
    problems = [
        (values["lr"] >= 0.0, f"Invalid learning rate: {group['lr']}"),
        (values["eps"] >= 0.0, f"Invalid epsilon value: {group['eps']}"),
        (0.0 <= beta_values[0] < 1.0, f"Invalid beta parameter at index 0: {betas[0]}"),
        (0.0 <= beta_values[1] < 1.0, f"Invalid beta parameter at index 1: {betas[1]}"),
        (values["weight_decay"] >= 0.0, f"Invalid weight_decay value: {group['weight_decay']}"),
    ]
    for ok, message in problems:
        if not ok:
            raise InvalidArgument(f"{where()}: {message}")
    check_group_switches(group, where)


def torch_switch_name(param_group: dict[str, Any]) -> None:
    """A group given to ``add_param_group`` with ``adamw`` (the constructors' name of the switch) gets torch's
    ``decoupled_weight_decay`` in its place, before the optimizer's defaults fill it in: the groups carry
    torch's key alone, as ``torch.optim.AdamW``'s do (``torch.distributed.checkpoint`` asks a checkpoint for
    every key of the loading optimizer's groups, so a key AdamW's lack would keep its checkpoints out).  Both
    given and different: left for ``check_group_switches`` to refuse."""
    if "adamw" in param_group:
        decoupled = param_group.setdefault("decoupled_weight_decay", param_group["adamw"])
        if bool(decoupled) == bool(param_group["adamw"]):
            del param_group["adamw"]


def check_group_switches(group: Mapping[str, Any], where: Callable[[], str]) -> None:
    """The switches a group may carry besides its numbers: ``amsgrad`` must stay false (the daemon's Adam keeps
    no max of the second moment, so the update would go on without it), and an ``adamw`` written into a group
    must agree with torch's ``decoupled_weight_decay``, which the update reads (an edit of ``adamw`` alone
    would be ignored).  A group without the keys (a wrapping optimizer's) passes."""
    if group.get("amsgrad"):
        raise InvalidArgument(
            f"{where()}['amsgrad'] is {group['amsgrad']!r}: OffloadAdam's Adam keeps no max of the second moment "
            "and would step as amsgrad=False; set it back to False"
        )
    adamw, decoupled = group.get("adamw"), group.get("decoupled_weight_decay")
    if adamw is not None and decoupled is not None and bool(adamw) != bool(decoupled):
        raise InvalidArgument(
            f"{where()} has adamw={adamw!r} but decoupled_weight_decay={decoupled!r}: the two name one switch "
            "(tiermem's name and torch's); set both to the same value"
        )


def _group_number(where: Callable[[], str], key: str, value: object) -> float:
    number = real_number(value)
    if number is None and isinstance(value, torch.Tensor) and value.numel() == 1:
        number = float(value)
    if number is None:
        raise InvalidType(
            f"{where()}{key} is {value!r} of type {type(value).__name__}, not a number: assign a float "
            f"(torch's step fails on it too)"
        )
    return number


def check_torch_flags(*, amsgrad: bool, capturable: bool, differentiable: bool) -> None:
    """Refuse, by name, the torch switches that would change what the step computes."""
    refused = {
        "amsgrad": (amsgrad, "the daemon's Adam keeps no max of the second moment"),
        "capturable": (capturable, "the update runs on the host, outside any CUDA graph"),
        "differentiable": (differentiable, "the update runs in another process, outside autograd"),
    }
    for name, (value, why) in refused.items():
        if value:
            raise InvalidArgument(f"OffloadAdam does not support {name}=True ({why}); leave {name}=False")


def check_state_dtype(state_dtype: str) -> str:
    """``state_dtype`` if it is one the daemon stores moments in, else an error naming the choices."""
    if state_dtype not in STATE_DTYPES:
        raise InvalidArgument(
            f"state_dtype must be one of {', '.join(repr(d) for d in STATE_DTYPES)}, got {state_dtype!r}: "
            "'fp32' is exact AdamW, 'bf16' and 'int8' store the moments compressed"
        )
    return state_dtype


def step_mode(
    *, overlap_update: bool, delayed_update: bool, max_grad_norm: float | None, warmup_steps: int
) -> StepMode:
    if warmup_steps < 0:
        raise InvalidArgument(f"warmup_steps must be >= 0, got {warmup_steps}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise InvalidArgument(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
    if overlap_update and delayed_update:
        raise InvalidArgument(
            "overlap_update=True and delayed_update=True cannot be combined: the delayed update already overlaps "
            "the whole update with the next step's compute"
        )
    if overlap_update and max_grad_norm is not None:
        raise InvalidArgument(
            "overlap_update=True cannot clip (max_grad_norm): a bucket is updated as soon as it lands, before the "
            "global norm is known; use overlap_update=False to clip"
        )
    if delayed_update:
        return StepMode.DELAYED
    return StepMode.OVERLAP if overlap_update else StepMode.SYNC
