#!/usr/bin/env python3
"""Golden fixtures for forge's Gemma 2 and Gemma 3 (text) from Hugging Face transformers' own
Gemma2ForCausalLM and Gemma3ForCausalLM (not twins).

    OMP_NUM_THREADS=1 /tmp/venv/bin/python tests/reference/gemma_golden.py           # every fixture
    OMP_NUM_THREADS=1 /tmp/venv/bin/python tests/reference/gemma_golden.py --check   # fp32 vs float64

The procedure and the file format are qwen2_golden.py's (its generate() and check()), with eight AdamW steps
instead of three. What the fixtures exercise:

- both: RMSNorms scaling by 1 + w (weights initialised 0.1 * normal, so the scale is near one), embeddings
  times sqrt(hidden_size), the GeGLU MLP (gelu_pytorch_tanh), the four norms of each layer (input,
  post-attention, pre- and post-feed-forward), attention scaled by query_pre_attn_scalar^-1/2 with a
  query_pre_attn_scalar (4) that is not head_dim, tied embeddings, and layer_types mixing sliding-window
  (window 5, sequences of 12 and 16) and full layers;
- Gemma 2: attention and final logit soft-capping, with caps small enough to bend most scores and logits
  (the weights are drawn at 0.1 rather than 0.02 for the same reason);
- Gemma 3: QK-norm (1 + w too), a RoPE base of its own for the sliding layers (rope_parameters'
  sliding_attention) and linear RoPE scaling on the full layers.

`--check` also reports how much the generation's own options move the float64 logits (soft-capping removed,
resp. the sliding layers' RoPE made the full layers'): they must matter.
"""

import os
import sys

import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen2_golden  # noqa: E402  (the procedure: generate, check, AdamW run, file format)
from families_golden import builder  # noqa: E402  (the HF model of a config dict, eager attention)
from qwen2_golden import load, logits_of  # noqa: E402

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=88,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_dropout=0.0,
    attention_bias=False,
    query_pre_attn_scalar=4,
    sliding_window=5,
    # Gemma's configs name pad token 0, which transformers makes the embedding's padding_idx: lookups of it
    # give that row no gradient. forge has no padding row (the row learns from its lookups, as in a LLaMA);
    # the fixtures leave the pad token out so that the gradients compare.
    pad_token_id=None,
)

KEYS = [
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_activation", "max_position_embeddings",
    "rms_norm_eps", "tie_word_embeddings", "attention_dropout", "attention_bias", "query_pre_attn_scalar",
    "sliding_window", "layer_types", "attn_logit_softcapping", "final_logit_softcapping", "rope_parameters",
]


def config_json(config):
    """The architecture keys of config.to_dict(), as save_pretrained would write them."""
    full = config.to_dict()
    return {key: full[key] for key in KEYS if key in full}


def init_parameters(net, generator):
    """normal(0, 0.1) for matrices, 0.1 * normal for every norm weight (a scale of 1 + w near one)."""
    params = {}
    for name, p in net.named_parameters():
        noise = torch.randn(tuple(p.shape), generator=generator, dtype=torch.float32)
        params[name] = 0.1 * noise
    return params


def variant_effect(changes):
    """How far the float64 logits move with the config changed by `changes` (and the weights kept)."""
    def effect(spec, initial, input_ids, ref, ref_logits):
        family = FAMILIES[type(ref).__name__]
        net = family["build"](dict(spec["model"], **changes(spec["model"])), torch.float64)
        load(net, initial)
        with torch.no_grad():
            return float((logits_of(net, input_ids) - ref_logits).abs().max())
    return effect


def no_softcap(model):
    return dict(attn_logit_softcapping=None, final_logit_softcapping=None)


def one_rope(model):
    full = model["rope_parameters"]["full_attention"]
    return dict(rope_parameters=dict(full_attention=dict(full), sliding_attention=dict(full)))


NOTES = dict(
    weight_decay_applies_to="2-D weights (matrices, embeddings); 1-D weights (every norm) get 0",
    init="matrices normal(0, 0.1); norm weights 0.1*normal (scale 1 + w)",
    generator="tests/reference/gemma_golden.py",
    init_parameters=init_parameters,
    adamw_steps=8,
)
GEMMA2 = dict(
    NOTES,
    build=builder(Gemma2Config, Gemma2ForCausalLM),
    config_json=config_json,
    option="soft-capping",
    option_effect=variant_effect(no_softcap),
    model_class="transformers.Gemma2ForCausalLM (attn_implementation=eager, float32)",
)
GEMMA3 = dict(
    NOTES,
    build=builder(Gemma3TextConfig, Gemma3ForCausalLM),
    config_json=config_json,
    option="the local RoPE base",
    option_effect=variant_effect(one_rope),
    model_class="transformers.Gemma3ForCausalLM (attn_implementation=eager, float32)",
)
FAMILIES = {"Gemma2ForCausalLM": GEMMA2, "Gemma3ForCausalLM": GEMMA3}

CONFIGS = {
    "gemma2_tiny": (GEMMA2, dict(model=dict(COMMON, attn_logit_softcapping=1.0, final_logit_softcapping=1.5,
                                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                            rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
                                 batch=2, seq=12, seed=1)),
    "gemma3_tiny": (GEMMA3, dict(model=dict(COMMON, num_key_value_heads=1, head_dim=12,
                                            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                            rope_parameters=dict(
                                                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                                                sliding_attention=dict(rope_type="default", rope_theta=100.0))),
                                 batch=2, seq=16, seed=1)),
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
