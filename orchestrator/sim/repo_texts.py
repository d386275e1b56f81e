"""The small (non-weight) files of the synthetic repos: configs, tokenizer files, remote code, docs.

Field names and values follow the real repos where the orchestrator or the simulated vLLM may read
them (architectures, model_type, auto_map for trust_remote_code, max_position_embeddings,
quantization_config). Everything else is short, deterministic, and says it is SIMULATED.
"""

from __future__ import annotations

import json
from typing import Any

GITATTRIBUTES = "\n".join(
    f"{p} filter=lfs diff=lfs merge=lfs -text" for p in (
        "*.7z", "*.bin", "*.h5", "*.model", "*.msgpack", "*.onnx", "*.pt", "*.pth", "*.safetensors",
        "*.tar.*", "*.zip", "*.zst", "*tfevents*", "*.png")) + "\n"

SIM_NOTE = ("This is a SIMULATED repository served by the vllm-orch Hub mirror: real file names and "
            "shard counts, synthetic content scaled down. It is not the model.")


def _j(obj: dict) -> str:
    return json.dumps(obj, indent=2) + "\n"


def readme(repo_id: str, quant: str) -> str:
    return (f"---\nlicense: other\nlibrary_name: transformers\n---\n# {repo_id} ({quant})\n\n"
            f"{SIM_NOTE}\n\n## Deploy\n\n```\nvllm serve {repo_id} --trust-remote-code\n```\n")


def remote_code(module: str, classes: list[str]) -> str:
    body = "\n\n".join(f"class {c}:\n    \"\"\"SIMULATED stand-in for {c}.\"\"\"\n" for c in classes)
    return f'"""{module}: SIMULATED remote code (trust_remote_code). {SIM_NOTE}"""\n\n\n{body}'


# -- Kimi-K2.5 (both checkpoints share the remote code and tokenizer) ------------------------------
KIMI_CODE = {
    "configuration_deepseek.py": ["DeepseekV3Config"],
    "configuration_kimi_k25.py": ["KimiK25Config"],
    "modeling_deepseek.py": ["DeepseekV3ForCausalLM"],
    "modeling_kimi_k25.py": ["KimiK25ForConditionalGeneration"],
    "kimi_k25_processor.py": ["KimiK25Processor"],
    "kimi_k25_vision_processing.py": ["KimiK25VisionProcessor"],
    "media_utils.py": ["MediaLoader"],
    "tokenization_kimi.py": ["TikTokenTokenizer"],
}


def kimi_small_files() -> dict[str, str]:
    files = {path: remote_code(path[:-3], classes) for path, classes in KIMI_CODE.items()}
    files.update({
        ".gitattributes": GITATTRIBUTES + "model.safetensors.index.json filter=lfs diff=lfs merge=lfs -text\n",
        "LICENSE": "Modified MIT License\n\nCopyright (c) 2026 Moonshot AI\n\n(SIMULATED copy)\n",
        "README.md": readme("moonshotai/Kimi-K2.5", "native INT4"),
        "THIRD_PARTY_NOTICES.md": "# Third party notices\n\n(SIMULATED)\n",
        "chat_template.jinja": (
            "{%- for message in messages -%}<|im_{{ message.role }}|>{{ message.role }}<|im_middle|>"
            "{{ message.content }}<|im_end|>{%- endfor -%}"
            "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|><think>{%- endif -%}\n"),
        "docs/deploy_guidance.md": "# Deployment guidance\n\n(SIMULATED) vllm serve ... -tp 8\n",
        "docs/tool_call_guidance.md": "# Tool calling\n\n(SIMULATED) --tool-call-parser kimi_k2\n",
        "generation_config.json": _j({"max_length": 262144, "eos_token_id": 163586}),
        "preprocessor_config.json": _j({"processor_class": "KimiK25Processor", "patch_size": 14,
                                        "auto_map": {"AutoProcessor": "kimi_k25_processor.KimiK25Processor"}}),
        "tokenizer_config.json": _j({
            "tokenizer_class": "TikTokenTokenizer", "model_max_length": 262144,
            "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
            "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
            "added_tokens_decoder": {"163584": {"content": "[BOS]", "special": True},
                                     "163585": {"content": "[EOS]", "special": True},
                                     "163586": {"content": "<|im_end|>", "special": True}}}),
    })
    return files


