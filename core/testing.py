"""The planners' internal steps, public for their property tests only (no stability promise).

`batchd.core`'s planners are tested through their public functions and, where a property belongs to
one step, through that step: the vision plan's greedy placement and its search (`batchd.core._phases`),
its local search (`batchd.core._phase_search`), and the node-aware round plan's outlier pooling and
level dealing (`batchd.core._plan_nodes`, `batchd.core._plan_deal`), and the node-blind plan's level
rows (`batchd.core._plan_level`), and the node-local round's sharing out (`batchd.core._plan_local`).
Tests import them from here, so no test imports a private module.
"""

from ._phase_ldm import LDM_GAIN, ldm_place
from ._phase_search import PARTNERS
from ._phase_search import improve as vision_improve
from ._phases import ACCEPT, SLACKS
from ._phases import _greedy as vision_greedy
from ._phases import _images as vision_images
from ._phases import _lpt as vision_lpt
from ._phases import _place as vision_place
from ._plan_deal import deal_levels
from ._plan_level import LEVEL_TOLERANCE, final_rows, level_choice
from ._plan_local import LOCAL_TOLERANCE, node_shares, share_out
from ._plan_nodes import outliers

__all__ = [
    "ACCEPT",
    "LDM_GAIN",
    "LEVEL_TOLERANCE",
    "LOCAL_TOLERANCE",
    "PARTNERS",
    "SLACKS",
    "deal_levels",
    "final_rows",
    "level_choice",
    "ldm_place",
    "node_shares",
    "outliers",
    "share_out",
    "vision_greedy",
    "vision_images",
    "vision_improve",
    "vision_lpt",
    "vision_place",
]
