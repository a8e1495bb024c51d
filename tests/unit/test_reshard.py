"""The ZeRO-3 checkpoint format alone (``tiermem.client.distributed.reshard``): rank files made here from known
tensors, cut as either optimizer cuts them, merged and read back at other world sizes; and every way a set of
rank files can be wrong, each named."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tiermem.client.distributed.reshard import (
    FORMAT,
    ParamInfo,
    ShardSet,
    adamw_state_dict,
    file_name,
    model_state_dict,
    open_shards,
    save_file,
)
from tiermem.core.errors import InvalidArgument

KEYS = ("value", "exp_avg", "exp_avg_sq")


def whole(shapes: list[tuple[int, ...]], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(math.prod(s), generator=g) for k in KEYS} for s in shapes]


def paged_cut(numel: int, world: int, rank: int) -> tuple[int, int]:
    """ShardedPagedAdam's stretch of a param for ``rank``: equal shards, the last one short."""
    n = max(1, -(-numel // world))
    lo = min(rank * n, numel)
    return lo, min(lo + n, numel)


def rank_files(
    shapes: list[tuple[int, ...]], world: int, *, layers: bool = False, step: int = 3, seed: int = 0
) -> list[dict]:
    """The rank files of a save at ``world`` ranks: paged stretches, or (``layers``) whole params dealt out."""
    values = whole(shapes, seed)
    params = [ParamInfo((f"p{i}.weight",), s, "float32").to_dict() for i, s in enumerate(shapes)]
    files = []
    for rank in range(world):
        pieces = []
        for i, s in enumerate(shapes):
            numel = math.prod(s)
            lo, hi = (0, numel) if layers else paged_cut(numel, world, rank)
            if (layers and i * world // len(shapes) != rank) or (hi == lo and numel > 0):
                continue
            pieces.append({"param": i, "lo": lo, "hi": hi, "step": step, **{k: values[i][k][lo:hi] for k in KEYS}})
        files.append(
            {
                "format": FORMAT,
                "version": 1,
                "optimizer": "LayerShardedAdam" if layers else "ShardedPagedAdam",
                "job_id": "job",
                "steps": step,
                "rank": rank,
                "world_size": world,
                "params": params,
                "param_groups": [{"lr": 0.1, "params": list(range(len(shapes)))}],
                "pieces": pieces,
                "buffers": {"scale": torch.tensor([2.0])},
            }
        )
    return files


def labelled(files: list[dict]) -> list[tuple[str, dict]]:
    return [(f"f{d['rank']}", d) for d in files]


shapes_st = st.lists(st.tuples(st.integers(0, 9), st.integers(1, 5)), min_size=1, max_size=4)


@given(shapes=shapes_st, saved_at=st.integers(1, 5), loaded_at=st.integers(1, 5), layers=st.booleans())
def test_stretches_saved_at_one_world_size_read_back_exactly_at_another(shapes, saved_at, loaded_at, layers):
    files = rank_files(shapes, saved_at, layers=layers)
    shards = ShardSet(labelled(files))
    shards.require_complete()
    values = whole(shapes)
    for rank in range(loaded_at):
        for i, s in enumerate(shapes):
            lo, hi = paged_cut(math.prod(s), loaded_at, rank)
            for key in KEYS:
                assert torch.equal(shards.read(i, key, lo, hi), values[i][key][lo:hi])
    state = adamw_state_dict(shards)
    model = model_state_dict(shards)
    for i, s in enumerate(shapes):
        assert torch.equal(state["state"][i]["exp_avg_sq"], values[i]["exp_avg_sq"].view(s))
        assert float(state["state"][i]["step"]) == 3.0
        assert torch.equal(model[f"p{i}.weight"], values[i]["value"].view(s))
    assert state["param_groups"] == [{"lr": 0.1, "params": list(range(len(shapes)))}]
    assert torch.equal(model["scale"], torch.tensor([2.0]))


def test_low_precision_params_keep_their_fp32_master_in_adamws_format_and_their_dtype_in_the_model():
    files = rank_files([(3, 2)], 2)
    for d in files:
        d["params"][0]["dtype"] = "bfloat16"
    shards = ShardSet(labelled(files))
    value = whole([(3, 2)])[0]["value"].view(3, 2)
    assert torch.equal(adamw_state_dict(shards)["state"][0]["master"], value)
    assert model_state_dict(shards)["p0.weight"].dtype == torch.bfloat16
    assert torch.equal(model_state_dict(shards, fp32=True)["p0.weight"], value)


def test_a_param_that_never_stepped_has_no_adam_state_as_in_torch():
    files = rank_files([(4,)], 2, step=0)
    for d in files:
        for piece in d["pieces"]:
            del piece["exp_avg"], piece["exp_avg_sq"]
    shards = ShardSet(labelled(files))
    assert adamw_state_dict(shards)["state"] == {}
    assert torch.equal(model_state_dict(shards)["p0.weight"], whole([(4,)])[0]["value"])


def test_a_missing_rank_is_named_by_its_file(tmp_path: Path):
    files = rank_files([(5, 3)], 3)
    for d in (files[0], files[2]):
        save_file(d, tmp_path)
    with pytest.raises(InvalidArgument, match="saved by 3 ranks and 1 rank file") as exc:
        open_shards(tmp_path)
    assert str(tmp_path / file_name(1, 3)) in str(exc.value)
    # given as files, the missing rank matters only for the elements it held
    shards = open_shards([tmp_path / file_name(0, 3), tmp_path / file_name(2, 3)])
    assert torch.equal(shards.read(0, "value", 0, 5), whole([(5, 3)])[0]["value"][:5])
    with pytest.raises(InvalidArgument, match=r"elements \[5, 10\) of param 'p0.weight' are in none of the 2"):
        shards.read(0, "value", 0, 15)


def test_files_of_two_saves_are_refused_naming_the_odd_one(tmp_path: Path):
    files = rank_files([(6,)], 2)
    later = rank_files([(6,)], 2, step=4)
    save_file(files[0], tmp_path)
    save_file(later[1], tmp_path)
    with pytest.raises(InvalidArgument, match="saved at step 4") as exc:
        open_shards(tmp_path)
    assert str(tmp_path / file_name(1, 2)) in str(exc.value)
    other = copy.deepcopy(files[1])
    other["job_id"] = "another"
    with pytest.raises(InvalidArgument, match=r"f1: its job_id differs from f0's \('another' vs 'job'\)"):
        ShardSet(labelled([files[0], other]))
    other = copy.deepcopy(files[1])
    other["params"][0]["shape"] = [7]
    with pytest.raises(InvalidArgument, match="f1: its params differs"):
        ShardSet(labelled([files[0], other]))


def test_a_directory_holding_saves_at_two_world_sizes_is_refused(tmp_path: Path):
    for d in rank_files([(6,)], 2) + rank_files([(6,)], 3):
        save_file(d, tmp_path)
    with pytest.raises(InvalidArgument, match=r"rank files of 2 saves at different world sizes \(2, 3 ranks\)"):
        open_shards(tmp_path)


def test_rank_files_that_overlap_disagree_or_leave_a_gap_are_named():
    files = rank_files([(8,)], 2)
    twice = copy.deepcopy(files)
    twice[1]["rank"] = 0
    with pytest.raises(InvalidArgument, match="f0 and f0 are both rank 0 of 2"):
        ShardSet(labelled(twice))
    overlap = copy.deepcopy(files)
    piece = overlap[1]["pieces"][0]
    piece.update(lo=3, **{k: torch.zeros(5) for k in KEYS})
    with pytest.raises(InvalidArgument, match=r"f0 and f1 both hold elements \[3, 4\) of param 'p0.weight'"):
        ShardSet(labelled(overlap))
    steps = copy.deepcopy(files)
    steps[1]["pieces"][0]["step"] = 2
    steps[1]["steps"] = None
    with pytest.raises(InvalidArgument, match=r"'p0\.weight' is at step 3 in f0 and at step 2 in f1"):
        ShardSet(labelled(steps))
    gap = copy.deepcopy(files)
    gap[1]["pieces"] = []
    shards = ShardSet(labelled(gap))
    with pytest.raises(InvalidArgument, match=r"elements \[4, 8\) of param 'p0.weight' are in none of the 2"):
        shards.require_complete()


def test_a_piece_of_the_wrong_size_or_outside_its_param_is_named():
    files = rank_files([(8,)], 2)
    short = copy.deepcopy(files)
    short[0]["pieces"][0]["exp_avg"] = torch.zeros(3)
    with pytest.raises(InvalidArgument, match=r"f0: exp_avg of param 'p0.weight' \[0, 4\) is not 4 fp32 elements"):
        ShardSet(labelled(short))
    outside = copy.deepcopy(files)
    outside[1]["pieces"][0]["hi"] = 9
    with pytest.raises(InvalidArgument, match=r"f1: piece \[4, 9\) of param 0 at step 3 lies outside"):
        ShardSet(labelled(outside))


def test_files_that_are_not_rank_files_are_named(tmp_path: Path):
    torch.save(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]).state_dict(), tmp_path / "adamw.pt")
    with pytest.raises(InvalidArgument, match=f"{tmp_path / 'adamw.pt'} is not a tiermem ZeRO-3 rank file"):
        open_shards([tmp_path / "adamw.pt"])
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(InvalidArgument, match=f"{tmp_path / 'junk.pt'} cannot be read as a torch.save file"):
        open_shards(tmp_path / "junk.pt")
    with pytest.raises(InvalidArgument, match="holds no ZeRO-3 rank files"):
        open_shards(tmp_path)
    newer = rank_files([(2,)], 1)[0]
    newer["version"] = 3
    with pytest.raises(InvalidArgument, match="version 3 of the format; this tiermem reads 1, 2"):
        ShardSet([("f", newer)])


def test_version_2_lists_the_groups_by_position_as_torch_does_and_its_order_maps_them_to_params():
    """A version-2 file's groups are torch's (positions in the optimizer), ``order`` the param behind each
    position; read, the groups list params, as version 1's did, so a load or a merge sees no difference."""
    files = rank_files([(2,), (3,), (4,)], 1)
    files[0]["param_groups"] = [{"lr": 0.1, "params": [1, 2]}, {"lr": 0.2, "params": [0]}]
    v2 = {**files[0], "version": 2, "order": [1, 2, 0], "param_groups": [
        {"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}]}  # fmt: skip
    assert ShardSet([("v1", files[0])]).param_groups == ShardSet([("v2", v2)]).param_groups
    assert [g["params"] for g in ShardSet([("v2", v2)]).param_groups] == [[1, 2], [0]]
    with pytest.raises(InvalidArgument, match="v2: 'order' is missing or not a list"):
        ShardSet([("v2", {k: v for k, v in v2.items() if k != "order"})])
    with pytest.raises(InvalidArgument, match="v2: its param_groups list positions its 'order' does not have"):
        ShardSet([("v2", {**v2, "order": [1, 2]})])


def test_a_rank_file_is_written_whole_under_its_final_name(tmp_path: Path):
    files = rank_files([(4, 4)], 2)
    paths = [save_file(d, tmp_path / "new" / "dir") for d in files]
    assert [p.name for p in paths] == ["zero3-rank00000-of-00002.pt", "zero3-rank00001-of-00002.pt"]
    assert sorted(p.name for p in (tmp_path / "new" / "dir").iterdir()) == [p.name for p in paths]
    paths[1].replace(paths[0])  # rank 1's file under rank 0's name
    with pytest.raises(InvalidArgument, match="holds rank 1 of 2, not what its name says"):
        open_shards(tmp_path / "new" / "dir")