def kimi_config(quant: str) -> dict:
    qcfg: dict[str, Any]
    if quant == "int4":
        qcfg = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32}}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*vision_tower.*"]}
    else:
        qcfg = {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8",
                "group_size": 16, "exclude_modules": ["lm_head", "*self_attn*", "*vision_tower*",
                                                      "*mm_projector*"]}
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "text_config": {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                        "num_attention_heads": 64, "n_routed_experts": 384, "num_experts_per_tok": 8,
                        "n_shared_experts": 1, "moe_intermediate_size": 2048, "vocab_size": 163840,
                        "max_position_embeddings": 262144, "kv_lora_rank": 512,
                        "quantization_config": qcfg},
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
    }


def nvfp4_quant_config() -> str:
    return _j({"producer": {"name": "modelopt", "version": "0.37.0"},
               "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                                "exclude_modules": ["lm_head", "*self_attn*", "*vision_tower*"]}})


# -- MiniMax-M2.5 --------------------------------------------------------------------------------
# Real sizes of the LFS-tracked figures are unknown; these are plausible.
MINIMAX_FIGURES = {f"bench_{i}": 180_000 + 7_919 * i for i in (1, 2, 4, 5, 6, 8, 10, 11, 12)}
MINIMAX_FIGURES.update({"rl_1": 240_000})


def minimax_small_files() -> dict[str, str]:
    docs = {}
    for name in ("sglang_deploy_guide", "tool_calling_guide", "transformers_deploy_guide", "vllm_deploy_guide"):
        docs[f"docs/{name}.md"] = f"# {name}\n\n(SIMULATED)\n"
        docs[f"docs/{name}_cn.md"] = f"# {name} (cn)\n\n(SIMULATED)\n"
    small_figs = {f"figures/{n}.png": "PNG (SIMULATED small figure)\n" for n in ("bench_3", "bench_7", "bench_9", "rl_2")}
    return {
        **docs, **small_figs,
        ".gitattributes": GITATTRIBUTES,
        "README.md": readme("MiniMaxAI/MiniMax-M2.5", "FP8"),
        "chat_template.jinja": (
            "{%- for message in messages -%}]~b]{{ message.role }}\n{{ message.content }}[e~[\n{%- endfor -%}"
            "{%- if add_generation_prompt -%}]~b]ai\n<think>\n{%- endif -%}\n"),
        "configuration_minimax_m2.py": remote_code("configuration_minimax_m2", ["MiniMaxM2Config"]),
        "modeling_minimax_m2.py": remote_code("modeling_minimax_m2", ["MiniMaxM2ForCausalLM"]),
        "generation_config.json": _j({"bos_token_id": 200019, "eos_token_id": 200020,
                                      "temperature": 1.0, "top_p": 0.95, "top_k": 40}),
        "merges.txt": "#version: 0.2\nĠ t\nĠ a\n",
        "vocab.json": _j({"<unk>": 0, "Ġt": 1, "Ġa": 2}),
        "tokenizer.json": _j({"version": "1.0", "model": {"type": "BPE", "vocab": {"Ġt": 1, "Ġa": 2}}}),
        "tokenizer_config.json": _j({"tokenizer_class": "GPT2Tokenizer", "model_max_length": 196608,
                                     "bos_token": "]~!b[", "eos_token": "[e~["}),
    }


def minimax_config() -> dict:
    return {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        "auto_map": {"AutoConfig": "configuration_minimax_m2.MiniMaxM2Config",
                     "AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM"},
        "hidden_size": 3072, "num_hidden_layers": 62, "num_attention_heads": 48,
        "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 256,
        "num_experts_per_tok": 8, "intermediate_size": 1536, "vocab_size": 200064,
        "max_position_embeddings": 196608,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                "fmt": "float8_e4m3fn", "weight_block_size": [128, 128]},
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
    }


# -- test repos ----------------------------------------------------------------------------------
def tiny_small_files(repo_id: str) -> dict[str, str]:
    return {
        ".gitattributes": GITATTRIBUTES,
        "README.md": readme(repo_id, "tiny test repo"),
        "generation_config.json": _j({"eos_token_id": 2, "max_length": 4096}),
        "tokenizer.json": _j({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}}),
        "tokenizer_config.json": _j({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}),
    }


def tiny_config() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 2,
            "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
