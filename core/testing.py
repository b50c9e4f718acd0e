"""What batchd's tests and benchmarks need from `batchd.core` beyond its API (no stability promise).

`batchd.core` exports what another layer or a user imports (`tools/surface.py --check` holds it to
that). The rest that tests and benchmarks use is here, so no test imports a private module, and
`batchd.testing` gathers it with the other layers' `testing` modules (tests import it from there):

- the planners' internal steps, for their property tests: the vision plan's greedy placement and its
  search (`_phases`), its local search (`_phase_search`), the Karmarkar-Karp start (`_phase_ldm`),
  the node-aware round plan's outlier pooling and level dealing (`_plan_nodes`, `_plan_deal`), the
  node-blind plan's level rows (`_plan_level`), the node-local round's sharing out (`_plan_local`);
- the pieces the public planners and the simulator are built from, which tests and benchmarks call on
  their own: the grouping functions, the grouping policy's `Entry` / `form_groups`, the target rules,
  the encoder phases' loads and bounds, the update windows, `ClockedStateful`, a few constants.
"""

from ._align import target_min, target_odb
from ._calibrate import Fit, batch_terms
from ._choices import POLICIES
from ._delivery import REFUSED, fixed_capacity
from ._encoders import EncoderCost
from ._grouping import best_fit_decreasing, fixed_chunks, odb_greedy, odb_split, split_largest
from ._microbatch import chunk_split
from ._phase_ldm import LDM_GAIN, ldm_place
from ._phase_search import PARTNERS
from ._phase_search import improve as vision_improve
from ._phases import (
    ACCEPT,
    SLACKS,
    phase_loads,
    plan_phase,
    plan_vision_round,
    single_phase,
    vision_bound,
)
from ._phases import _greedy as vision_greedy
from ._phases import _images as vision_images
from ._phases import _lpt as vision_lpt
from ._phases import _place as vision_place
from ._plan_deal import deal_levels
from ._plan_level import LEVEL_TOLERANCE, final_rows, level_choice
from ._plan_local import LOCAL_TOLERANCE, node_shares, share_out
from ._plan_moves import step_fetches
from ._plan_nodes import outliers
from ._policy import Entry, form_groups
from ._sim_metrics import synthetic_token_loss
from ._state import ClockedStateful
from ._updates import UpdateWindows, update_scale
from ._workload import WORKLOAD_HEADER

__all__ = [
    "ACCEPT",
    "ClockedStateful",
    "EncoderCost",
    "Entry",
    "Fit",
    "LDM_GAIN",
    "LEVEL_TOLERANCE",
    "LOCAL_TOLERANCE",
    "PARTNERS",
    "POLICIES",
    "REFUSED",
    "SLACKS",
    "UpdateWindows",
    "WORKLOAD_HEADER",
    "batch_terms",
    "best_fit_decreasing",
    "chunk_split",
    "deal_levels",
    "final_rows",
    "fixed_capacity",
    "fixed_chunks",
    "form_groups",
    "ldm_place",
    "level_choice",
    "node_shares",
    "odb_greedy",
    "odb_split",
    "outliers",
    "phase_loads",
    "plan_phase",
    "plan_vision_round",
    "share_out",
    "single_phase",
    "split_largest",
    "step_fetches",
    "synthetic_token_loss",
    "target_min",
    "target_odb",
    "update_scale",
    "vision_bound",
    "vision_greedy",
    "vision_images",
    "vision_improve",
    "vision_lpt",
    "vision_place",
]
