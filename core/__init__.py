"""batchd's batching core: pure grouping, DGAP alignment, balancing, loss scaling, the simulator, and the
lifecycle state machines, the job spec, numpy collation, the error hierarchy (a rank's delivery to its trainer, the coordinator's view of who is alive).

No I/O, no threads: the daemon (gRPC, Ray) and the simulator carry these functions' inputs and outputs.
"""

from ._align import (
    MODES,
    Coordinator,
    ProtocolError,
    RankCommit,
    RankReport,
    RoundDecision,
    RoundTotals,
    target_min,
    target_odb,
)
from ._balance import plan_moves, plan_round
from ._collate import (
    IGNORE_INDEX,
    LLM_GRID_KEY,
    TOKEN_KEYS,
    VISION_KEYS,
    collate_images,
    collate_packed,
    collate_padded,
    idle_batch,
    image_of,
    llm_grids,
    loss_tokens,
    strip_vision,
)
from ._cost import COST_MODELS, CostModel
from ._delivery import ATTACHED, END, REFUSED, SEND_END, WAIT, Connect, Delivery, fixed_capacity, report_capacity
from ._errors import BatchdError, CoordinatorError, JobFailed, RankServiceError
from ._grouping import (
    best_fit_decreasing,
    contiguous_greedy,
    fixed_chunks,
    odb_greedy,
    odb_split,
    split_largest,
)
from ._liveness import Liveness
from ._microbatch import balanced_split, chunk_split
from ._loss import loss_scale
from ._phases import (
    EXCHANGE_KEYS,
    PHASES,
    Exchange,
    ImageRef,
    VisionCost,
    exchange_arrays,
    exchanged,
    imbalance,
    mean_imbalance,
    phase_loads,
    plan_vision,
    plan_vision_round,
    single_phase,
    vision_bound,
)
from ._policy import ALIGN_RULES, POLICIES, Entry, Policy, form_groups
from ._rank import OVER_BUDGET, RankState, fill_may_stop, max_fitting_length
from ._simulator import (
    WORKLOAD_HEADER,
    PhaseMetrics,
    SimMetrics,
    RESULT_FIELDS,
    Simulator,
    parse_lengths,
    format_workload,
    parse_workload,
    simulate,
    synthetic_token_loss,
)
from ._blockview import BlockView
from ._source import ViewSource, epoch_permutation
from ._spec import COLLATE, FIELDS, REQUIRED, JobSpec
from ._types import Sample, Step, StepInfo, check_bool, parse_bytes, check_choice, check_int, check_number, check_str

__all__ = sorted([
    "BatchdError", "COLLATE", "CoordinatorError", "FIELDS", "IGNORE_INDEX", "JobFailed", "JobSpec", "RankServiceError", "REQUIRED",
    "VISION_KEYS", "LLM_GRID_KEY", "TOKEN_KEYS", "llm_grids", "check_bool", "check_choice", "check_int", "check_number", "check_str", "collate_images", "collate_packed", "collate_padded", "idle_batch", "image_of", "strip_vision", "loss_tokens", "balanced_split", "chunk_split",
    "ALIGN_RULES", "ATTACHED", "COST_MODELS", "END", "MODES", "OVER_BUDGET", "POLICIES", "REFUSED",
    "SEND_END", "WAIT",
    "Connect", "Coordinator", "CostModel", "Delivery", "Entry", "Liveness", "Policy", "ProtocolError", "RankCommit", "RankReport",
    "RankState", "RoundDecision", "RoundTotals", "RESULT_FIELDS", "Sample", "SimMetrics", "Simulator",
    "Step", "StepInfo", "ViewSource", "BlockView", "parse_bytes",
    "best_fit_decreasing", "contiguous_greedy", "epoch_permutation", "fixed_chunks", "form_groups",
    "loss_scale", "max_fitting_length", "odb_greedy", "odb_split", "parse_lengths", "plan_moves", "plan_round",
    "simulate", "split_largest", "EXCHANGE_KEYS", "PHASES", "Exchange", "exchange_arrays", "ImageRef", "VisionCost", "exchanged", "imbalance", "mean_imbalance",
    "phase_loads", "PhaseMetrics", "format_workload", "parse_workload", "WORKLOAD_HEADER", "plan_vision", "plan_vision_round", "single_phase", "vision_bound", "synthetic_token_loss", "target_min", "target_odb",
    "fill_may_stop", "fixed_capacity", "report_capacity",
])
