#!/usr/bin/env python3
"""Golden fixtures for forge's Qwen3, Mistral, StarCoder2, Mixtral and Qwen3-MoE from Hugging Face
transformers' own Qwen3ForCausalLM, MistralForCausalLM, Starcoder2ForCausalLM, MixtralForCausalLM and
Qwen3MoeForCausalLM (not twins).

    OMP_NUM_THREADS=1 /tmp/venv/bin/python tests/reference/families_golden.py           # every fixture
    OMP_NUM_THREADS=1 /tmp/venv/bin/python tests/reference/families_golden.py --check   # fp32 vs float64

The procedure, the file format and the AdamW run are qwen2_golden.py's (and so llama_twin.py's), whose
generate() and check() this script calls with each family's model, config keys and notes. What each family
adds shows in its fixtures:

- Qwen3: QK-norm (`self_attn.q_norm.weight`, `k_norm.weight`, an RMSNorm over head_dim applied per head to
  q and k before RoPE; initialised 1 + 0.1 * normal like every 1-D weight), no biases, and a head_dim (12)
  that is not hidden_size / num_attention_heads (8).
- Mistral: `sliding_window` 5 against sequences of 12 and 16 (a query at position i sees keys j with
  i - 5 < j <= i, transformers' masking_utils.sliding_window_overlay), and one config without a window.
- StarCoder2: LayerNorms with biases (`norm_epsilon`), the ungated MLP `c_proj(gelu_tanh(c_fc(x)))`, and
  with `use_bias` biases on q, k, v, o, c_fc and c_proj (every bias initialised 0.1 * normal, every 1-D
  weight 1 + 0.1 * normal); one config with biases and full attention, one tied, without biases and with a
  window of 5.

- Mixtral: every layer's feed-forward a sparse mixture of 4 SwiGLU experts, the router's softmax top-2
  renormalised; transformers 5 fuses the experts into `mlp.experts.gate_up_proj` [experts, 2 x ffn, hidden]
  (gate rows first) and `mlp.experts.down_proj`, which the fixtures store under the released checkpoints'
  names (`block_sparse_moe.gate.weight`, `block_sparse_moe.experts.<e>.w1`, `w3`, `w2`), as transformers'
  own conversion mapping reads them. One config with a window of 5, one tied without.
- Qwen3-MoE: Qwen3's QK-norm with MoE feed-forwards of 4 experts (top-2 of a softmax), stored like
  Mixtral's under the released names (`mlp.experts.<e>.gate_proj`, `up_proj`, `down_proj`); one config with
  layer 0 dense (`mlp_only_layers`) and the top-2 weights as the softmax gives them, one tied with
  `norm_topk_prob`.
- Mixtral and Qwen3-MoE with output_router_logits (`*_aux`): the loss adds router_aux_loss_coef times the
  load-balancing loss transformers computes over every layer's router logits at once (its aux_loss, also
  stored as `router_aux_loss`); the gradients and the AdamW run follow that loss.

`--check` also reports how much the family's own option moves the float64 logits (QK-norm weights set to
one, the window removed, resp. every bias zeroed): it must matter.
"""

import os
import sys

import torch
from transformers import (MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, Starcoder2Config,
                          Starcoder2ForCausalLM)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen2_golden  # noqa: E402  (the procedure: generate, check, AdamW run, file format)
from qwen2_golden import bias_effect, load, logits_of  # noqa: E402

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=88,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_dropout=0.0,
)

BASE_KEYS = [
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "tie_word_embeddings", "attention_dropout",
]


def builder(config_class, model_class, **implementations):
    """build(model, dtype): the HF model of the config dict `model`, eager attention, as qwen2_golden's."""
    def build(model, dtype=torch.float32):
        config = config_class(architectures=[model_class.__name__], attn_implementation="eager",
                              **implementations, **model)
        torch.manual_seed(0)  # transformers' own init draws from the global generator; overwritten anyway
        net = model_class(config).to(dtype)
        net.eval()
        assert net.config._attn_implementation == "eager", net.config._attn_implementation
        if model["tie_word_embeddings"]:
            assert net.lm_head.weight is net.model.embed_tokens.weight
        return net
    return build


def config_writer(keys, base=None):
    """The architecture keys of config.to_dict(), as save_pretrained would write them."""
    def config_json(config):
        full = config.to_dict()
        out = {}
        for key in (BASE_KEYS if base is None else base) + keys:
            if key in full:
                out[key] = full[key]
            elif key == "rope_theta":  # transformers 5 keeps it inside rope_parameters
                out[key] = full["rope_parameters"]["rope_theta"]
            else:
                raise KeyError(f"to_dict() has no {key!r}")
        return out
    return config_json


def qk_norm_effect(spec, initial, input_ids, ref, ref_logits):
    """How far the float64 logits move with the QK-norm weights at one."""
    ones = {n: (torch.ones_like(t) if "self_attn" in n and "_norm." in n else t) for n, t in initial.items()}
    load(ref, ones)
    with torch.no_grad():
        return float((logits_of(ref, input_ids) - ref_logits).abs().max())


