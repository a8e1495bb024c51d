"""What every tiermem optimizer checks of a param group before torch's ``add_param_group`` takes it.  Pure.

One check so far: a param listed twice in a group.  ``torch.optim`` warns and
updates such a param twice a step ("in future, this will cause an error",
pytorch/pytorch#40967).  An optimizer that keeps one state per tensor (the
daemon's registration, ``CPUAdam``'s fused update) trained something else than
``torch.optim.AdamW`` then, silently: 3 steps of a ``Linear(4, 4)`` whose
weight was listed twice ended 0.03 (``OffloadAdam``) and 0.005 (``CPUAdam``)
away from AdamW.  Refusing is what torch means to do, and such a list is
almost always a slip (a tied weight collected by hand).  A param in two groups
is torch's own ``ValueError``.
"""

from __future__ import annotations

from typing import Any

from tiermem.core.errors import InvalidArgument

__all__ = ["check_params_once"]


def check_params_once(param_group: dict[str, Any], owner: str) -> None:
    """Refuse ``param_group`` when it lists one param twice, naming both positions.  A generator of params
    is turned into the list torch would make of it (it can be read once)."""
    params = param_group.get("params")
    if params is None or hasattr(params, "shape"):
        return  # torch makes a lone tensor a list, and refuses a missing "params" in its own words
    params = param_group["params"] = list(params)
    first: dict[int, int] = {}
    for i, p in enumerate(params):
        j = first.setdefault(id(p), i)
        if j != i:
            shape = tuple(getattr(p, "shape", ()))
            raise InvalidArgument(
                f"the param group lists one param twice (positions {j} and {i}, shape {shape}); {owner} takes "
                "each param once (torch.optim would update it twice a step, and warns that it will refuse it "
                "too): list it once"
            )
