"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks.

:class:`MixtureOfExperts` routes each token to its top-k experts, moves the rows to the
experts' ranks with an all-to-all and back with its inverse (:mod:`.dispatch`), and
applies the experts there (:mod:`.experts`); :mod:`.router` holds the gating and the
load-balancing and z losses. Autograd-free like the rest of axondist: ``forward`` and
``backward`` are explicit.
"""

from .dispatch import (
    DispatchPlan,
    DispatchStats,
    assignment_positions,
    combine,
    dispatch,
    expert_capacity,
    pack,
    plan_dispatch,
    unpack,
)
from .experts import LocalExperts, expert_weights, router_weight
from .layer import MixtureOfExperts
from .router import (
    BalanceTotals,
    Routing,
    load_balancing_loss,
    route,
    route_backward,
    z_loss,
)

__all__ = [
    "BalanceTotals",
    "DispatchPlan",
    "DispatchStats",
    "LocalExperts",
    "MixtureOfExperts",
    "Routing",
    "assignment_positions",
    "combine",
    "dispatch",
    "expert_capacity",
    "expert_weights",
    "load_balancing_loss",
    "pack",
    "plan_dispatch",
    "route",
    "route_backward",
    "router_weight",
    "unpack",
    "z_loss",
]