def window_effect(spec, initial, input_ids, ref, ref_logits):
    """How far the float64 logits move without the window (None: the config has none)."""
    if spec["model"]["sliding_window"] is None:
        return None
    net = MISTRAL["build"](dict(spec["model"], sliding_window=None), torch.float64)
    load(net, initial)
    with torch.no_grad():
        return float((logits_of(net, input_ids) - ref_logits).abs().max())


NOTES = dict(
    weight_decay_applies_to="2-D weights (matrices, embeddings); 1-D weights (norms, QK-norms) get 0",
    init="matrices normal(0, 0.02); 1-D weights 1 + 0.1*normal",
    generator="tests/reference/families_golden.py",
    adamw_steps=8,
)
QWEN3 = dict(
    NOTES,
    build=builder(Qwen3Config, Qwen3ForCausalLM),
    config_json=config_writer(["attention_bias", "head_dim", "use_sliding_window", "sliding_window",
                               "max_window_layers"]),
    option="QK-norm",
    option_effect=qk_norm_effect,
    model_class="transformers.Qwen3ForCausalLM (attn_implementation=eager, float32)",
)
MISTRAL = dict(
    NOTES,
    build=builder(MistralConfig, MistralForCausalLM),
    config_json=config_writer(["head_dim", "sliding_window"]),
    option="the window",
    option_effect=window_effect,
    model_class="transformers.MistralForCausalLM (attn_implementation=eager, float32)",
)

