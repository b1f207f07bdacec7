"""The default target's fp32 cache (converted from its GGUF on first use) is built by one process however many
start at once on a fresh box: a draft and an orchestrator started together used to convert it both, one deleting
the directory the other was loading from."""

import multiprocessing
import os
import pathlib
import time

from specsplit.models import built_once


def slow_build(staging: pathlib.Path) -> None:
    with open(staging.parent / "builds", "a") as builds:
        builds.write(f"{os.getpid()}\n")
    (staging / "weights").write_text(str(os.getpid()))
    time.sleep(0.3)  # a conversion takes seconds: the others arrive meanwhile
    (staging / "complete").write_text("")


def use(target: str, seen: str) -> None:
    path = built_once(pathlib.Path(target), slow_build)
    pathlib.Path(seen).write_text((path / "weights").read_text())  # the directory it got is whole


def test_processes_starting_together_build_the_cache_once(tmp_path):
    target = tmp_path / "cache" / "model"
    fork = multiprocessing.get_context("fork")
    workers = [fork.Process(target=use, args=(str(target), str(tmp_path / f"seen-{i}"))) for i in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert [w.exitcode for w in workers] == [0, 0, 0]
    builds = (tmp_path / "cache" / "builds").read_text().split()
    assert len(builds) == 1  # one conversion; the others waited for it
    assert {(tmp_path / f"seen-{i}").read_text() for i in range(3)} == set(builds)
    assert built_once(target, slow_build) == target and len((tmp_path / "cache" / "builds").read_text().split()) == 1


def test_an_incomplete_directory_left_by_a_dead_build_is_built_again(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "weights").write_text("half written")  # no "complete" marker
    assert built_once(target, slow_build) == target
    assert (target / "complete").exists() and (target / "weights").read_text() == str(os.getpid())
