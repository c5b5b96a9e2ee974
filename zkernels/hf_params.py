"""Parameters of a Hugging Face decoder from its ``config.json``, for ``python -m zkernels plan``.

Two ways, the first that works: build the model from the config with ``transformers`` on the
``meta`` device (no weights, no memory, nothing downloaded) and count its parameters, which is
exact for every architecture ``transformers`` knows; else the closed formula of
:func:`params_from_hf_config`, checked against ``transformers`` for the families in
``CHECKED_MODEL_TYPES`` (tests/test_cli.py) and approximate for others.

[Note: counting from config.json]
Ψ = V·h·(1 if tied else 2) + P·h (learned positions) + L·(attention + MLP + norms) + final norm,
with V vocab, h hidden size, L layers, d = head_dim (h / heads unless given), q = heads·d,
k = kv_heads·d:
    attention  h·q + 2·h·k + q·h, + biases (GPT-2: q + 2k + h; Qwen2: q + 2k; llama family:
               q + 2k + h when ``attention_bias``), + per-head q/k norms (Qwen3, Gemma 3: 2d;
               OLMo 2: q + k; Cohere with ``use_qk_norm``: q + k)
    MLP        m·h·I (m = 3 for gated, SiLU-style MLPs, else 2), + biases (GPT-2: I + h; llama
               family with ``mlp_bias``: 2I + h); MoE: E experts of width I_e and a router h·E
               (Qwen2-MoE also a shared expert 3·h·I_s and its gate h; its layers in
               ``mlp_only_layers``, and all but every ``decoder_sparse_step``-th, are dense)
    norms      n·h per layer (n = 2; Gemma 2/3: 4; Cohere: 1; OLMo: 0, its LayerNorm has no
               weights), doubled for LayerNorms with a bias (GPT-2), and one more at the end.
Config keys a ``config.json`` leaves out take ``transformers``' defaults for that model type
(``tie_word_embeddings`` in particular: True for GPT-2 and Gemma, False for Llama).
"""
from __future__ import annotations

from typing import Optional, Tuple

_GATED = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "gemma", "gemma2",
          "gemma3_text", "phi3", "olmo", "olmo2", "granite", "cohere"}
# Model types whose count below equals transformers' model built from the same config.
CHECKED_MODEL_TYPES = ("gpt2",) + tuple(sorted(_GATED))
_TIED_DEFAULT = {"gpt2": True, "gemma": True, "gemma2": True, "gemma3_text": True,
                 "cohere": True}
_NORMS_PER_LAYER = {"gemma2": 4, "gemma3_text": 4, "cohere": 1, "olmo": 0}


def params_from_hf_config(cfg: dict) -> int:
    """Ψ of the decoder ``cfg`` describes (a parsed ``config.json``); see [Note: counting from
    config.json]. Raises ValueError when a size the count needs is missing."""
    return _formula(cfg)[0]


def gathered_from_hf_config(cfg: dict, num_params: int) -> int:
    """Parameters stage 3 gathers at once for the decoder ``cfg`` describes, ``num_params`` in
    all: the root unit (embeddings, head, final norm: everything outside the layers) plus two
    of the largest layer, as ``unit_plan.gathered_peak_numel`` counts a module's units."""
    _, layers, largest = _formula(cfg)
    return num_params - layers + 2 * largest


def largest_unit_from_hf_config(cfg: dict, num_params: int) -> int:
    """Parameters of stage 3's largest unit for the decoder ``cfg`` describes: the root unit
    (everything outside the layers) or the largest layer, whichever is larger."""
    _, layers, largest = _formula(cfg)
    return max(num_params - layers, largest)


