"""Job files: written and read back; a file of another version is set aside, saying why."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tiermem.core.modes import Exchange, Placement
from tiermem.core.protocol import ParamGroup, TensorSpec
from tiermemd.persist import JobRecord, RankRecord, load_job_files, write_job_file


def record() -> JobRecord:
    rank = RankRecord(
        rank=0,
        placement=Placement.NVME,
        specs=(TensorSpec(name="w", shape=(4, 4), dtype="bfloat16", placement=Placement.NVME, group=0),),
        groups=(ParamGroup(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True, maximize=False),),
        grad_buffers=1,
        steps=(3,),
        last_step=3,
        exchange=Exchange.STAGED,
        generation=2,
    )
    return JobRecord(job_id="j", owner_uid=0, token="t", world_size=1, ranks=(rank,), clean=True)


def test_a_job_file_round_trips(tmp_path: Path) -> None:
    write_job_file(tmp_path, record())
    (loaded,) = load_job_files(tmp_path)
    assert loaded.ranks[0].steps == (3,) and loaded.ranks[0].exchange is Exchange.STAGED
    assert loaded.ranks[0].placement is Placement.NVME and loaded.ranks[0] == record().ranks[0]


def test_a_job_file_spells_placement_and_exchange_as_the_wire_does(tmp_path: Path) -> None:
    (rank,) = json.loads(write_job_file(tmp_path, record()).read_text())["ranks"]
    assert (rank["placement"], rank["exchange"], rank["specs"][0]["placement"]) == ("nvme", "staged", "nvme")


def test_a_job_file_without_an_exchange_reads_as_shared(tmp_path: Path) -> None:
    path = write_job_file(tmp_path, record())
    data = json.loads(path.read_text())
    del data["ranks"][0]["exchange"]  # written before the staged exchange existed
    path.write_text(json.dumps(data))
    (loaded,) = load_job_files(tmp_path)
    assert loaded.ranks[0].exchange is Exchange.SHARED


def test_a_job_file_of_an_earlier_layout_is_set_aside_saying_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_job_file(tmp_path, record())
    data = json.loads(path.read_text())
    data["version"] = 3  # a store of whole chunks (master, moments and grads in one record)
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.ERROR):
        assert load_job_files(tmp_path) == []
    assert path.with_name(path.name + ".bad").exists() and not path.exists()
    assert "job file version 3, this daemon reads 4" in caplog.text
    assert "start it again from a checkpoint" in caplog.text
