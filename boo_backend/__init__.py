"""boo: a torch.compile backend that compiles whole graphs with torch-mlir and IREE.

    model = torch.compile(model, backend="boo")

The backend registers through the `torch_dynamo_backends` entry point, so importing this
package is not needed for the line above. Controls are in `boo_backend.config`.
"""

from .backend import boo
from .cache import STATS, clear_memory
from .config import BooError, BooFallbackWarning, BooStrictError, Options
from .placement import PLACEMENTS, Placement
from .pool import RESULTS as _RESULTS

__all__ = [
    "boo", "BooError", "BooFallbackWarning", "BooStrictError", "Options", "Placement",
    "placements", "stats", "reset",
]


def placements() -> list[Placement]:
    """Where the ops of every graph compiled so far in this process went."""
    return list(PLACEMENTS)


def stats() -> dict:
    """Process-wide counters: iree_compiles, cache_hits_memory, cache_hits_disk, cache_corrupt,
    dynamic_checks (calls of dynamic modules checked against eager) and dynamic_check_s
    (the seconds those checks took)."""
    return dict(STATS)


def reset() -> None:
    """Forget counters, placements, the in-memory compile cache (not the disk cache) and the
    result storage kept for reuse (pool.py)."""
    STATS.clear()
    PLACEMENTS.clear()
    clear_memory()
    _RESULTS.clear()
