"""OffloadAdam's pure parts: constructor arguments (torch's rules), the step policy, buckets, modes, dtypes."""

from __future__ import annotations

import fractions
import itertools
import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tiermem.client.offload.args import Hyper, check_group_values, check_hyper, check_torch_flags, step_mode
from tiermem.client.offload.policy import StepPolicy, plan_buckets
from tiermem.core import dtypes
from tiermem.core.errors import DTypeError, InvalidArgument, InvalidState, InvalidType
from tiermem.core.layout import DTYPE_NBYTES
from tiermem.core.modes import Exchange, Placement, StepMode

# ----------------------------------------------------------------- hyper-parameters against torch

NAN, INF = math.nan, math.inf
awkward = st.one_of(
    st.sampled_from([0.0, -0.0, 1e-8, 0.5, 0.9, 0.999, 1.0, 1.0 - 2**-53, 2.0, -1e-12, -1.0, NAN, INF, -INF]),
    st.floats(-2.0, 2.0),
)


def torch_error(optimizer: type[torch.optim.Optimizer], **kwargs: object) -> str | None:
    """torch's ValueError message for these hyper-parameters, or None when torch accepts them."""
    try:
        optimizer([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


@given(awkward, awkward, awkward, awkward, st.one_of(st.none(), awkward), st.booleans())
def test_check_hyper_refuses_what_torch_refuses_with_its_message(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float | None, adamw: bool
) -> None:
    kwargs: dict[str, object] = {"lr": lr, "betas": (beta1, beta2), "eps": eps}
    if weight_decay is not None:
        kwargs["weight_decay"] = weight_decay
    expected = torch_error(torch.optim.AdamW if adamw else torch.optim.Adam, **kwargs)
    if expected is None:
        hyper = check_hyper(lr, (beta1, beta2), eps, weight_decay, adamw=adamw)
        assert (hyper.lr, hyper.betas, hyper.eps) == (lr, (beta1, beta2), eps)
    else:
        with pytest.raises(ValueError) as info:
            check_hyper(lr, (beta1, beta2), eps, weight_decay, adamw=adamw)
        assert str(info.value) == expected
        assert isinstance(info.value, InvalidArgument)


@pytest.mark.parametrize(
    ("adamw", "optimizer"), [(True, torch.optim.AdamW), (False, torch.optim.Adam)], ids=["adamw", "adam"]
)
def test_check_hyper_takes_torchs_default_weight_decay(adamw: bool, optimizer: type[torch.optim.Optimizer]) -> None:
    hyper = check_hyper(1e-3, (0.9, 0.999), 1e-8, None, adamw=adamw)
    torch_default = optimizer([torch.nn.Parameter(torch.zeros(1))]).defaults["weight_decay"]
    assert hyper.weight_decay == torch_default == (0.01 if adamw else 0.0)


def test_check_hyper_refuses_a_nan_learning_rate_like_torch() -> None:
    with pytest.raises(ValueError, match=r"^Invalid learning rate: nan$"):
        check_hyper(NAN, (0.9, 0.999), 1e-8, None, adamw=True)
    assert torch_error(torch.optim.AdamW, lr=NAN) == "Invalid learning rate: nan"


def test_check_hyper_returns_plain_floats_for_int_arguments_torch_accepts() -> None:
    assert torch_error(torch.optim.AdamW, lr=1, betas=[0.0, 0.5], eps=0, weight_decay=0) is None
    hyper = check_hyper(1, [0.0, 0.5], 0, 0, adamw=True)  # type: ignore[arg-type]
    assert hyper == Hyper(1.0, (0.0, 0.5), 0.0, 0.0)
    assert all(type(v) is float for v in (hyper.lr, *hyper.betas, hyper.eps, hyper.weight_decay))


NUMBERS = {
    "numpy float32": np.float32(1e-3),
    "numpy float64": np.float64(1e-3),
    "numpy int64": np.int64(1),
    "numpy 0-d array": np.array(1e-3),
    "int": 1,
    "bool": True,
    "Fraction": fractions.Fraction(1, 1000),
}


@pytest.mark.parametrize("key", ["lr", "eps", "weight_decay"])
@pytest.mark.parametrize("value", NUMBERS.values(), ids=NUMBERS.keys())
def test_check_hyper_takes_every_number_torch_takes(key: str, value: object) -> None:
    """``lr=np.float32(1e-3)`` and the like: torch's AdamW takes any real number for these, so OffloadAdam does."""
    kwargs: dict[str, object] = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0, key: value}
    assert torch_error(torch.optim.AdamW, **kwargs) is None
    hyper = check_hyper(kwargs["lr"], (0.9, 0.999), kwargs["eps"], kwargs["weight_decay"], adamw=True)  # type: ignore[arg-type]
    assert getattr(hyper, key) == float(value)  # type: ignore[arg-type]
    assert type(getattr(hyper, key)) is float


NOT_NUMBERS = {"str": "1e-3", "None": None, "complex": 1e-3 + 0j}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        pytest.param(key, value, id=f"{key}-{name}")
        for key in ("lr", "eps", "weight_decay", "beta")
        for name, value in NOT_NUMBERS.items()
        if not (key == "weight_decay" and value is None)  # None: torch's default weight decay
    ],
)
def test_check_hyper_refuses_what_is_no_number_with_a_type_error_as_torch_does(key: str, value: object) -> None:
    kwargs: dict[str, object] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    if key == "beta":
        kwargs["betas"] = (value, 0.999)
    else:
        kwargs[key] = value
    with pytest.raises(TypeError):
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidType, match=r"must be a real number .* got") as info:
        check_hyper(kwargs["lr"], kwargs["betas"], kwargs["eps"], kwargs["weight_decay"], adamw=True)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError) and isinstance(info.value, InvalidArgument)
    assert repr(value) in str(info.value)


