"""scripts/gpu_check.sh v2 on a CPU-only machine: a step killed midway leaves the finished
steps' records and logs (written as each step ends, not at the end) and marks the one killed."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_a_kill_during_a_step_leaves_the_finished_steps_records(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    p = subprocess.Popen(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--out", str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        demo = out / "steps" / "demo.json"
        while time.time() < deadline:  # wait until the demo step is running
            if demo.exists() and json.loads(demo.read_text())["status"] == "started":
                break
            assert p.poll() is None, p.stdout.read().decode()
            time.sleep(0.2)
        else:
            pytest.fail("the demo step never started")
        time.sleep(2)
        os.killpg(p.pid, signal.SIGKILL)  # the slot ends: everything is killed at once
        p.wait(30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    steps = {n[:-5]: json.loads((out / "steps" / n).read_text()) for n in os.listdir(out / "steps")}
    assert steps["env"]["status"] == "passed" and "torch" in steps["env"]
    assert steps["data"]["status"] == "passed"
    assert steps["pytest"]["status"] == "skipped" or steps["pytest"]["status"] == "passed"
    assert steps["demo"]["status"] == "started"  # the step the kill interrupted says so
    assert "parity" not in steps
    summary = json.loads((out / "gpu_check.json").read_text())["steps"]
    assert set(summary) == {"env", "pytest", "data", "demo"}
    assert (out / "logs" / "env.log").exists() and (out / "logs" / "data.log").exists()
    assert (out / "logs" / "demo.log").exists()
