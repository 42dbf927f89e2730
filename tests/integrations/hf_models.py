"""Tiny randomly initialised transformers models of every family the integration patches, built in the test
(nothing is downloaded): two layers, hidden 32, four heads (two key/value heads where the family has GQA)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

VOCAB = 96
FAMILIES = (
    "gpt2",
    "bert",
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma3_text",
    "gpt_oss",
    "deepseek_v3",
    "deepseek_v2",
)
WINDOW = 5  # Mistral's (Gemma 3's, gpt-oss's sliding layers') window in these models: it binds on sequences of 12


def config(family: str, **overrides):
    """The tiny config of ``family`` (dropout 0, so training-mode forwards are deterministic); ``overrides``: other
    values of its arguments (Gemma 3, gpt-oss)."""
    import transformers as tf

    llama_like = dict(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "gpt2":
        return tf.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    if family == "bert":
        return tf.BertConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            is_decoder=True,
            pad_token_id=0,
        )
    if family == "llama":
        return tf.LlamaConfig(**llama_like)
    if family == "mistral":
        return tf.MistralConfig(**llama_like, sliding_window=WINDOW)
    if family == "mixtral":
        return tf.MixtralConfig(**llama_like, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    qwen = dict(llama_like, rope_theta=1e6, rms_norm_eps=1e-6)
    if family == "qwen2":  # biases on q/k/v (Qwen 2.5)
        return tf.Qwen2Config(**qwen, use_sliding_window=False)
    if family == "qwen3":  # per-head q/k RMSNorm, head_dim apart from hidden / heads
        return tf.Qwen3Config(**qwen, head_dim=16, use_sliding_window=False)
    if family == "qwen3_moe":  # 4 experts, top 2 unnormalised, a dense MLP every second layer
        return tf.Qwen3MoeConfig(
            **qwen,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[],
        )
    if family == "gemma3_text":  # a sliding and a full layer, q/k norms, query_pre_attn_scalar apart from head_dim
        return tf.Gemma3TextConfig(
            **llama_like,
            head_dim=8,
            query_pre_attn_scalar=12,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            hidden_activation="gelu_pytorch_tanh",
            **overrides,
        )
    if family == "gpt_oss":  # a sliding and a full layer, sinks, biased experts whose SwiGLU clamp binds
        return tf.GptOssConfig(
            **{**llama_like, "intermediate_size": 24},
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            swiglu_limit=0.1,
            rope_parameters=dict(  # YaRN as gpt-oss's, its factor the ratio of these models' context lengths
                rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=150000.0
            ),
            **overrides,
        )
    if family == "deepseek_v3":  # latent attention (d_qk 16, d_v 8), a dense first layer, group-limited routing
        deepseek = dict(
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=12,
            qk_rope_head_dim=4,
            v_head_dim=8,
            n_routed_experts=8,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            # YaRN as DeepSeek-V3's (mscale = mscale_all_dim = 1): the attention's scaling is 1/sqrt(d_qk) times
            # mscale², apart from the kernel's default
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=16,
                rope_theta=10000.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
        )
        return tf.DeepseekV3Config(**{**llama_like, "num_key_value_heads": 4, **deepseek, **overrides})
    if family == "deepseek_v2":  # V2's softmax routing (greedy top-k, scaled, not renormalised), default rotary
        deepseek = dict(
            q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=8,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
            first_k_dense_replace=1, routed_scaling_factor=1.5, topk_method="greedy",
        )  # fmt: skip
        return tf.DeepseekV2Config(**{**llama_like, "num_key_value_heads": 4, **deepseek, **overrides})
    raise ValueError(family)


def model_class(family: str):
    """The causal-LM class of ``family`` (BERT's is ``BertLMHeadModel``)."""
    import transformers as tf

    return {
        "gpt2": tf.GPT2LMHeadModel,
        "bert": tf.BertLMHeadModel,
        "llama": tf.LlamaForCausalLM,
        "mistral": tf.MistralForCausalLM,
        "mixtral": tf.MixtralForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "qwen3": tf.Qwen3ForCausalLM,
        "qwen3_moe": tf.Qwen3MoeForCausalLM,
        "gemma3_text": tf.Gemma3ForCausalLM,
        "gpt_oss": tf.GptOssForCausalLM,
        "deepseek_v3": tf.DeepseekV3ForCausalLM,
        "deepseek_v2": tf.DeepseekV2ForCausalLM,
    }[family]


def build(family: str, seed: int = 0, **overrides):
    """A fresh fp32 causal LM of ``family`` (``overrides``: config values, for the families whose ``config`` takes
    them) whose weights depend only on ``seed``. The parameters transformers
    initialises to constants that would hide a difference are drawn at random: Gemma's norm weights (stored as the
    offset from one, zeros), gpt-oss's expert biases (zeros) and sinks (std 0.02: made to matter)."""
    torch.manual_seed(seed)
    model = model_class(family)(config(family, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (family == "gemma3_text" and "norm" in name) or (
                family == "gpt_oss" and "experts." in name and "bias" in name
            ):
                p.normal_(0.0, 0.1)
            elif family == "gpt_oss" and name.endswith("sinks"):
                p.normal_(0.0, 1.0)
    return model


def batch(seed: int = 0, batch: int = 2, seq: int = 12) -> torch.Tensor:
    """Random token ids ``[batch, seq]`` (int64) above the special tokens."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


def accelerate_example():
    """examples/hf_accelerate_train.py as a module (its ``build_model`` and ``dataset`` serve the training tests)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "hf_accelerate_train.py"
    spec = importlib.util.spec_from_file_location("hf_accelerate_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
