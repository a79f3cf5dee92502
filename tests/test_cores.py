"""The thread that waits for IREE's local-task workers (boo_backend.cores.wait_aside): the
call runs on a SCHED_BATCH thread while the caller blocks, its errors reach the caller, it keeps
no argument alive, a forked child gets its own thread, and where no such thread can be had
the caller makes the call itself. Mechanisms only, never a speed."""

import gc
import os
import signal
import threading
import weakref

import pytest
import torch

import boo_backend
from boo_backend import cores
from util import assert_close

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")


def _gelu_scale(x, w):
    return torch.nn.functional.gelu(x) * w + 1


def test_a_local_task_call_runs_on_a_batch_thread_while_the_caller_waits(monkeypatch):
    seen = []
    original = cores.wait_aside

    def spy(fn, *args):
        def call(*a):
            seen.append((threading.get_native_id(), os.sched_getscheduler(0)))
            return fn(*a)

        return original(call, *args)

    monkeypatch.setattr(cores, "wait_aside", spy)
    boo_backend.reset()
    torch.manual_seed(0)
    x, w = torch.randn(33, 70), torch.randn(70)
    out = torch.compile(_gelu_scale, backend="boo", options={"cpu_driver": "local-task"})(x, w)
    assert_close(out, _gelu_scale(x, w))
    assert seen, "no local-task call went through cores.wait_aside"
    caller = threading.get_native_id()
    assert all(tid != caller and policy == os.SCHED_BATCH for tid, policy in seen), (caller, seen)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER, "the caller's own policy changed"


def test_an_error_in_the_waited_call_reaches_the_caller_and_the_thread_serves_on():
    def fails():
        raise ValueError("inside the call")

    with pytest.raises(ValueError, match="inside the call"):
        cores.wait_aside(fails)
    box = []
    cores.wait_aside(box.append, 7)
    assert box == [7]


def test_the_waiting_thread_holds_no_argument_after_the_call():
    class Arg:
        pass

    arg = Arg()
    ref = weakref.ref(arg)
    cores.wait_aside(lambda a: None, arg)
    del arg
    gc.collect()
    assert ref() is None, "the waiting thread still holds the last call's argument"


def test_a_forked_child_starts_its_own_waiting_thread():
    cores.wait_aside(lambda: None)  # the parent's thread exists
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is not here; a call must not wait for it
        signal.alarm(30)
        box = []
        try:
            cores.wait_aside(box.append, os.getpid())
            ok = box == [os.getpid()] and cores._waiter.pid == os.getpid()
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child's call failed or hung (status {status})"


def test_where_no_batch_thread_can_be_had_the_caller_makes_the_call(monkeypatch):
    def refused(*args):
        raise PermissionError("refused")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    monkeypatch.setattr(cores, "_waiter", None)
    seen = []
    cores.wait_aside(lambda: seen.append(threading.get_native_id()))
    assert seen == [threading.get_native_id()]


def test_a_call_made_from_inside_a_waited_call_runs_there():
    """The waiting thread never queues a call behind itself (it would wait forever)."""

    def timed_out(*args):
        raise TimeoutError("the inner call waited for the waiting thread")

    box = []
    old = signal.signal(signal.SIGALRM, timed_out)
    signal.alarm(20)
    try:
        cores.wait_aside(lambda: cores.wait_aside(box.append, threading.get_native_id()))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert box and box[0] != threading.get_native_id()


def test_calls_from_several_threads_at_once_each_get_their_own_results():
    """Local-task calls of several Python threads queue on the one waiting thread; each gets
    its own results, none waits forever."""
    boo_backend.reset()
    compiled = torch.compile(_gelu_scale, backend="boo", options={"cpu_driver": "local-task"})
    torch.manual_seed(1)
    inputs = [(torch.randn(37, 70), torch.randn(70)) for _ in range(4)]
    compiled(*inputs[0])  # compile once, on this thread
    outs: dict[int, list] = {}

    def work(k):
        x, w = inputs[k]
        outs[k] = [compiled(x, w) for _ in range(15)]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread's call never returned"
    for k, (x, w) in enumerate(inputs):
        assert len(outs[k]) == 15
        for out in outs[k]:
            assert_close(out, _gelu_scale(x, w))
