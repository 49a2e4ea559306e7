"""A kill during an atomic write leaves the previous file whole: a child process rewrites a file through
``write_atomic`` and is SIGKILLed halfway through; the file still parses as before, the temporary is left beside it
(ignored by every reader), and a completed write replaces the file in one rename."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from omni_async.trainer.atomic_files import torch_save_atomic, write_text_atomic

CHILD = """
import sys, time
from omni_async.trainer.atomic_files import write_atomic
def slow(f):
    f.write(b'{"step": 2, "dr')
    f.flush()
    open(sys.argv[2], "w").close()
    time.sleep(3600)
write_atomic(sys.argv[1], slow)
"""


def test_a_kill_mid_write_keeps_the_previous_file(tmp_path):
    target, ready = tmp_path / "trainer.json", tmp_path / "ready"
    write_text_atomic(target, json.dumps({"step": 1}))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(target), str(ready)])
    deadline = time.time() + 60
    while not ready.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert ready.exists()
    os.kill(child.pid, signal.SIGKILL)
    child.wait(10)
    assert json.loads(target.read_text()) == {"step": 1}
    (partial,) = tmp_path.glob(".trainer.json.*.tmp")
    assert partial.read_bytes() == b'{"step": 2, "dr'
    write_text_atomic(target, json.dumps({"step": 2}))
    assert json.loads(target.read_text()) == {"step": 2}


def test_torch_save_atomic_round_trips(tmp_path):
    import torch

    torch_save_atomic({"w": torch.arange(3)}, tmp_path / "actor.pt")
    assert torch.equal(torch.load(tmp_path / "actor.pt")["w"], torch.arange(3))
    assert [p.name for p in tmp_path.iterdir()] == ["actor.pt"]  # no temporary left after a completed write