def mixtral_checkpoint_names(tensors):
    """The module's fused experts split into the released checkpoints' per-expert tensors."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            p = name[: -len("mlp.experts.gate_up_proj")] + "block_sparse_moe.experts."
            ffn = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}{e}.w1.weight"] = t[e, :ffn].clone()
                out[f"{p}{e}.w3.weight"] = t[e, ffn:].clone()
        elif name.endswith(".mlp.experts.down_proj"):
            p = name[: -len("mlp.experts.down_proj")] + "block_sparse_moe.experts."
            for e in range(t.shape[0]):
                out[f"{p}{e}.w2.weight"] = t[e].clone()
        elif ".mlp.gate." in name:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t
        else:
            out[name] = t
    return out


def qwen3_moe_checkpoint_names(tensors):
    """The module's fused experts split into the released checkpoints' per-expert tensors."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            ffn = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = t[e, :ffn].clone()
                out[f"{p}{e}.up_proj.weight"] = t[e, ffn:].clone()
        elif name.endswith(".mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def routing_effect(spec, initial, input_ids, ref, ref_logits):
    """How far the float64 logits move when every token takes every expert (renormalised)."""
    model = spec["model"]
    experts = model.get("num_local_experts", model.get("num_experts"))
    family = MIXTRAL if "num_local_experts" in model else QWEN3_MOE
    net = family["build"](dict(model, num_experts_per_tok=experts, norm_topk_prob=True)
                          if family is QWEN3_MOE else dict(model, num_experts_per_tok=experts), torch.float64)
    load(net, initial)
    with torch.no_grad():
        return float((logits_of(net, input_ids) - ref_logits).abs().max())


MIXTRAL = dict(
    NOTES,
    # The experts one by one (the grouped-GEMM path takes no float64, which --check and the seed check use).
    build=builder(MixtralConfig, MixtralForCausalLM, experts_implementation="eager"),
    config_json=config_writer(["head_dim", "sliding_window", "num_local_experts", "num_experts_per_tok",
                               "output_router_logits", "router_aux_loss_coef", "router_jitter_noise"]),
    option="top-2 routing",
    option_effect=routing_effect,
    checkpoint_names=mixtral_checkpoint_names,
    model_class="transformers.MixtralForCausalLM (attn_implementation=eager, float32; experts stored under "
                "the released checkpoints' names)",
)
MIXTRAL_COMMON = dict(COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                      output_router_logits=False, router_aux_loss_coef=0.001, router_jitter_noise=0.0)

QWEN3_MOE = dict(
    NOTES,
    build=builder(Qwen3MoeConfig, Qwen3MoeForCausalLM, experts_implementation="eager"),
    # transformers 5 writes num_experts as num_local_experts (its attribute map); released configs say
    # num_experts: forge reads either.
    config_json=config_writer(["attention_bias", "head_dim", "use_sliding_window", "sliding_window",
                               "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                               "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "output_router_logits",
                               "router_aux_loss_coef"]),
    option="top-2 routing",
    option_effect=routing_effect,
    checkpoint_names=qwen3_moe_checkpoint_names,
    model_class="transformers.Qwen3MoeForCausalLM (attn_implementation=eager, float32; experts stored under "
                "the released checkpoints' names)",
)
QWEN3_MOE_COMMON = dict(COMMON, head_dim=12, rope_theta=10000.0, attention_bias=False, use_sliding_window=False,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
                        output_router_logits=False, router_aux_loss_coef=0.001)

STARCODER2_KEYS = [
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings", "norm_epsilon",
    "rope_theta", "tie_word_embeddings", "use_bias", "sliding_window", "attention_dropout",
    "residual_dropout", "embedding_dropout",
]
STARCODER2 = dict(
    NOTES,
    build=builder(Starcoder2Config, Starcoder2ForCausalLM),
    config_json=config_writer([], STARCODER2_KEYS),
    option="the biases",
    option_effect=bias_effect,
    weight_decay_applies_to="2-D weights (matrices, embeddings); 1-D weights (LayerNorms, biases) get 0",
    init="matrices normal(0, 0.02); biases 0.1*normal; other 1-D weights 1 + 0.1*normal",
    model_class="transformers.Starcoder2ForCausalLM (attn_implementation=eager, float32)",
)
STARCODER2_COMMON = dict(
    {k: v for k, v in COMMON.items() if k != "rms_norm_eps"},
    hidden_act="gelu_pytorch_tanh",
    norm_epsilon=1e-5,
    rope_theta=10000.0,
    use_bias=True,
    sliding_window=None,
    residual_dropout=0.0,
    embedding_dropout=0.0,
)

# Seeds: the first small ones whose AdamW run is well conditioned (qwen2_golden's float64 replay).
CONFIGS = {
    "qwen3_tiny": (QWEN3, dict(model=dict(COMMON, head_dim=12, rope_theta=10000.0, attention_bias=False,
                                          use_sliding_window=False), batch=2, seq=12, seed=1)),
    "qwen3_tiny_tied": (QWEN3, dict(model=dict(COMMON, head_dim=8, num_key_value_heads=1, tie_word_embeddings=True,
                                               rope_theta=1e6, attention_bias=False, use_sliding_window=False),
                                    batch=2, seq=16, seed=1)),
    "mistral_tiny_window": (MISTRAL, dict(model=dict(COMMON, sliding_window=5, rope_theta=10000.0), batch=2,
                                          seq=12, seed=3)),
    "mistral_tiny": (MISTRAL, dict(model=dict(COMMON, num_key_value_heads=1, head_dim=12, sliding_window=None,
                                              rope_theta=1e6), batch=2, seq=16, seed=6)),
    "starcoder2_tiny": (STARCODER2, dict(model=dict(STARCODER2_COMMON), batch=2, seq=12, seed=5)),
    "starcoder2_tiny_tied_window": (STARCODER2, dict(
        model=dict(STARCODER2_COMMON, num_key_value_heads=1, tie_word_embeddings=True, use_bias=False,
                   sliding_window=5, rope_theta=1e5), batch=2, seq=16, seed=5)),
    "mixtral_tiny_window": (MIXTRAL, dict(model=dict(MIXTRAL_COMMON, sliding_window=5, rope_theta=1e6), batch=2,
                                          seq=12, seed=2)),
    "qwen3_moe_tiny": (QWEN3_MOE, dict(model=dict(QWEN3_MOE_COMMON, mlp_only_layers=[0], norm_topk_prob=False),
                                       batch=2, seq=12, seed=2)),
    "qwen3_moe_tiny_tied": (QWEN3_MOE, dict(model=dict(QWEN3_MOE_COMMON, mlp_only_layers=[], norm_topk_prob=True,
                                                       num_key_value_heads=1, tie_word_embeddings=True,
                                                       rope_theta=1e6), batch=2, seq=16, seed=1)),
    "mixtral_tiny_tied": (MIXTRAL, dict(model=dict(MIXTRAL_COMMON, num_key_value_heads=1, head_dim=12,
                                                   tie_word_embeddings=True, sliding_window=None,
                                                   rope_theta=10000.0), batch=2, seq=16, seed=1)),
    # Hugging Face's load-balancing loss (output_router_logits) with a coefficient large enough to move every
    # router gradient: over Mixtral's two MoE layers, and over Qwen3-MoE's two of three (layer 1 dense).
    "mixtral_tiny_aux": (MIXTRAL, dict(model=dict(MIXTRAL_COMMON, sliding_window=None, rope_theta=1e6,
                                                  output_router_logits=True, router_aux_loss_coef=0.3),
                                       batch=2, seq=12, seed=1)),
    "qwen3_moe_tiny_aux": (QWEN3_MOE, dict(model=dict(QWEN3_MOE_COMMON, num_hidden_layers=3, mlp_only_layers=[1],
                                                      norm_topk_prob=True, output_router_logits=True,
                                                      router_aux_loss_coef=0.1),
                                           batch=2, seq=12, seed=1)),
}


def main():
    assert sys.byteorder == "little", "safetensors data is little-endian"
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    args = sys.argv[1:]
    if args[:1] == ["--check"]:
        results = [qwen2_golden.check(name, CONFIGS[name][1], CONFIGS[name][0]) for name in (args[1:] or CONFIGS)]
        sys.exit(0 if all(results) else 1)
    for name in args or CONFIGS:
        family, spec = CONFIGS[name]
        qwen2_golden.generate(name, spec, family)


if __name__ == "__main__":
    main()
