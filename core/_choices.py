"""The choice lists of `JobSpec`'s fields, beside the spec and below every module that uses them.

`JobSpec` validates each of these fields against its list (`check_choice`), and the modules that act on
a choice (the policy, the cost model, the coordinator, the rank state, the vision phase, the collation)
read the same list from here. This module imports nothing: `_spec` and the protocol modules both import
it, so neither has to import the other.
"""

from __future__ import annotations

# `JobSpec.mode`: join (every sample once) or non-join (a sample quota); the coordinator closes the epoch.
MODES = ("join", "non-join")
# `PolicySpec.name`: the grouping policy (`Policy`).
POLICIES = ("balanced", "fixed", "local", "odb", "sorted")
# `PolicySpec.align`: the DGAP target rule (`target_min`, `target_odb`).
ALIGN_RULES = ("min", "odb")
# `JobSpec.cost.name`: the cost model of a group (`CostModel`).
COST_MODELS = ("attention", "packed", "padded")
# `PolicySpec.over_budget`: what the rank state does with a sample longer than the token budget.
OVER_BUDGET = ("reject", "singleton", "truncate")
# `PolicySpec.nodes`: how `balanced` plans a round once node agents registered the topology.
NODE_PLANS = ("aware", "blind", "local")
# `Phases.count`: 1 (LLM plan only) or 2 (a vision-encoder plan per step beside it).
PHASES = (1, 2)
# `PolicySpec.collate`: the batch layout the rank service builds.
COLLATE = ("packed", "padded")
# `Updates.update_rule`: where an optimizer update closes when `tokens_per_update` or `samples_per_update`
# is set (`UpdateWindows`): cumulative (update k at the running count k x G) or at_least (each >= G).
UPDATE_RULES = ("at_least", "cumulative")
