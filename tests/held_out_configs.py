"""Held-out configs: the published config.json of common checkpoints of the families of issue
#17, copied field for field (the hub's files, or where a field list was elided in the copy we
read, the family's own copy of it; the source is named above each), and `shrink`, which makes a
tiny model of one without touching what the family does with its fields.

These were not written for pagedllm's tests (tests/arch_configs.py and the configs of
tests/models/test_archs_equivalence.py were): tests/models/test_held_out_configs.py runs each,
shrunk, against transformers."""

from __future__ import annotations

import copy

# ---- Gemma 2 / Gemma 3 ----------------------------------------------------------------------
GEMMA_2_2B_IT = {  # google/gemma-2-2b-it (the same as google/gemma-2-2b's)
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
    "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000,
}
GEMMA_2_27B_IT = {  # google/gemma-2-27b-it: head_dim 128 and query_pre_attn_scalar 144 (hidden / heads)
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 128, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 4608, "initializer_range": 0.02,
    "intermediate_size": 36864, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 32,
    "num_hidden_layers": 46, "num_key_value_heads": 16, "pad_token_id": 0, "query_pre_attn_scalar": 144,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "sliding_window_size": 4096,
    "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0", "use_cache": True, "vocab_size": 256000,
}
GEMMA_3_1B_IT = {  # google/gemma-3-1b-it: Gemma3ForCausalLM, 5 local : 1 global, two rope bases
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.52.4", "use_cache": True, "vocab_size": 262144,
}
# google/gemma-3-4b-it is a Gemma3ForConditionalGeneration (SigLIP vision tower + projector +
# Gemma 3 text model). Its text_config is sparse: every field it leaves out takes
# Gemma3TextConfig's default (8 heads, 4 kv heads, head_dim 256, pattern 6, local base 10,000).
GEMMA_3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}