def test_check_hyper_takes_betas_of_the_types_torch_takes() -> None:
    """torch wants two floats (a float64 numpy scalar is one; a float32 one is not)."""
    assert check_hyper(1e-3, (np.float64(0.9), 0.999), 1e-8, None, adamw=True).betas == (0.9, 0.999)
    message = torch_error(torch.optim.AdamW, betas=(np.float32(0.9), 0.999))
    assert message == "betas must be either both floats or both Tensors"
    with pytest.raises(InvalidArgument, match=f"^{message}$"):
        check_hyper(1e-3, (np.float32(0.9), 0.999), 1e-8, None, adamw=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["lr", "eps", "weight_decay", "betas"])
def test_check_hyper_refuses_a_tensor_by_name(key: str) -> None:
    kwargs: dict[str, object] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    kwargs[key] = (torch.tensor(0.9), torch.tensor(0.999)) if key == "betas" else torch.tensor(1e-3)
    name = "betas[0]" if key == "betas" else key
    with pytest.raises(InvalidArgument, match=rf"^{re.escape(name)} as a Tensor is not supported by OffloadAdam"):
        check_hyper(kwargs["lr"], kwargs["betas"], kwargs["eps"], kwargs["weight_decay"], adamw=True)  # type: ignore[arg-type]


def adamw_group(**values: object) -> dict[str, object]:
    return {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, **values}


@pytest.mark.parametrize(
    ("key", "value", "label"),
    [
        ("lr", "0.1", "param_groups[1]['lr']"),
        ("eps", None, "param_groups[1]['eps']"),
        ("weight_decay", b"0", "param_groups[1]['weight_decay']"),
        ("betas", ("0.9", 0.999), "param_groups[1]['betas'][0]"),
        ("betas", 0.9, "param_groups[1]['betas']"),
    ],
)
def test_a_value_written_into_a_group_that_is_no_number_fails_naming_group_key_and_value(
    key: str, value: object, label: str
) -> None:
    """torch's step fails with a TypeError on a string lr; the step refuses it before it is sent, saying where."""
    groups = [adamw_group(), adamw_group(**{key: value})]
    with pytest.raises(InvalidType) as info:
        check_group_values(groups[1], groups)
    assert isinstance(info.value, TypeError)
    assert str(info.value).startswith(label)
    shown = value[0] if key == "betas" and isinstance(value, tuple) else value
    assert repr(shown) in str(info.value)


def test_a_group_of_numbers_torch_steps_with_passes() -> None:
    """numpy scalars and one-element tensors (a scheduler's writes) are numbers the step can send."""
    group = adamw_group(lr=np.float32(0.1), betas=(np.float32(0.9), 0.999), eps=torch.tensor(1e-8), weight_decay=0)
    check_group_values(group, [group])


