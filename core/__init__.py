"""batchd's batching core: pure grouping, DGAP alignment, balancing, loss scaling, the simulator, the
lifecycle state machines (a rank's delivery to its trainer, the coordinator's view of who is alive), one
node's view of a round's plan, the job spec and its choice lists, the state contract, numpy collation, and
the error hierarchy.

No I/O, no threads: the daemon (gRPC, Ray) and the simulator carry these functions' inputs and outputs.

Where things live (private modules, their public names re-exported here). At the bottom, importing
nothing or only each other: `_types` (`Sample`, the `check_*` validators), `_choices` (`JobSpec`'s
choice lists), `_state` (the state keys, `STATE_VERSION`, `check_state`, the `Stateful` protocols),
`_errors`, `_exchange` (`Exchange`, `ImageRef`), `_step` (`Step`, `StepInfo`). Above them: `_cost`,
`_grouping`, `_policy` (grouping policies), `_encoders` (the encoders' cost models), `_phases` (the
encoder phases' plans, vision and audio; the local search in `_phase_search`, the exact MILP yardstick
in `_phase_exact`), `_plan` (the balanced round
plan; its steps in `_plan_blind`, `_plan_nodes`, `_plan_deal`, `_plan_moves`), `_node_plan` (one node's
view of a decision), `_align` (DGAP messages, target rules, `Coordinator`), `_rank` (`RankState`),
`_source` and `_blockview` (sampler views), `_delivery`, `_liveness`, `_loss`, `_microbatch`,
`_collate`, `_updates` (optimizer update boundaries), `_ledger` (the step ledger), `_resize` (an epoch
resumed at another world size), `_spec_parts` (its parts: `PolicySpec`, `Phases`, `Updates`), `_spec`
(`JobSpec`), `_workload` (workload files), `_sim_metrics`,
`_simulator`, `_calibrate` (fitting a cost model and a budget to measured steps), `_cost_check`
(how well the cost model predicted the trainers' measured steps), `_oom` (the budget after an
out-of-memory step). No module cycle:
`tools/import_graph.py --check` fails on one. `batchd.core.testing` exposes what only tests and
benchmarks use (planner steps, grouping functions, ...); `batchd.testing` gathers it.
"""

from ._align import (
    Coordinator,
    ProtocolError,
    RankCommit,
    RankReport,
    RoundDecision,
    RoundTotals,
)
from ._blockview import BlockLayout, BlockView
from ._calibrate import BUDGET_QUANTUM, CostFit, Measured, fit_layout
from ._collate import (
    AUDIO_KEYS,
    IGNORE_INDEX,
    TOKEN_KEYS,
    VISION_KEYS,
    clip_of,
    collate_clips,
    collate_images,
    collate_packed,
    collate_padded,
    idle_batch,
    image_of,
    llm_grids,
    loss_tokens,
    strip_audio,
    strip_vision,
)
from ._cost import CostModel
from ._cost_check import cost_check
from ._delivery import (
    ATTACHED,
    END,
    SEND_END,
    WAIT,
    Connect,
    Delivery,
    report_capacity,
)
from ._encoders import AudioCost, VisionCost
from ._errors import BatchdError, CoordinatorError, JobFailed, RankServiceError
from ._exchange import Exchange, ImageRef
from ._grouping import contiguous_greedy
from ._ledger import StepLedger
from ._liveness import Liveness
from ._loss import loss_scale
from ._microbatch import balanced_split
from ._node_plan import decision_for_node, round_exchanges
from ._oom import lowered_budget
from ._phase_bound import encoder_bound
from ._phase_exact import exact_placement
from ._phases import (
    AUDIO_EXCHANGE_KEYS,
    EXCHANGE_KEYS,
    exchange_arrays,
    exchanged,
    imbalance,
    mean_imbalance,
    plan_phases,
    plan_vision,
)
from ._plan import PlanInputs, RoundPlan, plan_round
from ._plan_moves import plan_moves
from ._policy import Policy
from ._rank import RankState, fill_may_stop, max_fitting_length
from ._resize import Remainder, resume_point
from ._sim_metrics import RESULT_FIELDS
from ._simulator import Simulator, simulate
from ._source import ViewSource, epoch_permutation
from ._spec import GROUPS, KEYS, REQUIRED, JobSpec
from ._spec_parts import Phases, PolicySpec, Updates
from ._state import STATE_VERSION, Stateful, check_state
from ._step import Step, StepInfo
from ._types import (
    Sample,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_str,
    parse_bytes,
)
from ._workload import format_workload, parse_lengths, parse_workload

__all__ = [
    "ATTACHED",
    "AUDIO_EXCHANGE_KEYS",
    "AUDIO_KEYS",
    "AudioCost",
    "BUDGET_QUANTUM",
    "BatchdError",
    "BlockLayout",
    "BlockView",
    "Connect",
    "Coordinator",
    "CoordinatorError",
    "CostFit",
    "CostModel",
    "Delivery",
    "END",
    "EXCHANGE_KEYS",
    "Exchange",
    "GROUPS",
    "IGNORE_INDEX",
    "ImageRef",
    "JobFailed",
    "JobSpec",
    "KEYS",
    "Liveness",
    "Measured",
    "Phases",
    "PlanInputs",
    "Policy",
    "PolicySpec",
    "ProtocolError",
    "REQUIRED",
    "RESULT_FIELDS",
    "RankCommit",
    "RankReport",
    "RankServiceError",
    "RankState",
    "Remainder",
    "RoundDecision",
    "RoundPlan",
    "RoundTotals",
    "SEND_END",
    "STATE_VERSION",
    "Sample",
    "Simulator",
    "Stateful",
    "Step",
    "StepInfo",
    "StepLedger",
    "TOKEN_KEYS",
    "Updates",
    "VISION_KEYS",
    "ViewSource",
    "VisionCost",
    "WAIT",
    "balanced_split",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "check_state",
    "check_str",
    "clip_of",
    "collate_clips",
    "collate_images",
    "collate_packed",
    "collate_padded",
    "contiguous_greedy",
    "cost_check",
    "decision_for_node",
    "encoder_bound",
    "epoch_permutation",
    "exact_placement",
    "exchange_arrays",
    "exchanged",
    "fill_may_stop",
    "fit_layout",
    "format_workload",
    "idle_batch",
    "image_of",
    "imbalance",
    "llm_grids",
    "loss_scale",
    "loss_tokens",
    "lowered_budget",
    "max_fitting_length",
    "mean_imbalance",
    "parse_bytes",
    "parse_lengths",
    "parse_workload",
    "plan_moves",
    "plan_phases",
    "plan_round",
    "plan_vision",
    "report_capacity",
    "resume_point",
    "round_exchanges",
    "simulate",
    "strip_audio",
    "strip_vision",
]
