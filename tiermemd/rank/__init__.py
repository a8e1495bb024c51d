"""A rank's optimizer inside the daemon: records, phase, planner, update runner, and the rank itself.

``rank`` owns the step; ``records`` the per-tensor records and the phase
machine; ``planner`` (pure) the update pieces; ``runner`` the execution of
pieces on the CPU scheduler and the rank's pipeline thread; ``stateio`` the
state transfer through the staging window; ``stats`` the snapshot of its figures.
"""

from tiermemd.rank.rank import RankOptimizer, Registration, state_keys_for
from tiermemd.rank.runner import AdamKernel, AdamSlices
from tiermemd.rank.stats import RankStats

__all__ = ["AdamKernel", "AdamSlices", "RankOptimizer", "RankStats", "Registration", "state_keys_for"]
