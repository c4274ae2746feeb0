"""The resharding engine: training layouts (HF, FSDP1/2, Megatron-core) to vLLM's layout, planned
in C++ once per rank and executed every step with only the bytes each rank needs."""

from verl_fast.ops.reshard.api import model_spec, plan, reshard, source_layout, vllm_weights
from verl_fast.ops.reshard.fsdp import (dtensor_layout, fsdp1_layout, fsdp1_layout_from_module, fsdp1_sources,
                                       fsdp2_layout)
from verl_fast.ops.reshard.hf import hf_layout
from verl_fast.ops.reshard.layout import Layout, PhysTensor, Piece
from verl_fast.ops.reshard.plan import ReshardPlan
from verl_fast.ops.reshard.spec import ModelSpec, logical_shapes
from verl_fast.ops.reshard.vllm import vllm_layout, vllm_names
