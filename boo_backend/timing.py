"""How boo times a call on this host: calls in turns, their typical time, and a timing taken
again while other work took the machine. Used by extern (ATen's kernel against IREE's code
for one op) and its call floor.

Imports only hostload from boo_backend.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from . import hostload

# Timing: ATen and IREE in turns until this many seconds or calls each, keeping each one's
# median (typical_times; the call floor keeps the minimum, min_time). (0.2 s and 20 calls
# made the timings a sixth of a Llama's cold compile; ten calls each are as good a guide
# where ATen and IREE differ by more than the noise, and where they do not, either choice
# costs little.)
BUDGET_S = 0.1
MAX_CALLS = 10
# The call floor's module takes ~0.1 ms a call: it is called for the whole budget (min_time).
FLOOR_CALLS = 5000
# random_like repeats this many random values.
BLOCK = 4099
# A call at least this long is timed once after its warm-up (not three times): at this
# length one call's noise is a few percent, and a vocabulary projection's matmul takes a
# second here, so three calls of each kind made placing it cost more than compiling.
LONG_S = 0.05
# IREE's drivers beyond the default (local-sync, one core) are timed only for calls this
# short: in GPT-2 small's timings (2 cores) local-sync took 1.2-1.6x local-task's time for
# every op past 10 ms, and timing it made a third of the placement's time.
SHORT_S = 0.01
# A timing taken while other work took the machine (hostload.Window) is taken again, up to
# this many times in one compile, and in up to this many compiles in all (a machine that is
# never quiet must not time every matmul again in every process).
ATTEMPTS = 3
SAMPLES = 3


def random_like(v: torch.Tensor) -> torch.Tensor:
    """Random values in the layout of `v` (its strides: a transposed weight stays one). A
    vocabulary's weight holds tens of millions of elements, and drawing each from a normal
    distribution cost seconds of a cold compile; a timing needs no more than a block of
    random values repeated (no zeros, no denormals)."""
    t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    if not v.dtype.is_floating_point:
        return t.fill_(1)
    flat = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,))
    block = _random_block(v.dtype, v.device)
    whole = flat.numel() // block.numel() * block.numel()
    if whole:
        flat[:whole].view(-1, block.numel()).copy_(block.expand(whole // block.numel(), -1))
    flat[whole:].copy_(block[: flat.numel() - whole])
    return t


@functools.cache
def _random_block(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(BLOCK, generator=g).to(dtype=dtype, device=device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_rounds(fns: list, device: torch.device, scale: int = 1, rounds: int = MAX_CALLS,
                  optional: int = 0) -> list[list[float]]:
    """The times of repeated calls of each of `fns`, called in turns, until the calls have
    taken BUDGET_S seconds for each of `fns` called (ATen's calls counted every time) or
    `rounds` rounds (at least 3 rounds, or 1 for calls past LONG_S); `scale`
    (max-autotune) measures that many times longer. A round calls `fns[0]` (ATen's kernel)
    before each of the others, so that each IREE driver meets the machine as ATen leaves it,
    as in a graph cut between them: torch's OpenMP threads spin for a while after a parallel
    region, and local-task's workers timed after local-sync's call met none of that (an MLP's
    256x512x1024 matmuls timed 1.9-2.0 ms on local-task, as fast as ATen's, and took 3 ms
    each in the step's IREE part). The last `optional` of `fns` are not called (no times)
    when the others' calls are past SHORT_S (max-autotune calls them all)."""
    required = len(fns) - optional
    start = time.perf_counter()
    for fn in fns[:required]:
        fn()  # warm-up
        sync(device)
    per_call = (time.perf_counter() - start) / required
    called = len(fns) if per_call <= SHORT_S or scale > 1 else required
    for fn in fns[required:called]:
        fn()
        sync(device)
    order = [0] if called == 1 else [k for i in range(1, called) for k in (0, i)]
    least = 1 if per_call > LONG_S * scale else 3
    times: list[list[float]] = [[] for _ in fns]
    spent = 0.0
    done = 0
    while done < rounds * scale and (spent < BUDGET_S * scale * called or done < least):
        for k in order:
            start = time.perf_counter()
            fns[k]()
            sync(device)
            times[k].append(time.perf_counter() - start)
            spent += times[k][-1]
        done += 1
    return times


def min_time(fn, device: torch.device) -> float:
    """The fastest of repeated calls of `fn` over the whole budget (timed_rounds, up to
    FLOOR_CALLS calls, not MAX_CALLS: the fastest of ten is a poor minimum)."""
    return min(timed_rounds([fn], device, rounds=FLOOR_CALLS)[0])


def typical_times(fns: list, device: torch.device, scale: int = 1, optional: int = 0) -> list[float | None]:
    """The median time of each of `fns` (None for an optional one left out), called in turns
    (timed_rounds), so that every one meets the machine as the others leave it, as ATen's
    kernels and IREE's calls meet each other in a graph cut between them. The median, not
    the fastest: on a 2-core VM IREE's local-task calls of a few milliseconds came in two
    modes, the fast one (4.4 ms for a 512x1408x512 matmul, ATen 4.3) a third of the time and
    twice that otherwise, so the fastest call made IREE look as fast as ATen where it took
    twice ATen's time in the step."""
    return [statistics.median(kept) if kept else None for kept in timed_rounds(fns, device, scale, optional=optional)]


def fastest(measure, earlier: dict | None) -> dict:
    """`measure()`'s seconds ({name: s}), taken in a hostload.Window and again at once while
    other work took the machine (up to ATTEMPTS times), each kept at its fastest here and in
    `earlier` (a cached result not yet settled); with "quiet", "others" (cores) and "samples"
    (the compiles that measured it)."""
    result = dict(earlier or {})
    for _ in range(ATTEMPTS):
        with hostload.Window() as window:
            times = measure()
        for name, seconds in times.items():
            result[name] = min(result.get(name, seconds), seconds)
        result.update(quiet=window.quiet, others=window.others or 0.0)
        if window.quiet:
            break
    result["samples"] = result.get("samples", 0) + 1
    return result


def settled(known: dict | None) -> bool:
    """Whether a cached measurement stands: taken on a quiet machine, or in SAMPLES compiles."""
    return known is not None and (known.get("quiet", True) or known.get("samples", 1) >= SAMPLES)


def under_load(result: dict) -> str:
    return "" if result["quiet"] else f" (other work took {result['others']:.1f} cores while timing)"
