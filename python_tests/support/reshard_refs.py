"""Plain reference conversions (torch.cat / chunk), written from vLLM's and Megatron's loaders,
shared by the resharding tests."""

import torch

PAD = 64


def ref_vllm(sd, cfg, tp, t, prefix_experts="experts.routed_experts."):
    """vLLM's TP shard t of an HF state dict, written plainly from vLLM's weight loaders."""
    H = cfg.hidden_size
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or H // nq
    out = {}

    def vocab(w):
        V = w.shape[0]
        padded = torch.cat([w, w.new_zeros(-(-V // PAD) * PAD - V, H)])
        return padded.chunk(tp)[t]

    out["model.embed_tokens.weight"] = vocab(sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        for kind in ("weight", "bias"):
            if p + f"self_attn.q_proj.{kind}" not in sd:
                continue
            q, k, v = (sd[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
            if tp >= nkv:
                k, v = (x.reshape(nkv, d, *x.shape[1:])[t // (tp // nkv)] for x in (k, v))
            else:
                k, v = k.chunk(tp)[t], v.chunk(tp)[t]
            out[p + f"self_attn.qkv_proj.{kind}"] = torch.cat([q.chunk(tp)[t], k, v])
        out[p + "self_attn.o_proj.weight"] = sd[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[t]
        for n in ("self_attn.o_proj.bias", "self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            if p + n in sd:
                out[p + n] = sd[p + n]
        out[p + "post_attention_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        if p + "mlp.experts.gate_up_proj" in sd:
            block = p + ("block_sparse_moe." if cfg.model_type == "mixtral" else "mlp.")
            gu, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
            gate, up = gu.chunk(2, dim=1)
            out[block + "gate.weight"] = sd[p + "mlp.gate.weight"]
            out[block + prefix_experts + "w13_weight"] = torch.cat([gate.chunk(tp, dim=1)[t], up.chunk(tp, dim=1)[t]], 1)
            out[block + prefix_experts + "w2_weight"] = down.chunk(tp, dim=2)[t]
            mlps = ["mlp.shared_expert."] if p + "mlp.shared_expert.gate_proj.weight" in sd else []
            if mlps:
                out[p + "mlp.shared_expert_gate.weight"] = sd[p + "mlp.shared_expert_gate.weight"]
        else:
            mlps = ["mlp."]
        for m in mlps:
            out[p + m + "gate_up_proj.weight"] = torch.cat([sd[p + m + "gate_proj.weight"].chunk(tp)[t],
                                                            sd[p + m + "up_proj.weight"].chunk(tp)[t]])
            out[p + m + "down_proj.weight"] = sd[p + m + "down_proj.weight"].chunk(tp, dim=1)[t]
            if p + m + "gate_proj.bias" in sd:
                out[p + m + "gate_up_proj.bias"] = torch.cat([sd[p + m + "gate_proj.bias"].chunk(tp)[t],
                                                              sd[p + m + "up_proj.bias"].chunk(tp)[t]])
                out[p + m + "down_proj.bias"] = sd[p + m + "down_proj.bias"]
    out["model.norm.weight"] = sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = vocab(sd["lm_head.weight"])
    return out


def assert_same(got, want):
    assert list(got) == list(want) or sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))[:5]
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        assert torch.equal(g, w), name


def moe_checkpoint_names(sd, cfg):
    """transformers' on-disk naming of a MoE state dict (one tensor per expert), written plainly."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("mlp.experts.gate_up_proj")]
            mix = cfg.model_type == "mixtral"
            base = p + ("block_sparse_moe.experts." if mix else "mlp.experts.")
            g, u = ("w1", "w3") if mix else ("gate_proj", "up_proj")
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2)
                out[f"{base}{e}.{g}.weight"], out[f"{base}{e}.{u}.weight"] = gate, up
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("mlp.experts.down_proj")]
            mix = cfg.model_type == "mixtral"
            base = p + ("block_sparse_moe.experts." if mix else "mlp.experts.")
            for e in range(v.shape[0]):
                out[f"{base}{e}.{'w2' if mix else 'down_proj'}.weight"] = v[e]
        elif k.endswith("mlp.gate.weight") and cfg.model_type == "mixtral":
            out[k.replace("mlp.gate.", "block_sparse_moe.gate.")] = v
        else:
            out[k] = v
    return out


def pad_rows(w, rows):
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


def ref_megatron(sd, cfg, tp, pp, padded_vocab, te_norms=False):
    """Megatron-core's state dict of every (tp rank, pp stage) from an HF state dict."""
    H, nq, nkv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or H // nq
    L = cfg.num_hidden_layers
    shards = {}
    for p in range(pp):
        for t in range(tp):
            s = {}
            if p == 0:
                s["embedding.word_embeddings.weight"] = pad_rows(sd["model.embed_tokens.weight"], padded_vocab).chunk(tp)[t]
            for j in range(L // pp):
                hp, mp = f"model.layers.{p * (L // pp) + j}.", f"decoder.layers.{j}."
                moe = hp + "mlp.experts.gate_up_proj" in sd
                s[mp + ("self_attention.linear_qkv.layer_norm_weight" if te_norms else "input_layernorm.weight")] = \
                    sd[hp + "input_layernorm.weight"]
                post = "mlp.linear_fc1.layer_norm_weight" if te_norms and not moe else "pre_mlp_layernorm.weight"
                s[mp + post] = sd[hp + "post_attention_layernorm.weight"]
                for kind in ("weight", "bias"):
                    if hp + f"self_attn.q_proj.{kind}" not in sd:
                        continue
                    q, k, v = (sd[hp + f"self_attn.{x}_proj.{kind}"] for x in "qkv")
                    rest = q.shape[1:]
                    qkv = torch.cat([q.reshape(nkv, nq // nkv * d, *rest), k.reshape(nkv, d, *rest),
                                     v.reshape(nkv, d, *rest)], dim=1).reshape(-1, *rest)
                    s[mp + f"self_attention.linear_qkv.{kind}"] = qkv.chunk(tp)[t]
                s[mp + "self_attention.linear_proj.weight"] = sd[hp + "self_attn.o_proj.weight"].chunk(tp, dim=1)[t]
                if hp + "self_attn.q_norm.weight" in sd:
                    s[mp + "self_attention.q_layernorm.weight"] = sd[hp + "self_attn.q_norm.weight"]
                    s[mp + "self_attention.k_layernorm.weight"] = sd[hp + "self_attn.k_norm.weight"]
                mlps = []
                if moe:
                    s[mp + "mlp.router.weight"] = sd[hp + "mlp.gate.weight"]
                    gu, down = sd[hp + "mlp.experts.gate_up_proj"], sd[hp + "mlp.experts.down_proj"]
                    for e in range(gu.shape[0]):
                        gate, up = gu[e].chunk(2)
                        ep = f"{mp}mlp.experts.local_experts.{e}."
                        s[ep + "linear_fc1.weight"] = torch.cat([gate.chunk(tp)[t], up.chunk(tp)[t]])
                        s[ep + "linear_fc2.weight"] = down[e].chunk(tp, dim=1)[t]
                    if hp + "mlp.shared_expert.gate_proj.weight" in sd:
                        mlps.append(("mlp.shared_expert.", "mlp.shared_experts."))
                        s[mp + "mlp.shared_experts.gate_weight"] = sd[hp + "mlp.shared_expert_gate.weight"]
                else:
                    mlps.append(("mlp.", "mlp."))
                for h, m in mlps:
                    s[mp + m + "linear_fc1.weight"] = torch.cat([sd[hp + h + "gate_proj.weight"].chunk(tp)[t],
                                                                 sd[hp + h + "up_proj.weight"].chunk(tp)[t]])
                    s[mp + m + "linear_fc2.weight"] = sd[hp + h + "down_proj.weight"].chunk(tp, dim=1)[t]
            if p == pp - 1:
                s["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
                if not cfg.tie_word_embeddings:
                    s["output_layer.weight"] = pad_rows(sd["lm_head.weight"], padded_vocab).chunk(tp)[t]
            shards[(t, p)] = {k: v.contiguous() for k, v in s.items()}  # Megatron holds contiguous shards
    return shards


def plain_config(family, **overrides):
    """An HF-config-like object (no transformers needed: the GPU machine may not have it)."""
    from types import SimpleNamespace

    kw = dict(model_type=family, vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    if family in ("qwen2_moe", "qwen3_moe"):
        kw.update(num_experts=4, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])
    if family == "qwen2_moe":
        kw.update(shared_expert_intermediate_size=48)
    if family == "mixtral":
        kw.update(num_local_experts=4, intermediate_size=32)
    kw.update(overrides)
    return SimpleNamespace(**kw)


def random_state(spec, dtype=torch.float32, device="cpu", seed=0):
    """Random full tensors of every logical parameter of ``spec``."""
    from verl_fast.ops.reshard import logical_shapes

    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(dtype=dtype, device=device) for k, s in logical_shapes(spec).items()}
