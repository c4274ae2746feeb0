"""Typed stub of the compiled core (csrc/bindings.cpp and each area's bindings.cpp; a test checks that
the records' fields here match the module's). Tensors are torch.Tensor objects read by
pointer, shape, strides, dtype and device; the op wrappers in verl_fast.ops are the public API."""

from typing import List, Optional, Sequence, Tuple

import torch

__version__: str
has_cuda: bool
cuda_archs: str  # e.g. "80,90"; "" without CUDA

class DType:  # codes of the planner's tables, named as torch names its dtypes
    float32: "DType"
    float64: "DType"
    bfloat16: "DType"
    float16: "DType"
    int64: "DType"
    int32: "DType"
    uint8: "DType"
    bool: "DType"
    __members__: dict

# ---- advantage engine ----
status_words: int  # int32 words of the status record

class AdvantageStatus(int):  # bits of the status record's word 0
    bad_rewards: "AdvantageStatus"
    bad_values: "AdvantageStatus"
    too_few_to_whiten: "AdvantageStatus"
    bad_mask: "AdvantageStatus"

class ScanKind:
    gae: "ScanKind"
    reinforce_pp: "ScanKind"
    remax: "ScanKind"

class GroupKind:
    grpo: "GroupKind"
    rloo: "GroupKind"
    reinforce_pp_baseline: "GroupKind"

class ScanArgs:
    kind: ScanKind
    rewards: torch.Tensor
    values: torch.Tensor
    baselines: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    status: torch.Tensor
    host_status: torch.Tensor  # optional: int32 [1] on the CPU (pinned for CUDA); word 0 is copied there
    gamma: float
    lam: float
    whiten: bool
    num_threads: int
    stream: Optional[torch.cuda.Stream]  # None: the default stream; never a bare handle
    def __init__(self) -> None: ...

class GroupArgs:
    kind: GroupKind
    rewards: torch.Tensor
    mask: torch.Tensor
    ids: torch.Tensor
    advantages: torch.Tensor
    workspace: torch.Tensor
    status: torch.Tensor
    host_status: torch.Tensor  # optional: int32 [1] on the CPU (pinned for CUDA); word 0 is copied there
    epsilon: float
    norm_by_std: bool
    whiten: bool
    num_threads: int
    stream: Optional[torch.cuda.Stream]  # None: the default stream; never a bare handle
    def __init__(self) -> None: ...

def group_workspace_bytes(batch: int) -> int: ...
def advantage_scan(args: ScanArgs) -> None: ...
def group_advantage(args: GroupArgs) -> None: ...

# ---- schedule ----
def balance_partitions(lengths: torch.Tensor, k: int, equal_size: bool, linear: int, quadratic: int,
                       order: torch.Tensor, offsets: torch.Tensor, costs: torch.Tensor) -> None: ...
def pack_micro_batches(lengths: torch.Tensor, max_tokens: int, min_count: int, padded: bool,
                       order: torch.Tensor, offsets: torch.Tensor) -> int: ...
def rollout_buckets(prompt_lens: torch.Tensor, max_new_tokens: torch.Tensor, max_num_seqs: int,
                    max_batch_tokens: int, max_model_len: int, max_length_ratio: float, order: torch.Tensor,
                    offsets: torch.Tensor, wave_max_tokens: torch.Tensor) -> int: ...

# ---- resharding engine ----
reshard_piece_cols: int  # columns of the piece tables (order: csrc/reshard/reshard.h PieceCol)
reshard_tensor_cols: int  # columns of the tensor tables (TensorCol)

class ReshardPhase:
    pack: "ReshardPhase"
    copy: "ReshardPhase"  # copy_local then copy_received
    copy_local: "ReshardPhase"
    copy_received: "ReshardPhase"

class ReshardPlanArgs:
    logical_shapes: torch.Tensor
    logical_names: List[str]
    src_tensors: torch.Tensor
    src_pieces: torch.Tensor
    dst_tensors: torch.Tensor
    dst_pieces: torch.Tensor
    src_names: List[str]
    dst_names: List[str]
    rank: int
    world_size: int
    bucket_bytes: int
    tile_bytes: int
    def __init__(self) -> None: ...

class ReshardPlan:
    rank: int
    world_size: int
    num_buckets: int
    local_sources: List[int]
    local_destinations: List[int]
    max_send_bytes: int
    max_recv_bytes: int
    local_bytes: int
    received_bytes: int
    zero_bytes: int
    num_segments: int
    num_tiles: int
    def __init__(self, args: ReshardPlanArgs) -> None: ...
    def sends(self, bucket: int) -> List[Tuple[int, int, int]]: ...
    def recvs(self, bucket: int) -> List[Tuple[int, int, int]]: ...
    def groups(self, bucket: int) -> List[int]: ...
    def bind(self, sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor],
             send_slots: Sequence[torch.Tensor], recv_slots: Sequence[torch.Tensor]) -> None: ...
    def bind_destinations_in(self, buffer: torch.Tensor, offsets: Sequence[int]) -> None: ...
    def is_bound(self, sources: List[torch.Tensor], destinations: List[torch.Tensor],
                 check_memory: bool = True) -> bool: ...
    def sources_bound(self, sources: List[torch.Tensor]) -> bool: ...
    def run(self, bucket: int, phase: ReshardPhase, stream: Optional[torch.cuda.Stream] = None,
            num_threads: int = 0) -> None: ...

def fp8_quantize(src: torch.Tensor, dst: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int,
                 stream: Optional[torch.cuda.Stream] = None, num_threads: int = 0) -> None: ...
def fp8_quantize_many(srcs: List[torch.Tensor], dsts: List[torch.Tensor], scales: List[torch.Tensor], block_rows: int,
                      block_cols: int, stream: Optional[torch.cuda.Stream] = None, num_threads: int = 0) -> None: ...