def test_a_value_written_into_a_group_out_of_range_fails_with_torchs_message_and_the_group() -> None:
    group = adamw_group(lr=-0.1)
    with pytest.raises(InvalidArgument, match=r"^param_groups\[0\]: Invalid learning rate: -0.1$"):
        check_group_values(group, [group])
    with pytest.raises(InvalidArgument, match=r"^a param group: Invalid beta parameter at index 1: 1.0$"):
        check_group_values(adamw_group(betas=(0.9, 1.0)))


def test_amsgrad_written_into_a_group_fails_the_step_naming_the_group() -> None:
    """The constructor refuses ``amsgrad=True``; written into a group later, the step went on as plain AdamW."""
    groups = [adamw_group(amsgrad=False), adamw_group(amsgrad=True)]
    check_group_values(groups[0], groups)
    with pytest.raises(InvalidArgument, match=r"^param_groups\[1\]\['amsgrad'\] is True: .*set it back to False"):
        check_group_values(groups[1], groups)


def test_adamw_and_torchs_decoupled_weight_decay_must_agree_in_a_group() -> None:
    """torch's ``decoupled_weight_decay`` and tiermem's ``adamw`` name one switch; a step read ``adamw`` only, so
    an edit of torch's key was ignored."""
    check_group_values(adamw_group(adamw=False, decoupled_weight_decay=False))
    check_group_values(adamw_group(adamw=True))
    group = adamw_group(adamw=True, decoupled_weight_decay=False)
    with pytest.raises(InvalidArgument, match=r"^param_groups\[0\] has adamw=True but decoupled_weight_decay=False"):
        check_group_values(group, [group])


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 0.99, 0.999), 0.9], ids=["one", "three", "scalar"])
def test_check_hyper_refuses_betas_that_are_not_a_pair(betas: object) -> None:
    with pytest.raises(InvalidArgument, match="betas must be a pair"):
        check_hyper(1e-3, betas, 1e-8, None, adamw=True)  # type: ignore[arg-type]


FLAGS = ("amsgrad", "capturable", "differentiable")