# ---- Phi-3 / Phi-3.5 / Phi-4-mini -----------------------------------------------------------
_PHI3_COMMON = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "embd_pdrop": 0.0, "eos_token_id": 32000, "hidden_act": "silu", "initializer_range": 0.02, "model_type": "phi3",
    "pad_token_id": 32000, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32064,
}
PHI_3_MINI_4K = {  # microsoft/Phi-3-mini-4k-instruct: a 2047-token window on every layer
    **_PHI3_COMMON, "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 4096,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "rope_scaling": None, "sliding_window": 2047,
    "transformers_version": "4.40.2",
}
PHI_3_MINI_128K = {  # microsoft/Phi-3-mini-128k-instruct: LongRoPE over 48 frequencies
    **_PHI3_COMMON, "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "sliding_window": 262144, "transformers_version": "4.40.2",
    "rope_scaling": {
        "long_factor": [
            1.0700000524520874, 1.1200000047683716, 1.149999976158142, 1.4199999570846558, 1.5699999332427979,
            1.7999999523162842, 2.129999876022339, 2.129999876022339, 3.009999990463257, 5.910000324249268,
            6.950000286102295, 9.070000648498535, 9.930000305175781, 10.710000038146973, 11.130000114440918,
            14.609999656677246, 15.409998893737793, 19.809999465942383, 37.279998779296875, 38.279998779296875,
            38.599998474121094, 40.12000274658203, 46.20000457763672, 50.940006256103516, 53.66000747680664,
            54.9373893737793, 56.89738845825195, 57.28738784790039, 59.98738479614258, 60.86738586425781,
            60.887386322021484, 61.71739196777344, 62.91739273071289, 62.957393646240234, 63.41739273071289,
            63.8173942565918, 63.83739471435547, 63.897396087646484, 63.93739700317383, 64.06739807128906,
            64.11434936523438, 64.12435150146484, 64.15435028076172, 64.19435119628906, 64.24435424804688,
            64.57435607910156, 64.69000244140625, 64.76000213623047],
        "short_factor": [
            1.1, 1.1, 1.1, 1.3000000000000003, 1.3500000000000003, 1.3500000000000003, 1.4000000000000004,
            1.5500000000000005, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
            2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
            2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
            2.000000000000001, 2.000000000000001, 2.000000000000001, 2.0500000000000007, 2.0500000000000007,
            2.0500000000000007, 2.0500000000000007, 2.0500000000000007, 2.0500000000000007, 2.1000000000000005,
            2.1000000000000005, 2.1500000000000004, 2.25, 2.25, 2.25, 2.25, 2.25, 2.3999999999999995,
            2.4499999999999993, 2.499999999999999, 2.6999999999999984, 2.6999999999999984, 2.7499999999999982,
            2.799999999999998, 2.8999999999999977, 3.049999999999997],
        "type": "longrope",
    },
}
PHI_3_5_MINI = {  # microsoft/Phi-3.5-mini-instruct (factors as in microsoft's gpt-fast-style port)
    **_PHI3_COMMON, "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096, "sliding_window": 262144, "transformers_version": "4.43.3",
    "rope_scaling": {
        "long_factor": [
            1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
            1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
            4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
            17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
            32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
            50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
            62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
            63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
            64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
            64.51000213623047, 64.52999877929688, 64.83999633789062],
        "short_factor": [
            1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
            1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
            1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
            1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
            1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
            2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
            2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
            2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
            2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
            2.749999523162842, 2.8399994373321533],
        "type": "longrope",
    },
}
PHI_3_MEDIUM_4K = {  # microsoft/Phi-3-medium-4k-instruct: GQA 40 : 10
    **_PHI3_COMMON, "hidden_size": 5120, "intermediate_size": 17920, "max_position_embeddings": 4096,
    "num_attention_heads": 40, "num_hidden_layers": 40, "num_key_value_heads": 10,
    "original_max_position_embeddings": 4096, "rope_scaling": None, "sliding_window": 2047,
    "transformers_version": "4.39.3",
}
PHI_4_MINI = {  # microsoft/Phi-4-mini-instruct: rotary over 3/4 of each head, LongRoPE, tied
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 199999,
    "embd_pdrop": 0.0, "eos_token_id": 200020, "full_attn_mod": 1, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "interpolate_factor": 1, "lm_head_bias": False,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "phi3", "num_attention_heads": 24,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "original_max_position_embeddings": 4096,
    "pad_token_id": 199999, "partial_rotary_factor": 0.75, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "long_factor": [
            1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
            2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845,
            5.351743533, 5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129,
            13.09260651, 14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418,
            28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28,
            33.49, 33.5, 44.16, 47.77],
        "short_factor": [1.0] * 48,
        "type": "longrope",
    },
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0", "use_cache": True, "vocab_size": 200064,
}

# ---- Mistral / Qwen2.5 / Qwen3 --------------------------------------------------------------
MISTRAL_7B_V0_1 = {  # mistralai/Mistral-7B-v0.1: a 4096-token window on every layer
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}
QWEN2_5_7B_INSTRUCT = {  # Qwen/Qwen2.5-7B-Instruct: a window stated but use_sliding_window false
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
}
# the model card's long-context recipe: add this (the v4 "type" key) to config.json
QWEN2_5_7B_INSTRUCT_YARN = {**QWEN2_5_7B_INSTRUCT,
                            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}
