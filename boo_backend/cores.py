"""How boo's local-task calls share the CPU's cores with the threads around them: torch's
OpenMP threads, and the thread that waits for IREE's workers.

This module is a leaf: it imports nothing else from boo_backend.

- torch's OpenMP threads spin for a while after each parallel region (OMP_WAIT_POLICY unset)
  and take a core from IREE's workers: `release_torch_threads` ends that spin before a call,
  `hint_wait_policy` says once how to avoid it, and `after_torch_work` leaves the threads as
  an ATen kernel does, for the calls that time IREE's drivers (runtime._ROUNDS).
- The thread that calls IREE spins while it waits for the workers: `wait_aside` makes the
  call from a thread whose wake-up does not take a core from them.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import queue
import threading

import torch

log = logging.getLogger("boo_backend")


@functools.cache
def _parallel_work() -> torch.Tensor:
    """Kept for the process: made outside inference mode, whatever the first call's mode (an
    inference tensor cannot be written outside it)."""
    with torch.inference_mode(False):
        return torch.empty(1 << 17)  # past ATen's grain size (32768): its fill runs on all threads


def after_torch_work() -> None:
    """Leave torch's OpenMP threads as an ATen kernel leaves them (see runtime._ROUNDS)."""
    if torch.get_num_threads() > 1:
        _parallel_work().fill_(1.0)


def release_torch_threads() -> None:
    """Before a local-task call: end the spin of torch's idle OpenMP threads, which would take
    a core from IREE's workers for milliseconds (see runtime._ROUNDS), by releasing the calling
    thread's OpenMP pool (OpenMP 5's omp_pause_resource_all, soft). torch's next parallel
    region starts its threads again (about 30 us for one thread here). Not inside a parallel
    region (the call then does nothing), nor where the runtime lacks the call."""
    pause = _openmp_pause()
    if pause is not None and torch.get_num_threads() > 1:
        pause(_OMP_PAUSE_SOFT)


_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft


@functools.cache
def _openmp_pause():
    """omp_pause_resource_all of GNU's OpenMP runtime (libgomp, which torch's Linux wheels
    load; it releases the pool of the calling thread only), or None: another OS, or another
    runtime (LLVM's, Intel's), whose pause has not been tried with boo."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith("libgomp"):
            try:
                pause = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return pause
    return None


@functools.cache
def hint_wait_policy() -> None:
    """Once per process: torch's OpenMP threads spin for a while after each parallel region
    unless OMP_WAIT_POLICY=PASSIVE, and on a small machine they take the cores IREE's
    local-task workers need (the transformer-layer step of bench/steps.py ran 1.3-1.5x
    faster with it, eager 0.9x; README, "Known limits")."""
    if torch.get_num_threads() > 1 and os.environ.get("OMP_WAIT_POLICY", "").lower() != "passive":
        log.info("boo: torch's OpenMP threads spin-wait between parallel regions and compete with "
                 "IREE's workers; OMP_WAIT_POLICY=PASSIVE (set before torch is imported) avoids that")


# The waiting thread.
#
# IREE 3.13's synchronous call on local-task keeps its calling thread busy while the workers
# run: the thread spins (a `pause` loop in the semaphore wait) and, woken when a worker
# signals, it takes that worker's core and spins on until the worker, now waiting for a
# core, has finished signalling. Calls then took whole multiples of about 2 ms more: the
# layer-norm + GELU backward of bench/steps.py (4096 x 1024) took 3.5, 5.8, 8.0 or 10.3 ms
# called back to back (median 6.0), and the calling thread used a third of a core.
#
# So the call is made from a thread of Linux's SCHED_BATCH policy, whose wake-up never
# preempts a running thread (it waits for the scheduler's tick or a free core), at the same
# share of the CPU as any other; the caller blocks on a lock (no spin) until it is done. The
# same backward with a SCHED_IDLE thread: median 3.9 ms, 3.3-5 ms; the thread hand-off costs
# about 10 us a call. The ln_gelu step of bench/steps.py, local-task forced, one process per
# policy (ms, median of 40-60 steps, two runs each):
#
# | beside it              | the caller calls | SCHED_BATCH | SCHED_IDLE |
# |------------------------|------------------|-------------|------------|
# | nothing                | 8.0, 9.6         | 6.1, 6.0    | 6.0, 6.1   |
# | one busy process       | 12.0, 11.9       | 11.8, 9.9   | 9.7, 7.6   |
# | two (every core busy)  | 17.9, 16.0       | 20.5, 24.3  | 36.0, 36.0 |
#
# SCHED_IDLE's thread runs only when nothing else wants a core, so with every core busy it
# starved; a niced thread helped less on a quiet machine (paired with the caller's own call:
# SCHED_IDLE 1.53x, nice 19 1.45x, nice 10 1.31x, nice 5 1.25x). SCHED_BATCH's cost with every
# core busy is the wait for a tick at each call's end.


class _Waiter:
    """One daemon thread that runs the calls handed to it, one at a time, for the process
    that started it (after a fork, the child starts its own)."""

    def __init__(self):
        self.pid = os.getpid()
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = threading.Event()
        self.batch = False
        self.thread = threading.Thread(target=self._serve, name="boo-wait", daemon=True)
        self.thread.start()
        self.ready.wait()

    def _serve(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
            self.batch = True
        except (AttributeError, OSError) as e:  # not Linux, or refused
            log.debug("boo: no SCHED_BATCH thread for IREE's local-task calls (%s); the caller makes them", e)
        _name_thread(b"boo-wait")
        self.ready.set()
        if not self.batch:
            return
        while True:
            fn, args, done, failed = self.calls.get()
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                failed.append(e)
            del fn, args  # hold no argument (nor its memory) until the next call
            done.release()
            del done, failed

    def call(self, fn, *args) -> None:
        done = threading.Lock()
        done.acquire()
        failed: list[BaseException] = []
        self.calls.put((fn, args, done, failed))
        done.acquire()
        if failed:
            raise failed[0]


def _name_thread(name: bytes) -> None:
    """The thread's name as `top -H` and /proc show it (Linux's prctl PR_SET_NAME); nothing
    elsewhere."""
    try:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)
    except (OSError, AttributeError):
        pass


_waiter: _Waiter | None = None
_waiter_lock = threading.Lock()


def wait_aside(fn, *args) -> None:
    """fn(*args) (a synchronous local-task call: IREE's workers do its work) run on the
    waiting thread while the caller blocks; fn's exception is raised here. Where no SCHED_BATCH
    thread can be had (or the waiting thread itself calls), the caller runs it."""
    global _waiter
    waiter = _waiter
    if waiter is None or waiter.pid != os.getpid():
        with _waiter_lock:
            if _waiter is None or _waiter.pid != os.getpid():
                _waiter = _Waiter()
            waiter = _waiter
    if not waiter.batch or threading.current_thread() is waiter.thread:
        fn(*args)
        return
    waiter.call(fn, *args)
