"""Job logs are plain lines: with stdout a pipe (as under `ray job submit`) the display writes
no terminal control codes, even with FORCE_COLOR / TTY_COMPATIBLE set; on a terminal it draws
the bar."""
from __future__ import annotations

import os
import pty
import re
import subprocess
import sys

from tests.conftest import REPO

SCRIPT = """
from orchestrator.reporting.progress import ProgressDisplay
d = ProgressDisplay(total_epochs=2)
print("live" if d.live else "plain", flush=True)
for step in range(5):
    d.steps(1, step, 0.5, 5)
d.line("epoch 1: test_accuracy 0.9000  test_loss 0.3000  train_loss 0.4000  (1.0s)")
d.close()
"""


def run_display(env_extra: dict, stdout) -> None:
    env = dict(os.environ, PYTHONPATH=REPO, **env_extra)
    subprocess.run([sys.executable, "-c", SCRIPT], stdout=stdout, stderr=subprocess.STDOUT, env=env, timeout=60,
                   check=True)


def test_no_control_codes_when_stdout_is_a_pipe(tmp_path):
    # even where the environment asks for colour (plain output is also checked end to end:
    # tests/e2e/test_cli_e2e.py's job)
    for env in ({"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "TERM": "xterm-256color"},):
        read, write = os.pipe()
        with os.fdopen(write, "wb") as w:
            run_display(env, w)
        with os.fdopen(read, "rb") as r:
            out = r.read().decode()
        assert "\x1b[" not in out, (env, out)
        assert out.splitlines() == ["plain", "epoch 1: test_accuracy 0.9000  test_loss 0.3000  train_loss 0.4000  "
                                    "(1.0s)"], out


def test_a_terminal_gets_the_live_bar():
    controller, terminal = pty.openpty()
    try:
        run_display({"TERM": "xterm-256color"}, terminal)
        os.close(terminal)
        terminal = None
        out = b""
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the pty is closed once the child's output is read
                break
            if not chunk:
                break
            out += chunk
    finally:
        if terminal is not None:
            os.close(terminal)
        os.close(controller)
    text = out.decode(errors="replace")
    plain = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", text)  # rich styles parts of the lines on a terminal
    assert "\x1b[" in text and "live" in plain and "epoch 1: test_accuracy" in plain and "epoch 1/2" in plain
