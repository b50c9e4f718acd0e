from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeProtocol(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_PROTOCOL_UNSPECIFIED: _ClassVar[NodeProtocol]
    NODE_PROTOCOL_V1: _ClassVar[NodeProtocol]
NODE_PROTOCOL_UNSPECIFIED: NodeProtocol
NODE_PROTOCOL_V1: NodeProtocol

class ModalityTokens(_message.Message):
    __slots__ = ("name", "tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    tokens: int
    def __init__(self, name: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class SampleMeta(_message.Message):
    __slots__ = ("id", "length", "loss_tokens", "home_rank", "modality_tokens", "nbytes", "image_patches", "image_tokens", "audio_frames", "audio_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOME_RANK_FIELD_NUMBER: _ClassVar[int]
    MODALITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PATCHES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FRAMES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: int
    length: int
    loss_tokens: int
    home_rank: int
    modality_tokens: _containers.RepeatedCompositeFieldContainer[ModalityTokens]
    nbytes: int
    image_patches: _containers.RepeatedScalarFieldContainer[int]
    image_tokens: _containers.RepeatedScalarFieldContainer[int]
    audio_frames: _containers.RepeatedScalarFieldContainer[int]
    audio_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[int] = ..., length: _Optional[int] = ..., loss_tokens: _Optional[int] = ..., home_rank: _Optional[int] = ..., modality_tokens: _Optional[_Iterable[_Union[ModalityTokens, _Mapping]]] = ..., nbytes: _Optional[int] = ..., image_patches: _Optional[_Iterable[int]] = ..., image_tokens: _Optional[_Iterable[int]] = ..., audio_frames: _Optional[_Iterable[int]] = ..., audio_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("world_size", "token_budget", "mode", "quota", "epochs", "seed", "shuffle", "deterministic", "policy", "cost", "phases", "updates")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    DETERMINISTIC_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    token_budget: int
    mode: str
    quota: int
    epochs: int
    seed: int
    shuffle: bool
    deterministic: bool
    policy: PolicySpec
    cost: CostModel
    phases: Phases
    updates: Updates
    def __init__(self, world_size: _Optional[int] = ..., token_budget: _Optional[int] = ..., mode: _Optional[str] = ..., quota: _Optional[int] = ..., epochs: _Optional[int] = ..., seed: _Optional[int] = ..., shuffle: _Optional[bool] = ..., deterministic: _Optional[bool] = ..., policy: _Optional[_Union[PolicySpec, _Mapping]] = ..., cost: _Optional[_Union[CostModel, _Mapping]] = ..., phases: _Optional[_Union[Phases, _Mapping]] = ..., updates: _Optional[_Union[Updates, _Mapping]] = ...) -> None: ...

class PolicySpec(_message.Message):
    __slots__ = ("name", "window", "depth", "max_wait", "align", "over_budget", "collate", "batch_size", "refine", "level_rows", "nodes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_FIELD_NUMBER: _ClassVar[int]
    ALIGN_FIELD_NUMBER: _ClassVar[int]
    OVER_BUDGET_FIELD_NUMBER: _ClassVar[int]
    COLLATE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    REFINE_FIELD_NUMBER: _ClassVar[int]
    LEVEL_ROWS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    name: str
    window: int
    depth: int
    max_wait: int
    align: str
    over_budget: str
    collate: str
    batch_size: int
    refine: bool
    level_rows: bool
    nodes: str
    def __init__(self, name: _Optional[str] = ..., window: _Optional[int] = ..., depth: _Optional[int] = ..., max_wait: _Optional[int] = ..., align: _Optional[str] = ..., over_budget: _Optional[str] = ..., collate: _Optional[str] = ..., batch_size: _Optional[int] = ..., refine: _Optional[bool] = ..., level_rows: _Optional[bool] = ..., nodes: _Optional[str] = ...) -> None: ...

class CostModel(_message.Message):
    __slots__ = ("name", "quadratic")
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUADRATIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    quadratic: int
    def __init__(self, name: _Optional[str] = ..., quadratic: _Optional[int] = ...) -> None: ...

class Phases(_message.Message):
    __slots__ = ("count", "vision_quadratic", "audio_quadratic", "exact_nodes")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    VISION_QUADRATIC_FIELD_NUMBER: _ClassVar[int]
    AUDIO_QUADRATIC_FIELD_NUMBER: _ClassVar[int]
    EXACT_NODES_FIELD_NUMBER: _ClassVar[int]
    count: int
    vision_quadratic: int
    audio_quadratic: int
    exact_nodes: int
    def __init__(self, count: _Optional[int] = ..., vision_quadratic: _Optional[int] = ..., audio_quadratic: _Optional[int] = ..., exact_nodes: _Optional[int] = ...) -> None: ...

class Updates(_message.Message):
    __slots__ = ("tokens_per_update", "samples_per_update", "update_rule")
    TOKENS_PER_UPDATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_UPDATE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_RULE_FIELD_NUMBER: _ClassVar[int]
    tokens_per_update: int
    samples_per_update: int
    update_rule: str
    def __init__(self, tokens_per_update: _Optional[int] = ..., samples_per_update: _Optional[int] = ..., update_rule: _Optional[str] = ...) -> None: ...

class StepInfo(_message.Message):
    __slots__ = ("rank", "step", "round", "is_idle", "local_samples", "local_tokens", "local_loss_tokens", "global_samples", "global_tokens", "global_loss_tokens", "loss_scale", "cost", "epoch", "update", "not_update_end", "update_scale", "update_loss_tokens", "update_step", "token_budget")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    IS_IDLE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    NOT_UPDATE_END_FIELD_NUMBER: _ClassVar[int]
    UPDATE_SCALE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    round: int
    is_idle: bool
    local_samples: int
    local_tokens: int
    local_loss_tokens: int
    global_samples: int
    global_tokens: int
    global_loss_tokens: int
    loss_scale: float
    cost: float
    epoch: int
    update: int
    not_update_end: bool
    update_scale: float
    update_loss_tokens: int
    update_step: int
    token_budget: int
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., round: _Optional[int] = ..., is_idle: _Optional[bool] = ..., local_samples: _Optional[int] = ..., local_tokens: _Optional[int] = ..., local_loss_tokens: _Optional[int] = ..., global_samples: _Optional[int] = ..., global_tokens: _Optional[int] = ..., global_loss_tokens: _Optional[int] = ..., loss_scale: _Optional[float] = ..., cost: _Optional[float] = ..., epoch: _Optional[int] = ..., update: _Optional[int] = ..., not_update_end: _Optional[bool] = ..., update_scale: _Optional[float] = ..., update_loss_tokens: _Optional[int] = ..., update_step: _Optional[int] = ..., token_budget: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("rank", "spec", "address")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    spec: JobSpec
    address: str
    def __init__(self, rank: _Optional[int] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., address: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("epoch", "round", "lease_ms", "round_timeout_ms", "rank_addresses", "generation", "resume_needed", "token_budget")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    ROUND_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    RANK_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESUME_NEEDED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    lease_ms: int
    round_timeout_ms: int
    rank_addresses: _containers.RepeatedScalarFieldContainer[str]
    generation: int
    resume_needed: bool
    token_budget: int
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., lease_ms: _Optional[int] = ..., round_timeout_ms: _Optional[int] = ..., rank_addresses: _Optional[_Iterable[str]] = ..., generation: _Optional[int] = ..., resume_needed: _Optional[bool] = ..., token_budget: _Optional[int] = ...) -> None: ...

class OomRequest(_message.Message):
    __slots__ = ("rank", "epoch", "step", "cost", "detail")
    RANK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    rank: int
    epoch: int
    step: int
    cost: float
    detail: str
    def __init__(self, rank: _Optional[int] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., cost: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class OomReply(_message.Message):
    __slots__ = ("token_budget", "message")
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    token_budget: int
    message: str
    def __init__(self, token_budget: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("rank", "epoch", "step", "from_world_size")
    RANK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FROM_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    epoch: int
    step: int
    from_world_size: int
    def __init__(self, rank: _Optional[int] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., from_world_size: _Optional[int] = ...) -> None: ...

class ResumeReply(_message.Message):
    __slots__ = ("epoch", "round", "step", "generation", "remainder", "job_end")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REMAINDER_FIELD_NUMBER: _ClassVar[int]
    JOB_END_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    step: int
    generation: int
    remainder: str
    job_end: bool
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., step: _Optional[int] = ..., generation: _Optional[int] = ..., remainder: _Optional[str] = ..., job_end: _Optional[bool] = ...) -> None: ...

class PoolEntry(_message.Message):
    __slots__ = ("sample", "arrival")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_FIELD_NUMBER: _ClassVar[int]
    sample: SampleMeta
    arrival: int
    def __init__(self, sample: _Optional[_Union[SampleMeta, _Mapping]] = ..., arrival: _Optional[int] = ...) -> None: ...

class AlignRequest(_message.Message):
    __slots__ = ("rank", "epoch", "round", "capacity", "buffered", "groups", "exhausted", "pool", "unread")
    RANK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    UNREAD_FIELD_NUMBER: _ClassVar[int]
    rank: int
    epoch: int
    round: int
    capacity: int
    buffered: int
    groups: int
    exhausted: bool
    pool: _containers.RepeatedCompositeFieldContainer[PoolEntry]
    unread: int
    def __init__(self, rank: _Optional[int] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., capacity: _Optional[int] = ..., buffered: _Optional[int] = ..., groups: _Optional[int] = ..., exhausted: _Optional[bool] = ..., pool: _Optional[_Iterable[_Union[PoolEntry, _Mapping]]] = ..., unread: _Optional[int] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[SampleMeta]
    def __init__(self, samples: _Optional[_Iterable[_Union[SampleMeta, _Mapping]]] = ...) -> None: ...

class RankPlan(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[Group]
    def __init__(self, steps: _Optional[_Iterable[_Union[Group, _Mapping]]] = ...) -> None: ...

class ImageRef(_message.Message):
    __slots__ = ("sample_id", "index", "home_rank", "owner", "patches", "tokens")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HOME_RANK_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PATCHES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    sample_id: int
    index: int
    home_rank: int
    owner: int
    patches: int
    tokens: int
    def __init__(self, sample_id: _Optional[int] = ..., index: _Optional[int] = ..., home_rank: _Optional[int] = ..., owner: _Optional[int] = ..., patches: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class StepExchange(_message.Message):
    __slots__ = ("encode", "sources", "tokens")
    ENCODE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    encode: _containers.RepeatedCompositeFieldContainer[ImageRef]
    sources: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, encode: _Optional[_Iterable[_Union[ImageRef, _Mapping]]] = ..., sources: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class RankVision(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepExchange]
    def __init__(self, steps: _Optional[_Iterable[_Union[StepExchange, _Mapping]]] = ...) -> None: ...

class AlignReply(_message.Message):
    __slots__ = ("epoch", "round", "target", "plan", "vision", "audio")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    target: int
    plan: _containers.RepeatedCompositeFieldContainer[RankPlan]
    vision: _containers.RepeatedCompositeFieldContainer[RankVision]
    audio: _containers.RepeatedCompositeFieldContainer[RankVision]
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., target: _Optional[int] = ..., plan: _Optional[_Iterable[_Union[RankPlan, _Mapping]]] = ..., vision: _Optional[_Iterable[_Union[RankVision, _Mapping]]] = ..., audio: _Optional[_Iterable[_Union[RankVision, _Mapping]]] = ...) -> None: ...

class StepSamples(_message.Message):
    __slots__ = ("lengths", "loss_tokens", "ids")
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    loss_tokens: _containers.RepeatedScalarFieldContainer[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lengths: _Optional[_Iterable[int]] = ..., loss_tokens: _Optional[_Iterable[int]] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("rank", "epoch", "round", "steps", "remaining", "exhausted")
    RANK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    epoch: int
    round: int
    steps: _containers.RepeatedCompositeFieldContainer[StepSamples]
    remaining: int
    exhausted: bool
    def __init__(self, rank: _Optional[int] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepSamples, _Mapping]]] = ..., remaining: _Optional[int] = ..., exhausted: _Optional[bool] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("epoch", "round", "steps", "step_samples", "step_tokens", "step_loss_tokens", "done", "keep_last", "has_keep_last", "update_first", "update_end", "update_loss_tokens", "update_open_steps")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    HAS_KEEP_LAST_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIRST_FIELD_NUMBER: _ClassVar[int]
    UPDATE_END_FIELD_NUMBER: _ClassVar[int]
    UPDATE_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_OPEN_STEPS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    steps: int
    step_samples: _containers.RepeatedScalarFieldContainer[int]
    step_tokens: _containers.RepeatedScalarFieldContainer[int]
    step_loss_tokens: _containers.RepeatedScalarFieldContainer[int]
    done: bool
    keep_last: _containers.RepeatedScalarFieldContainer[int]
    has_keep_last: bool
    update_first: int
    update_end: _containers.RepeatedScalarFieldContainer[bool]
    update_loss_tokens: _containers.RepeatedScalarFieldContainer[int]
    update_open_steps: int
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., steps: _Optional[int] = ..., step_samples: _Optional[_Iterable[int]] = ..., step_tokens: _Optional[_Iterable[int]] = ..., step_loss_tokens: _Optional[_Iterable[int]] = ..., done: _Optional[bool] = ..., keep_last: _Optional[_Iterable[int]] = ..., has_keep_last: _Optional[bool] = ..., update_first: _Optional[int] = ..., update_end: _Optional[_Iterable[bool]] = ..., update_loss_tokens: _Optional[_Iterable[int]] = ..., update_open_steps: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("rank", "ranks")
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("state", "failure")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    state: str
    failure: str
    def __init__(self, state: _Optional[str] = ..., failure: _Optional[str] = ...) -> None: ...

class FailRequest(_message.Message):
    __slots__ = ("rank", "reason")
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    rank: int
    reason: str
    def __init__(self, rank: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class FailReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishRequest(_message.Message):
    __slots__ = ("rank",)
    RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    def __init__(self, rank: _Optional[int] = ...) -> None: ...

class FinishReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeHello(_message.Message):
    __slots__ = ("protocol", "node", "ranks", "spec", "address", "journaled")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    JOURNALED_FIELD_NUMBER: _ClassVar[int]
    protocol: NodeProtocol
    node: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    spec: JobSpec
    address: str
    journaled: bool
    def __init__(self, protocol: _Optional[_Union[NodeProtocol, str]] = ..., node: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., address: _Optional[str] = ..., journaled: _Optional[bool] = ...) -> None: ...

class NodeAlign(_message.Message):
    __slots__ = ("epoch", "round", "reports")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    reports: _containers.RepeatedCompositeFieldContainer[AlignRequest]
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., reports: _Optional[_Iterable[_Union[AlignRequest, _Mapping]]] = ...) -> None: ...

class NodeCommit(_message.Message):
    __slots__ = ("epoch", "round", "commits")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    round: int
    commits: _containers.RepeatedCompositeFieldContainer[CommitRequest]
    def __init__(self, epoch: _Optional[int] = ..., round: _Optional[int] = ..., commits: _Optional[_Iterable[_Union[CommitRequest, _Mapping]]] = ...) -> None: ...

class NodeRequest(_message.Message):
    __slots__ = ("hello", "align", "commit")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    ALIGN_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    hello: NodeHello
    align: NodeAlign
    commit: NodeCommit
    def __init__(self, hello: _Optional[_Union[NodeHello, _Mapping]] = ..., align: _Optional[_Union[NodeAlign, _Mapping]] = ..., commit: _Optional[_Union[NodeCommit, _Mapping]] = ...) -> None: ...

class NodeReply(_message.Message):
    __slots__ = ("registered", "decision", "totals")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    registered: RegisterReply
    decision: AlignReply
    totals: CommitReply
    def __init__(self, registered: _Optional[_Union[RegisterReply, _Mapping]] = ..., decision: _Optional[_Union[AlignReply, _Mapping]] = ..., totals: _Optional[_Union[CommitReply, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("state", "failure", "epoch", "round", "registered", "round_latency_ms", "finished")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    ROUND_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    state: str
    failure: str
    epoch: int
    round: int
    registered: _containers.RepeatedScalarFieldContainer[int]
    round_latency_ms: _containers.RepeatedScalarFieldContainer[float]
    finished: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, state: _Optional[str] = ..., failure: _Optional[str] = ..., epoch: _Optional[int] = ..., round: _Optional[int] = ..., registered: _Optional[_Iterable[int]] = ..., round_latency_ms: _Optional[_Iterable[float]] = ..., finished: _Optional[_Iterable[int]] = ...) -> None: ...

class IngestRequest(_message.Message):
    __slots__ = ("meta", "tensors", "end_of_epoch", "epoch")
    META_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    END_OF_EPOCH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    meta: SampleMeta
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    end_of_epoch: bool
    epoch: int
    def __init__(self, meta: _Optional[_Union[SampleMeta, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., end_of_epoch: _Optional[bool] = ..., epoch: _Optional[int] = ...) -> None: ...

class Quarantined(_message.Message):
    __slots__ = ("id", "reason")
    ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    id: int
    reason: str
    def __init__(self, id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class IngestReply(_message.Message):
    __slots__ = ("accepted", "quarantined")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    quarantined: _containers.RepeatedCompositeFieldContainer[Quarantined]
    def __init__(self, accepted: _Optional[int] = ..., quarantined: _Optional[_Iterable[_Union[Quarantined, _Mapping]]] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("start_step", "credits", "ack_step", "epoch", "rank", "group_rank", "group_size", "resize_from", "saved_step", "saved_epoch", "saved_durable")
    START_STEP_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    ACK_STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FROM_FIELD_NUMBER: _ClassVar[int]
    SAVED_STEP_FIELD_NUMBER: _ClassVar[int]
    SAVED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SAVED_DURABLE_FIELD_NUMBER: _ClassVar[int]
    start_step: int
    credits: int
    ack_step: int
    epoch: int
    rank: int
    group_rank: int
    group_size: int
    resize_from: int
    saved_step: int
    saved_epoch: int
    saved_durable: bool
    def __init__(self, start_step: _Optional[int] = ..., credits: _Optional[int] = ..., ack_step: _Optional[int] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., group_rank: _Optional[int] = ..., group_size: _Optional[int] = ..., resize_from: _Optional[int] = ..., saved_step: _Optional[int] = ..., saved_epoch: _Optional[int] = ..., saved_durable: _Optional[bool] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("info", "tensors", "sample_ids", "end_of_epoch")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    END_OF_EPOCH_FIELD_NUMBER: _ClassVar[int]
    info: StepInfo
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    sample_ids: _containers.RepeatedScalarFieldContainer[int]
    end_of_epoch: bool
    def __init__(self, info: _Optional[_Union[StepInfo, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., sample_ids: _Optional[_Iterable[int]] = ..., end_of_epoch: _Optional[bool] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("ids", "epoch", "rank")
    IDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    epoch: int
    rank: int
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class FetchReply(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[IngestRequest]
    def __init__(self, samples: _Optional[_Iterable[_Union[IngestRequest, _Mapping]]] = ...) -> None: ...

class RankStatusRequest(_message.Message):
    __slots__ = ("rank",)
    RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    def __init__(self, rank: _Optional[int] = ...) -> None: ...

class RankStatusReply(_message.Message):
    __slots__ = ("rank", "buffered", "ready", "next_step", "round", "state", "failure", "epoch", "epochs", "fetched_local", "fetched_remote", "job_samples", "max_tokens")
    RANK_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_LOCAL_FIELD_NUMBER: _ClassVar[int]
    FETCHED_REMOTE_FIELD_NUMBER: _ClassVar[int]
    JOB_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    buffered: int
    ready: int
    next_step: int
    round: int
    state: str
    failure: str
    epoch: int
    epochs: int
    fetched_local: int
    fetched_remote: int
    job_samples: int
    max_tokens: int
    def __init__(self, rank: _Optional[int] = ..., buffered: _Optional[int] = ..., ready: _Optional[int] = ..., next_step: _Optional[int] = ..., round: _Optional[int] = ..., state: _Optional[str] = ..., failure: _Optional[str] = ..., epoch: _Optional[int] = ..., epochs: _Optional[int] = ..., fetched_local: _Optional[int] = ..., fetched_remote: _Optional[int] = ..., job_samples: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...
