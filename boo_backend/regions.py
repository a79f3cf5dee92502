"""Which form runs a compiled region once its graphs are built: boo's (AOTAutograd's
decomposed graphs, parts in IREE or ATen) or Dynamo's own graph in eager PyTorch.

Dynamo's graph run as it is costs eager's own kernels and autograd; AOTAutograd's graphs run
op by op cost more (the MLP of bench/steps.py: 8% of its step, a transformer layer 3-8%),
and only IREE parts that win more than that pay for them. A part's own measurement
(runtime._choose, against its graph in ATen) cannot see that cost: on 2 cores, one part of
the MLP's loss kept in IREE by 30 us took its step from 0.98x eager to 0.81x, and a
transformer layer ran at 0.87x with two parts in IREE against 1.01x as Dynamo's graph.

So, outside strict mode and with boo's drivers and matmuls left to measurement:
- a region whose parts all chose ATen runs Dynamo's graph from its next call (nothing of it
  would run in IREE);
- a region of static shapes with parts in IREE, whose calls come less than TRIAL_LIMIT_S
  apart, is timed both ways: TRIAL_PAIRS pairs of calls after a warm-up pair, each pair in a
  random order (so that the trials of two regions of one step do not move in step). A
  call's time is the time to the region's next call: a training step's forward, backward,
  optimizer and all (and whatever else the program does between calls, the same for both).
  The lower median wins, and the choice stays. (Calls of a region of dynamic shapes differ
  in size: it is not timed.)

Longer calls are not timed: a trial would run some of a large model's steps in eager, and
such parts do enough work to pay for AOTAutograd's graphs (GPT-2 small trains at 1.5x eager).
Imports placement from boo_backend.
"""

from __future__ import annotations

import logging
import random
import statistics
import time

from .placement import PLACEMENTS

log = logging.getLogger("boo_backend")

TRIAL_LIMIT_S = 0.25
TRIAL_PAIRS = 7
_BOO, _EAGER = "boo", "eager"


def allowed(opts) -> bool:
    """Whether a region may move to Dynamo's graph: never where IREE must run (strict mode),
    where nothing is loaded (compile_only), or where the user named the drivers or matmuls."""
    return not (opts.strict or opts.compile_only) and opts.cpu_driver == "auto" and opts.aten_matmul == "auto"


def faster(compiled, dynamos, graphs: list, name: str, timed: bool = True):
    """The region's callable: `compiled` (AOTAutograd's function) until every graph of it is
    built (a training graph waits for its backward) and every IREE module has chosen its
    driver; then Dynamo's graph (`dynamos`) if all parts chose ATen, else the faster of the
    two as timed (see the module's docstring; not when `timed` is False)."""
    chosen = None
    trial = None

    def run(*args):
        nonlocal chosen, trial
        if chosen is not None:
            return chosen(*args)
        if trial is not None:
            out, winner = trial(args)
            if winner is not None:
                chosen = dynamos.forward if winner == _EAGER else compiled
            return out
        out = compiled(*args)
        kinds = {g.kind for g in graphs}
        if (not graphs or ("forward" in kinds and "backward" not in kinds) or not all(g.built() for g in graphs)
                or any(getattr(f, "driver", None) is None for g in graphs for f in g.functions)):
            return out  # not all built and measured yet
        if all(g.on_aten_only() for g in graphs):
            chosen = dynamos.forward
            _mark(graphs, "every part measured faster in ATen")
            log.info("boo %s: every part of %s measured faster in ATen; Dynamo's graph runs in eager PyTorch "
                     "from now on", name, " and ".join(g.name for g in graphs))
        elif timed and not any(g.dynamic for g in graphs):  # calls of other sizes would be compared
            trial = _Trial(compiled, dynamos.forward, graphs, name)
        else:
            chosen = compiled
        return out

    for attr in ("zero_grad", "named_parameters", "named_buffers", "serialize"):
        if hasattr(compiled, attr):
            setattr(run, attr, getattr(compiled, attr))
    return run


class _Trial:
    """The timed calls of one region: `__call__(args)` runs one call on the arm its turn
    names and gives (its result, the winner once decided, else None)."""

    def __init__(self, compiled, eager, graphs: list, name: str):
        self.arms = {_BOO: compiled, _EAGER: eager}
        self.graphs = graphs
        self.name = name
        self.rng = random.Random(name)
        # The warm-up pair, not timed: boo's call first, so that a region whose calls take
        # longer than TRIAL_LIMIT_S never runs in eager (nor holds eager's memory besides boo's).
        self.turns = [_BOO, _EAGER]
        self.warm = 2
        self.times: dict[str, list[float]] = {_BOO: [], _EAGER: []}
        self.last: tuple[str, float] | None = None

    def __call__(self, args):
        now = time.perf_counter()
        if self.last is not None:
            arm, start = self.last
            if self.warm > 0:
                self.warm -= 1
                if arm == _BOO and now - start > TRIAL_LIMIT_S:
                    return self._decide(_BOO, f"its calls take {(now - start) * 1e3:.0f} ms; not timed", args)
            else:
                self.times[arm].append(now - start)
        if min(len(t) for t in self.times.values()) >= TRIAL_PAIRS:
            boo, eager = (statistics.median(self.times[a]) for a in (_BOO, _EAGER))
            winner = _EAGER if eager < boo else _BOO
            return self._decide(winner, f"{eager * 1e3:.2f} ms a call as Dynamo's graph in eager against "
                                f"{boo * 1e3:.2f} ms as boo's", args)
        if not self.turns:
            pair = [_BOO, _EAGER]
            self.rng.shuffle(pair)
            self.turns = pair
        arm = self.turns.pop(0)
        self.last = (arm, time.perf_counter())
        return self.arms[arm](*args), None

    def _decide(self, winner: str, why: str, args):
        if winner == _EAGER:
            _mark(self.graphs, f"measured faster: {why}")
            log.info("boo %s: Dynamo's graph runs in eager PyTorch from now on (%s)", self.name, why)
        else:
            log.info("boo %s: boo's graphs stay (%s)", self.name, why)
        return self.arms[winner](*args), winner


def _mark(graphs: list, why: str) -> None:
    """Say so in the placement of each graph of the region (boo_backend.placements())."""
    names = {n for g in graphs for n in g.names()}
    for p in PLACEMENTS:
        if p.name in names:
            p.in_eager = why
