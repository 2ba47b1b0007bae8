"""Pressing Ctrl-C on a real command, as a terminal does, for the tests that check how commands stop."""
from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil


def press_ctrl_c(cmd: list[str], env: dict, wait: float = 1.0, group: bool = False,
                 timeout: float = 30.0) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Run ``cmd``; once its query runs (a child process exists: on a loaded machine the command can
    still be importing its modules after seconds, and Ctrl-C there is Python's, not the command's)
    and ``wait`` seconds have passed since the start, send SIGINT to it (to its process group with
    ``group``, as a terminal does). Returns the finished process and the children it had. SIGINT
    starts at its default, as from a terminal, even when the suite itself runs in the background (a
    shell starts background jobs with SIGINT ignored, and Python then keeps it ignored); a command
    still running ``timeout`` seconds later is killed with its group, never left running."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), start_new_session=True)
    started, children = time.monotonic(), []
    while not children and proc.poll() is None and time.monotonic() - started < 120:
        time.sleep(0.1)
        try:
            children = [c.pid for c in psutil.Process(proc.pid).children()]
        except psutil.NoSuchProcess:
            break
    time.sleep(max(1.0, wait - (time.monotonic() - started)))
    assert proc.poll() is None, proc.communicate()
    if group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"still running {timeout:g} s after Ctrl-C: {err[-500:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), children