QWEN3_8B_YARN = {  # Qwen/Qwen3-8B with its model card's YaRN rope_scaling added
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
    "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

# ---- OLMo 2, GLM-4, Granite, StarCoder2 -----------------------------------------------------
OLMO_2_1124_7B = {  # allenai/OLMo-2-1124-7B
    "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "eos_token_id": 100257,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008,
    "max_position_embeddings": 4096, "model_type": "olmo2", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "pad_token_id": 100277, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 500000, "tie_word_embeddings": False, "torch_dtype": "float32",
    "transformers_version": "4.47.0.dev0", "use_cache": True, "vocab_size": 100352,
}
GLM_4_9B_0414 = {  # THUDM/GLM-4-9B-0414: half-rotary (interleaved), 32 : 2 heads, q/k/v biases
    "architectures": ["Glm4ForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 13696, "max_position_embeddings": 32768, "model_type": "glm4",
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 2, "pad_token_id": 151329,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.52.0.dev0", "use_cache": True, "vocab_size": 151552,
}
GRANITE_3_3_2B_INSTRUCT = {  # ibm-granite/granite-3.3-2b-instruct
    "architectures": ["GraniteForCausalLM"], "attention_bias": False, "attention_dropout": 0.1,
    "attention_multiplier": 0.015625, "bos_token_id": 0, "embedding_multiplier": 12.0, "eos_token_id": 0,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "logits_scaling": 8.0, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "granite",
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "pad_token_id": 0,
    "residual_multiplier": 0.22, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.49.0", "use_cache": True,
    "vocab_size": 49159,
}
GRANITE_3_1_8B_INSTRUCT = {  # ibm-granite/granite-3.1-8b-instruct
    **GRANITE_3_3_2B_INSTRUCT, "attention_multiplier": 0.0078125, "hidden_size": 4096, "intermediate_size": 12800,
    "logits_scaling": 16.0, "transformers_version": "4.47.0", "vocab_size": 49155,
}
STARCODER2_3B = {  # bigcode/starcoder2-3b: LayerNorm, GELU, a 4096-token window, 24 : 2 heads
    "architectures": ["Starcoder2ForCausalLM"], "attention_dropout": 0.1, "residual_dropout": 0.1,
    "embedding_dropout": 0.1, "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 3072, "initializer_range": 0.018042, "intermediate_size": 12288, "layer_norm_epsilon": 1e-05,
    "max_position_embeddings": 16384, "mlp_type": "default", "model_type": "starcoder2", "norm_epsilon": 1e-05,
    "norm_type": "layer_norm", "num_attention_heads": 24, "num_hidden_layers": 30, "num_key_value_heads": 2,
    "rope_theta": 999999.4420358813, "sliding_window": 4096, "transformers_version": "4.37.0.dev0",
    "use_bias": True, "use_cache": True, "vocab_size": 49152,
}
STARCODER2_7B = {  # bigcode/starcoder2-7b: 36 : 4 heads
    **STARCODER2_3B, "hidden_size": 4608, "initializer_range": 0.018042, "intermediate_size": 18432,
    "num_attention_heads": 36, "num_hidden_layers": 32, "num_key_value_heads": 4, "rope_theta": 1000000,
}

# ---- GPT-2, GPT-NeoX / Pythia ---------------------------------------------------------------
GPT2 = {  # openai-community/gpt2
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
    "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
    "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}, "vocab_size": 50257,
}
PYTHIA_160M = {  # EleutherAI/pythia-160m: rotary_pct / rotary_emb_base, the v4 names
    "architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
    "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 12, "num_hidden_layers": 12,
    "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.24.0", "use_cache": True, "use_parallel_residual": True, "vocab_size": 50304,
}
GPT_NEOX_20B = {  # EleutherAI/gpt-neox-20b: head_dim 96, rotary over 24 of its dims, gelu_fast
    **PYTHIA_160M, "hidden_act": "gelu_fast", "hidden_size": 6144, "intermediate_size": 24576,
    "num_attention_heads": 64, "num_hidden_layers": 44, "transformers_version": "4.21.0.dev0", "vocab_size": 50432,
}

PUBLISHED = {
    "gemma-2-2b-it": GEMMA_2_2B_IT, "gemma-2-27b-it": GEMMA_2_27B_IT, "gemma-3-1b-it": GEMMA_3_1B_IT,
    "phi-3-mini-4k": PHI_3_MINI_4K, "phi-3-mini-128k": PHI_3_MINI_128K, "phi-3.5-mini": PHI_3_5_MINI,
    "phi-3-medium-4k": PHI_3_MEDIUM_4K, "phi-4-mini": PHI_4_MINI, "mistral-7b-v0.1": MISTRAL_7B_V0_1,
    "qwen2.5-7b-instruct": QWEN2_5_7B_INSTRUCT, "qwen2.5-7b-instruct-yarn": QWEN2_5_7B_INSTRUCT_YARN,
    "qwen3-8b-yarn": QWEN3_8B_YARN, "olmo-2-1124-7b": OLMO_2_1124_7B, "glm-4-9b-0414": GLM_4_9B_0414,
    "granite-3.3-2b": GRANITE_3_3_2B_INSTRUCT, "granite-3.1-8b": GRANITE_3_1_8B_INSTRUCT,
    "starcoder2-3b": STARCODER2_3B, "starcoder2-7b": STARCODER2_7B, "gpt2": GPT2, "pythia-160m": PYTHIA_160M,
    "gpt-neox-20b": GPT_NEOX_20B,
}

VOCAB = 4096  # the shrunk vocabulary: prompts and special ids are drawn below it
WINDOW_DIVISOR = 128  # a window shorter than the context shrinks by this: 4096 -> 32, 2047 -> 15, 512 -> 4


def shrink(published: dict) -> dict:
    """A tiny model of a published config: 2 layers (a Gemma 3 pattern's 6, so one is global), at
    most 2 kv heads and 4 query heads per kv head with the published head_dim (so LongRoPE's
    factor lists, partial rotary and query_pre_attn_scalar keep their meaning), the hidden size
    that head_dim implies (128 where head_dim is its own field), an intermediate size of twice
    the hidden size, a vocabulary of VOCAB with the special ids folded into it, and a window that
    is shorter than the context divided by WINDOW_DIVISOR (so prompts of ~100 tokens cross it).
    Every other field is as published; initializer_range becomes 0.3 so tokens vary."""
    from transformers import AutoConfig

    c = copy.deepcopy(published)
    defaults = AutoConfig.for_model(c["model_type"])  # for the fields a sparse config leaves out

    def field(name: str):
        return c[name] if name in c else getattr(defaults, name, None)

    gpt2 = "n_layer" in c
    layers, heads, hidden = ("n_layer", "n_head", "n_embd") if gpt2 else (
        "num_hidden_layers", "num_attention_heads", "hidden_size")
    n_heads = field(heads)
    n_kv = field("num_key_value_heads") or n_heads
    explicit_head_dim = "head_dim" in c  # else the model derives it from hidden / heads
    head_dim = c["head_dim"] if explicit_head_dim else field(hidden) // n_heads
    new_kv = min(n_kv, 2) if n_kv == n_heads else 1
    new_heads = new_kv * min(n_heads // n_kv, 4)
    c[heads] = new_heads
    if "num_key_value_heads" in c or hasattr(defaults, "num_key_value_heads"):
        c["num_key_value_heads"] = new_kv
    if not gpt2:
        c["intermediate_size"] = 2 * (128 if explicit_head_dim else new_heads * head_dim)
    c[hidden] = 128 if explicit_head_dim else new_heads * head_dim
    pattern = field("sliding_window_pattern") or getattr(defaults, "_sliding_window_pattern", None)
    c[layers] = int(pattern or 2)
    if isinstance(c.get("layer_types"), list):
        c["layer_types"] = c["layer_types"][: c[layers]]
    window, context = field("sliding_window"), field("max_position_embeddings") or field("n_positions")
    if window and context and window < context and c.get("use_sliding_window", True):
        c["sliding_window"] = window // WINDOW_DIVISOR
    c["vocab_size"] = VOCAB
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(c.get(key), int):
            c[key] %= VOCAB
        elif isinstance(c.get(key), list):
            c[key] = [i % VOCAB for i in c[key]]
    c["initializer_range"] = 0.3
    return c


def gemma3_text_part(published: dict) -> dict:
    """The text model of a Gemma3ForConditionalGeneration config as a Gemma3ForCausalLM config."""
    return {**published["text_config"], "architectures": ["Gemma3ForCausalLM"],
            "eos_token_id": published.get("eos_token_id")}