def _formula(cfg: dict) -> Tuple[int, int, int]:
    """(Ψ, parameters of all layers, of the largest layer) by [Note: counting from
    config.json]."""
    def get(*keys, default=None):
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise ValueError(f"config.json has none of {keys}: cannot count parameters")
        return default

    kind = str(cfg.get("model_type", ""))
    h = int(get("hidden_size", "n_embd", "d_model"))
    num_layers = int(get("num_hidden_layers", "n_layer", "num_layers"))
    vocab = int(get("vocab_size"))
    heads = int(get("num_attention_heads", "n_head", default=1))
    kv_heads = int(get("num_key_value_heads", default=heads))
    d = int(get("head_dim", default=h // heads))
    q, k = heads * d, kv_heads * d
    inter = int(get("intermediate_size", "n_inner", "ffn_dim", default=4 * h))
    gated = kind in _GATED or cfg.get("hidden_act") in ("silu", "swiglu")
    tied = bool(cfg.get("tie_word_embeddings", _TIED_DEFAULT.get(kind, True)))
    rotary = kind in _GATED or any(key in cfg for key in ("rope_theta", "rotary_dim",
                                                          "rope_parameters"))
    positions = 0 if rotary else int(get("n_positions", "max_position_embeddings", default=0))

    attn = 2 * h * q + 2 * h * k
    if kind == "gpt2":
        attn += q + 2 * k + h
    elif kind in ("qwen2", "qwen2_moe"):
        attn += q + 2 * k
    elif cfg.get("attention_bias"):
        attn += q + 2 * k + h
    if kind in ("qwen3", "gemma3_text"):
        attn += 2 * d
    elif kind == "olmo2" or (kind == "cohere" and cfg.get("use_qk_norm")):
        attn += q + k

    m = 3 if gated else 2
    mlp_bias = (inter + h) if kind == "gpt2" else (2 * inter + h) if cfg.get("mlp_bias") else 0
    experts = int(get("num_local_experts", "num_experts", default=1))
    moe = 0
    if experts > 1:
        expert_inter = int(get("moe_intermediate_size", default=inter))
        moe = experts * m * h * expert_inter + h * experts
        if kind == "qwen2_moe":
            moe += 3 * h * int(get("shared_expert_intermediate_size")) + h
    dense = m * h * inter + mlp_bias
    # Qwen2-MoE: layers in mlp_only_layers, and all but every decoder_sparse_step-th, are dense.
    dense_only = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    num_moe = 0 if experts <= 1 else sum(
        1 for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)

    norm = 2 * h if kind == "gpt2" else h          # LayerNorm weight + bias, or RMSNorm weight
    per_layer = attn + _NORMS_PER_LAYER.get(kind, 2) * norm
    final_norm = 0 if kind == "olmo" else norm
    layers = num_layers * per_layer + num_moe * moe + (num_layers - num_moe) * dense
    largest = per_layer + max(moe if num_moe else 0, dense if num_moe < num_layers else 0)
    return vocab * h * (1 if tied else 2) + positions * h + layers + final_norm, layers, largest


def params_from_transformers(cfg: dict) -> Tuple[Optional[int], str]:
    """(Ψ, how) from ``transformers``' own model for ``cfg``, built on the meta device; (None,
    why not) when transformers is missing or does not know the architecture."""
    try:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None, "transformers is not installed"
    kind = cfg.get("model_type")
    if not kind:
        return None, "config.json has no model_type"
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its config checks are not this tool's business
    try:
        extra = {key: v for key, v in cfg.items() if key != "model_type"}
        config = AutoConfig.for_model(kind, **extra)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - any failure falls back to the formula
        return None, f"transformers could not build {kind!r} ({type(exc).__name__}: {exc})"
    finally:
        transformers.logging.set_verbosity(verbosity)
    distinct = {id(p): p.numel() for p in model.parameters()}
    return sum(distinct.values()), f"counted on transformers' {type(model).__name__} " \
                                   f"(meta device)"


def count_hf_config(cfg: dict) -> Tuple[int, str]:
    """(Ψ, how it was counted): transformers' model when possible, else the formula."""
    num, how = params_from_transformers(cfg)
    if num is not None:
        return num, how
    kind = cfg.get("model_type", "?")
    checked = "" if kind in CHECKED_MODEL_TYPES else \
        f", approximate: model_type {kind!r} is not one of those checked against transformers"
    return params_from_hf_config(cfg), f"from the config.json formula ({how}{checked}; see " \
                                       f"zkernels.hf_params)"
