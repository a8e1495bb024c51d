"""``OffloadOptions``: the record tiermem's keywords make, checked once, and its merge with keywords."""

from __future__ import annotations

import pytest

from tiermem.client.offload.options import OffloadOptions
from tiermem.core.errors import InvalidArgument
from tiermem.core.modes import Exchange, Placement, StepMode


def test_strings_are_parsed_into_their_enums() -> None:
    opts = OffloadOptions(offload="nvme", exchange="staged", state_dtype="int8")
    assert opts.offload is Placement.NVME
    assert opts.exchange is Exchange.STAGED
    assert opts.state_dtype == "int8"


def test_the_step_settings_are_checked_together() -> None:
    assert OffloadOptions(delayed_update=True).mode is StepMode.DELAYED
    with pytest.raises(InvalidArgument, match="cannot be combined"):
        OffloadOptions(overlap_update=True, delayed_update=True)
    with pytest.raises(InvalidArgument, match="max_grad_norm"):
        OffloadOptions(max_grad_norm=0.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [("window_nbytes", 0), ("bucket_nbytes", -1), ("rank", -1), ("world_size", True), ("offload", "disk")],
)
def test_a_bad_value_names_its_field(field: str, value: object) -> None:
    with pytest.raises(InvalidArgument, match=field):
        OffloadOptions(**{field: value})  # type: ignore[arg-type]


def test_keywords_make_the_record_and_agreeing_ones_may_repeat_it() -> None:
    opts = OffloadOptions(offload="nvme", max_grad_norm=1.0)
    assert OffloadOptions.merge(None, {"offload": "nvme", "max_grad_norm": 1.0}) == opts
    assert OffloadOptions.merge(opts, {"offload": "nvme"}) is opts
    assert OffloadOptions.merge(opts, {}) is opts


def test_a_keyword_that_contradicts_the_record_is_refused() -> None:
    opts = OffloadOptions(offload="nvme")
    with pytest.raises(InvalidArgument, match="offload given both"):
        OffloadOptions.merge(opts, {"offload": "cpu"})
    with pytest.raises(InvalidArgument, match="OffloadOptions"):
        OffloadOptions.merge({"offload": "cpu"}, {})  # type: ignore[arg-type]


def test_replace_checks_again() -> None:
    opts = OffloadOptions()
    assert opts.replace(state_dtype="bf16").state_dtype == "bf16"
    with pytest.raises(InvalidArgument, match="state_dtype"):
        opts.replace(state_dtype="fp8")
