"""A rank's optimizer inside the daemon: records, phase, planner, update runner, and the rank itself.

``rank`` owns the step; ``records`` the per-tensor records and the phase
machine; ``planner`` (pure) the update pieces; ``runner`` the execution of
pieces on the CPU scheduler and the rank's pipeline thread; ``stateio`` the
state transfer through the staging window.
"""

from tiermemd.rank.rank import RankOptimizer, Registration, state_keys_for
from tiermemd.rank.runner import AdamKernel

__all__ = ["AdamKernel", "RankOptimizer", "Registration", "state_keys_for"]
