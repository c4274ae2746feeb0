"""A megatron-core GPTModel on CPU (gloo), run by test_megatron_core.py under torch.multiprocessing.

Each rank builds its TP/PP shard (identical seeds), runs the forward pass (pipeline stages hand
the hidden states on with send/recv), saves the legacy ``mp_rank_*`` checkpoint and a
``torch_dist`` one, and the last stage's TP rank 0 writes the gathered logits. Three CUDA calls
megatron-core makes on the way are neutralised, here in test code only (PLATFORM.md), and the router's missing
Transformer Engine GEMM is set to None.
"""

import contextlib
import os

import torch
import torch.distributed as dist

HIDDEN, HEADS, GROUPS, FFN, LAYERS, VOCAB_PADDED, SEQ = 64, 4, 2, 96, 4, 256, 12


class CudaOnCpu(torch.overrides.TorchFunctionMode):
    """Tensors megatron-core's DDP, optimizer and schedules ask for on ``device="cuda"`` are made on
    the CPU, ``.cuda()`` is the identity, and ``Tensor.type()`` answers as for a CUDA tensor (its
    gradient-clipping asserts it). Test code only: the library never asks for this."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and (isinstance(device, int) or torch.device(device).type == "cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.")
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def neutralise_cuda_for_training():
    """What megatron-core training (DDP, distributed optimizer, pipeline schedules) needs on CPU."""
    _neutralise_cuda()
    CudaOnCpu().__enter__()  # for the rest of this (spawned) process


def _neutralise_cuda():
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = contextlib.contextmanager(lambda self, name=None: (yield))
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16 refers to Transformer Engine's GEMM in the router without TE installed.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build(tp, pp, moe):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe_kw = dict(num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_shared_expert_intermediate_size=48,
                  moe_shared_expert_gate=True, moe_router_pre_softmax=True, moe_token_dispatcher_type="allgather",
                  moe_router_load_balancing_type="none") if moe else {}
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS, ffn_hidden_size=FFN,
        kv_channels=HIDDEN // HEADS, use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=1e-6,
        add_bias_linear=False, add_qkv_bias=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, init_method_std=0.05, **moe_kw)
    spec = get_gpt_layer_local_spec(num_experts=4 if moe else None, normalization="RMSNorm")
    torch.manual_seed(1234)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB_PADDED, max_sequence_length=64,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, position_embedding_type="rope", rotary_base=10000)
    with torch.no_grad():  # norms away from 1 so that a misplaced norm shows in the logits
        for name, p in model.named_parameters():
            if "layernorm" in name or "norm.weight" in name:
                p.normal_(1.0, 0.2)
    return model.eval()


def forward(model, tokens):
    from megatron.core import parallel_state as ps

    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(s, b, HIDDEN)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    with torch.no_grad():
        out = model(tokens, positions, mask)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.contiguous(), group=group)
    return torch.cat(parts, dim=-1)  # [b, s, padded vocab]


def worker(rank, world, port, tp, pp, moe, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _neutralise_cuda()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tp, pp)
    model = build(tp, pp, moe)
    torch.manual_seed(7)
    tokens = torch.randint(0, 250, (2, SEQ))
    logits = forward(model, tokens)
    t, p = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    shard = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
    legacy = os.path.join(out_dir, "legacy", "iter_0000001", shard)
    os.makedirs(legacy, exist_ok=True)
    torch.save({"model": model.state_dict(), "checkpoint_version": 3.0, "iteration": 1},
               os.path.join(legacy, "model_optim_rng.pt"))
    if rank == 0:
        with open(os.path.join(out_dir, "legacy", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    dist_dir = os.path.join(out_dir, "torch_dist")
    os.makedirs(dist_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), dist_dir)
    if logits is not None and t == 0:
        torch.save({"tokens": tokens, "logits": logits}, os.path.join(out_dir, "logits.pt"))
    dist.barrier()
    dist.destroy_process_group()
