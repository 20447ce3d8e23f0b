"""``pagedllm serve``'s supervision (``pagedllm/supervisor.py``) on real child processes: a
dead child starts again after its backoff, the backoff doubles while it keeps dying young,
and a crash loop names the child, its exit status and its last log lines."""

from __future__ import annotations

import sys
import time

import pytest

from pagedllm.supervisor import Child, CrashLoopError, RestartPolicy, ServiceProcesses
from shared.config import Settings


def supervised(script: str, policy: RestartPolicy) -> ServiceProcesses:
    procs = ServiceProcesses(Settings(nats_url="nats://127.0.0.1:1"), names=(), policy=policy)
    child = Child("worker", [sys.executable, "-c", script], env={})
    procs.children["worker"] = child
    procs._spawn(child)
    return procs


def wait_dead(procs: ServiceProcesses) -> None:
    procs.children["worker"].proc.wait(10)
    time.sleep(0.1)  # the log pump reads the last lines


def test_a_dead_child_restarts_after_a_backoff_that_doubles_while_it_dies_young():
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=3.0, stable_s=100, max_restarts=10, window_s=100)
    procs = supervised("import sys; sys.exit(3)", policy)
    child = procs.children["worker"]
    first_pid = child.proc.pid
    wait_dead(procs)
    t0 = time.monotonic()
    assert procs.supervise(t0) == []  # death noted, restart due in 1 s
    assert child.restart_at == pytest.approx(t0 + 1.0)
    assert procs.supervise(t0 + 0.5) == []
    assert procs.supervise(t0 + 1.0) == ["worker"]
    assert child.proc.pid != first_pid and child.restarts == 1
    backoffs = [1.0]
    for _ in range(3):
        wait_dead(procs)
        now = time.monotonic()
        procs.supervise(now)
        backoffs.append(child.backoff_s)
        assert procs.supervise(now + child.backoff_s) == ["worker"]
    assert backoffs == [1.0, 2.0, 3.0, 3.0]  # doubled, up to max_backoff_s


def test_a_child_that_ran_long_enough_restarts_after_the_first_backoff_again():
    policy = RestartPolicy(backoff_s=0.5, max_backoff_s=8.0, stable_s=0.0, max_restarts=10, window_s=100)
    procs = supervised("pass", policy)
    child = procs.children["worker"]
    for restarts in range(1, 4):
        dead_pid = child.proc.pid
        wait_dead(procs)
        now = time.monotonic()
        assert procs.supervise(now) == []  # death noted, restart due in 0.5 s
        assert child.backoff_s == 0.5
        assert procs.supervise(now + 0.5) == ["worker"]
        assert child.proc.pid != dead_pid and child.restarts == restarts  # a new process each time


def test_a_crash_loop_names_the_service_its_status_and_its_last_log_lines():
    policy = RestartPolicy(backoff_s=0.0, max_restarts=2, window_s=60)
    script = "import sys; print('line one', file=sys.stderr); print('port 8000 in use', file=sys.stderr); sys.exit(1)"
    procs = supervised(script, policy)
    for _ in range(2):
        wait_dead(procs)
        assert procs.supervise() == ["worker"]
    wait_dead(procs)
    with pytest.raises(CrashLoopError) as info:
        procs.supervise()
    message = str(info.value)
    assert message.startswith("service worker died 3 times within 60 s (last exit status 1); giving up.")
    assert message.endswith("Its last log lines:\n  line one\n  port 8000 in use")


def test_a_child_killed_by_a_signal_is_described_so():
    procs = supervised("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", RestartPolicy(max_restarts=0))
    wait_dead(procs)
    with pytest.raises(CrashLoopError, match=r"last exit status killed by SIGKILL\); giving up. Its last log "
                                             r"lines:\n  \(nothing\)$"):
        procs.supervise()
