"""One writer per shared thing: two processes on one fresh cache build it once; a crash's leftovers are discarded
with a notice; a second run never writes into a folder a first run holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from align.errors import AlignError
from align.locks import exclusive, hold_folder
from test_zoo import MINI

BUILD = """
import json, sys
from align.zoo.build import ZooSpec, build
print(json.dumps({"built": build(["tiny-mdlm"], spec=ZooSpec(**json.loads(sys.argv[1])))}), flush=True)
"""


@pytest.fixture()
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_two_processes_on_a_fresh_cache_build_the_zoo_once(fresh_cache):
    env = {**os.environ, "ALIGN_CACHE": str(fresh_cache), "OMP_NUM_THREADS": "1"}
    with exclusive(fresh_cache, "tinyworld"):  # both start while the world is "being built": both must wait
        procs = [subprocess.Popen([sys.executable, "-c", BUILD, json.dumps(MINI)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        waiting = [p.stdout.readline() for p in procs]
        assert all("waiting for another process that is building the tiny" in line for line in waiting), waiting
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    built = sorted(json.loads(out.strip().splitlines()[-1])["built"] for out, _ in outputs)
    assert built == [[], ["tiny-mdlm"]]  # one built it, the other found it built
    assert (fresh_cache / "zoo" / "tiny-mdlm" / "zoo.json").is_file()
    assert not list(fresh_cache.rglob("*.partial"))


def test_a_crashed_builders_leftovers_are_discarded_with_a_notice(fresh_cache, capsys):
    from align.zoo.build import ZooSpec, build

    leftover = fresh_cache / "zoo" / "tiny-mdlm.partial"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half a file")
    assert build(["tiny-mdlm"], spec=ZooSpec(**MINI)) == ["tiny-mdlm"]
    assert f"discarding {leftover}: an unfinished build of zoo:tiny-mdlm" in capsys.readouterr().out
    assert not leftover.exists() and (fresh_cache / "zoo" / "tiny-mdlm" / "zoo.json").is_file()


def test_a_second_writer_of_an_output_folder_is_refused_until_the_first_is_done(fresh_cache, tmp_path):
    out = tmp_path / "runs" / "tiny"
    other = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from align.locks import hold_folder\n"
        "lock = hold_folder(Path(sys.argv[1]), 'a training run'); print('held', flush=True); time.sleep(600)"),
        str(tmp_path / "runs" / ".." / "runs" / "tiny")], stdout=subprocess.PIPE, text=True,  # spelled otherwise
        env={**os.environ, "ALIGN_CACHE": str(fresh_cache)})
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(AlignError, match="another process is writing a training run into .*runs/tiny .lock "
                                             ".*choose another output folder"):
            hold_folder(out, "a training run")
        hold_folder(tmp_path / "runs" / "elsewhere", "a training run").release()  # other folders are free
    finally:
        other.kill()
        other.wait(timeout=30)
    mine = hold_folder(out, "a training run")  # free once the other process is gone
    assert hold_folder(out, "a training run") is mine  # a process never locks itself out (runs one after another)
    mine.release()


def test_a_waiting_process_gets_the_lock_when_its_holder_dies(fresh_cache):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from align.locks import exclusive\n"
        "with exclusive(Path(sys.argv[1]), 'zoo'):\n    print('held', flush=True); time.sleep(600)"),
        str(fresh_cache)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()  # kill -9 while holding: the operating system drops the lock with the process
    holder.wait(timeout=30)
    start = time.time()
    with exclusive(fresh_cache, "zoo"):
        assert time.time() - start < 30