@pytest.mark.parametrize("flag", FLAGS)
def test_check_torch_flags_refuses_a_flag_by_name(flag: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_torch_flags(**{name: name == flag for name in FLAGS})
    assert f"{flag}=True" in str(info.value)
    assert f"leave {flag}=False" in str(info.value)
    assert not any(f"{other}=" in str(info.value) for other in FLAGS if other != flag)


def test_check_torch_flags_accepts_torchs_defaults() -> None:
    check_torch_flags(amsgrad=False, capturable=False, differentiable=False)


# ----------------------------------------------------------------- step modes


@pytest.mark.parametrize(
    ("overlap", "delayed", "max_grad_norm", "mode"),
    [
        (False, False, None, StepMode.SYNC),
        (False, False, 1.0, StepMode.SYNC),
        (True, False, None, StepMode.OVERLAP),
        (False, True, None, StepMode.DELAYED),
        (False, True, 1.0, StepMode.DELAYED),
    ],
)
def test_step_mode_maps_the_flags(overlap: bool, delayed: bool, max_grad_norm: float | None, mode: StepMode) -> None:
    got = step_mode(overlap_update=overlap, delayed_update=delayed, max_grad_norm=max_grad_norm, warmup_steps=0)
    assert got is mode


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_step_mode_refuses_overlap_with_delayed_naming_both(max_grad_norm: float | None) -> None:
    with pytest.raises(InvalidArgument) as info:
        step_mode(overlap_update=True, delayed_update=True, max_grad_norm=max_grad_norm, warmup_steps=0)
    assert "overlap_update=True" in str(info.value)
    assert "delayed_update=True" in str(info.value)


def test_step_mode_refuses_overlap_with_clipping_naming_both() -> None:
    with pytest.raises(InvalidArgument) as info:
        step_mode(overlap_update=True, delayed_update=False, max_grad_norm=1.0, warmup_steps=0)
    assert "overlap_update=True" in str(info.value)
    assert "max_grad_norm" in str(info.value)


@pytest.mark.parametrize("max_grad_norm", [0.0, -1.0, NAN])
def test_step_mode_refuses_a_max_grad_norm_that_is_not_positive(max_grad_norm: float) -> None:
    with pytest.raises(InvalidArgument, match="max_grad_norm must be > 0"):
        step_mode(overlap_update=False, delayed_update=False, max_grad_norm=max_grad_norm, warmup_steps=0)


def test_step_mode_refuses_negative_warmup() -> None:
    with pytest.raises(InvalidArgument, match=r"warmup_steps must be >= 0, got -1"):
        step_mode(overlap_update=False, delayed_update=True, max_grad_norm=None, warmup_steps=-1)


# ----------------------------------------------------------------- step policy


@given(st.sampled_from(StepMode), st.integers(0, 5), st.integers(1, 10))
def test_only_the_delayed_mode_delays_and_only_after_warmup(mode: StepMode, warmup: int, step: int) -> None:
    assert StepPolicy(mode, warmup).delayed(step) == (mode is StepMode.DELAYED and step > warmup)


def test_overlap_waits_for_a_verified_step() -> None:
    policy = StepPolicy(StepMode.OVERLAP)
    assert not policy.overlap_now
    policy.check_step(scaled=False, accumulated=False, changed=False, applied_early=0)
    assert policy.overlap_now


@pytest.mark.parametrize("mode", [StepMode.SYNC, StepMode.DELAYED])
def test_other_modes_never_overlap(mode: StepMode) -> None:
    policy = StepPolicy(mode)
    policy.check_step(scaled=False, accumulated=False, changed=False, applied_early=0)
    assert not policy.overlap_now


@pytest.mark.parametrize("mode", [StepMode.SYNC, StepMode.DELAYED])
@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
def test_check_step_does_nothing_outside_the_overlap_mode(mode: StepMode, flags: tuple[bool, bool, bool]) -> None:
    policy = StepPolicy(mode)
    scaled, accumulated, changed = flags
    policy.check_step(scaled=scaled, accumulated=accumulated, changed=changed, applied_early=0)
    assert (policy.verified, policy.notes) == (False, [])


@pytest.mark.parametrize(
    ("flag", "named"),
    [("scaled", "GradScaler"), ("accumulated", "accumulated"), ("changed", "changed after backward")],
)
@pytest.mark.parametrize("applied_early", [0, 3])
def test_check_step_refuses_a_loop_the_overlap_cannot_run(flag: str, named: str, applied_early: int) -> None:
    policy = StepPolicy(StepMode.OVERLAP)
    flags = {name: name == flag for name in ("scaled", "accumulated", "changed")}
    with pytest.raises(InvalidState) as info:
        policy.check_step(**flags, applied_early=applied_early)
    message = str(info.value)
    assert named in message
    if applied_early:
        assert "3 tensor(s) were already updated" in message
        assert "nothing of this step was applied" not in message
    else:
        assert "nothing of this step was applied" in message
    assert not policy.overlap_now


def test_check_step_names_every_problem_at_once() -> None:
    with pytest.raises(InvalidState) as info:
        StepPolicy(StepMode.OVERLAP).check_step(scaled=True, accumulated=True, changed=True, applied_early=0)
    assert all(word in str(info.value) for word in ("GradScaler", "accumulated", "changed after backward"))


def test_a_refused_step_withdraws_an_earlier_verification() -> None:
    policy = StepPolicy(StepMode.OVERLAP)
    policy.check_step(scaled=False, accumulated=False, changed=False, applied_early=0)
    with pytest.raises(InvalidState):
        policy.check_step(scaled=False, accumulated=True, changed=False, applied_early=5)
    assert not policy.overlap_now


@pytest.mark.parametrize(("mode", "buffers"), [(StepMode.SYNC, 1), (StepMode.OVERLAP, 1), (StepMode.DELAYED, 2)])
def test_only_the_delayed_mode_needs_two_grad_buffers(mode: StepMode, buffers: int) -> None:
    assert StepPolicy(mode).grad_buffers == buffers


# ----------------------------------------------------------------- buckets


@given(st.lists(st.integers(0, 100), max_size=30), st.integers(1, 300))
def test_plan_buckets_invariants(nbytes: list[int], bucket_nbytes: int) -> None:
    buckets = plan_buckets(nbytes, bucket_nbytes)
    # every tensor in exactly one bucket, and bucket_of says which
    assert sorted(i for members in buckets.members for i in members) == list(range(len(nbytes)))
    assert buckets.bucket_of == tuple(
        next(b for b, members in enumerate(buckets.members) if i in members) for i in range(len(nbytes))
    )
    for members in buckets.members:
        assert members == tuple(range(members[0], members[-1] + 1))  # a contiguous index range
    # bucket 0 holds the last tensors; later buckets hold earlier ones
    if nbytes:
        assert buckets.members[0][-1] == len(nbytes) - 1
    for earlier, later in itertools.pairwise(buckets.members):
        assert later[-1] + 1 == earlier[0]
    # each bucket but the last to fill reaches bucket_nbytes, and closes as soon as it does
    for members in buckets.members[:-1]:
        total = sum(nbytes[i] for i in members)
        assert total >= bucket_nbytes
        assert total - nbytes[members[0]] < bucket_nbytes
    if buckets.members:
        last = buckets.members[-1]
        assert sum(nbytes[i] for i in last) - nbytes[last[0]] < bucket_nbytes


def test_plan_buckets_fills_from_the_last_tensor() -> None:
    buckets = plan_buckets([10, 10, 10, 10, 10], 20)
    assert buckets.members == ((3, 4), (1, 2), (0,))
    assert buckets.bucket_of == (2, 1, 1, 0, 0)


def test_plan_buckets_gives_a_large_tensor_its_own_bucket() -> None:
    assert plan_buckets([1, 500, 1], 100).members == ((1, 2), (0,))


def test_plan_buckets_of_no_tensors_is_empty() -> None:
    assert plan_buckets([], 10).members == ()


@pytest.mark.parametrize("bucket_nbytes", [0, -1])
def test_plan_buckets_refuses_a_bucket_size_that_is_not_positive(bucket_nbytes: int) -> None:
    with pytest.raises(InvalidArgument, match=rf"bucket_nbytes must be > 0, got {bucket_nbytes}"):
        plan_buckets([1, 2], bucket_nbytes)


# ----------------------------------------------------------------- modes


ENUMS = (Placement, StepMode, Exchange)


@pytest.mark.parametrize("member", [m for e in ENUMS for m in e], ids=str)
def test_parse_reads_the_wire_spelling_and_passes_members_through(member: Placement | StepMode | Exchange) -> None:
    enum = type(member)
    assert enum.parse(member.value, "setting") is member
    assert enum.parse(member, "setting") is member


@pytest.mark.parametrize("enum", ENUMS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("value", ["CPU", "gpu", "", None, 1, True])
def test_parse_refuses_an_unknown_value_naming_the_choices(enum: type[Placement], value: object) -> None:
    if any(m.value == value for m in enum):
        pytest.skip("a real spelling")
    with pytest.raises(InvalidArgument) as info:
        enum.parse(value, "the thing")
    message = str(info.value)
    assert message.startswith("the thing must be one of ")
    assert all(repr(m.value) in message for m in enum)
    assert message.endswith(f"got {value!r}")


def test_parse_does_not_cross_enums() -> None:
    with pytest.raises(InvalidArgument):
        Placement.parse(StepMode.SYNC, "offload")


def test_placement_choices_are_cpu_nvme_auto() -> None:
    with pytest.raises(InvalidArgument, match=r"^offload must be one of 'cpu', 'nvme', 'auto', got 'gpu'$"):
        Placement.parse("gpu", "offload")


# ----------------------------------------------------------------- dtypes


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_by_name_and_by_torch_agree_with_torch(name: str) -> None:
    working = dtypes.by_name(name)
    assert working.torch is getattr(torch, name)
    assert working.itemsize == torch.empty(0, dtype=working.torch).element_size()
    assert dtypes.by_torch(working.torch) is working
    assert working.is_low_precision == (name != "float32")


def test_names_lists_the_working_dtypes() -> None:
    assert dtypes.names() == ("float32", "float16", "bfloat16")


def test_the_layout_sizes_dtypes_as_the_dtype_table_does() -> None:
    assert {d.name: d.itemsize for d in dtypes.DTYPES} == DTYPE_NBYTES


@pytest.mark.parametrize("name", ["float64", "fp16", "Float32", ""])
def test_by_name_refuses_an_unknown_name_naming_the_choices(name: str) -> None:
    with pytest.raises(DTypeError) as info:
        dtypes.by_name(name)
    assert repr(name) in str(info.value)
    assert all(choice in str(info.value) for choice in dtypes.names())


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.complex64], ids=str)
def test_by_torch_refuses_an_unknown_dtype_naming_the_choices(dtype: torch.dtype) -> None:
    with pytest.raises(DTypeError) as info:
        dtypes.by_torch(dtype)
    assert str(dtype) in str(info.value)
    assert all(choice in str(info.value) for choice in dtypes.names())


def test_a_dtype_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        dtypes.by_name("int4")
