"""Tiny randomly initialised chat models that a REAL vLLM (its CPU build) can load and serve.

Why: the simulated vLLM is the only server our deploy, swap, status and bench would otherwise ever
talk to. vLLM's CPU build serves a Llama-architecture model of a few hundred thousand parameters in
under a minute on two cores; this module makes such a model from nothing (no download, no torch):

- `model.safetensors`: random weights (normal, std 0.02, norms 1.0, as transformers initialises a
  Llama), float32, written in the safetensors format (u64 header length, JSON header, raw tensors);
- a word-level tokenizer trained on a few sentences (`tokenizer.json` in the `tokenizers` library's
  format: lowercase normaliser, whitespace pre-tokeniser, one id per word seen in training, the
  special tokens first) with `tokenizer_config.json` and a jinja chat template;
- `config.json` / `generation_config.json` as transformers writes them for `LlamaForCausalLM`.

Two choices make random weights meet a smoke test: every training word is a real word with a
vowel (so any generated text passes the garbage check), and the output rows of the special tokens
are zero (their logit is exactly 0 while the best random logit is positive), so greedy decoding
never stops early: a request for N tokens answers N words. head_dim is 64: vLLM's CPU attention
refuses 16 ("Unsupported CPU attention configuration").

Pure stdlib and deterministic (seeded): the SIMULATED Hub mirror builds the same bytes in every
process, so sha256s are stable and the real huggingface_hub download verifies them.

    python -m orchestrator.sim.tinymodel OUT_DIR [--name tiny-llama-a]   # write one model folder
"""

from __future__ import annotations

import argparse
import array
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

TRANSFORMERS_VERSION = "5.19.0"     # what vLLM 0.32's CPU build installs; written as transformers does
SPECIAL = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
UNK, BOS, EOS = 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = message['content'] | map(attribute='text') | join(' ') %}{% endif %}"
    "<|{{ message['role'] }}|> {{ text }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@dataclass(frozen=True)
class TinySpec:
    """One tiny model: its repo id, seed, training sentences and shape (head_dim = hidden / heads)."""

    repo_id: str
    seed: int
    sentences: tuple[str, ...]
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    max_position_embeddings: int = 4096

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


_SENTENCES_A = (
    "the quiet river runs past the old mill every morning",
    "a small boat carries apples and bread across the lake",
    "children play near the garden while their parents talk",
    "the baker opens his shop before the sun rises over the hills",
    "every evening the lights of the harbour shine on the water",
    "birds sing in the tall trees above the narrow road",
    "she reads a long story about a brave sailor and his dog",
    "the market is busy on saturday with music and laughter",
)
_SENTENCES_B = (
    "engines hum inside the warm station under the mountain",
    "a patient robot counts the tokens of every request",
    "the orange lantern glows above the wooden table",
    "travellers share soup and stories after the rain",
    "clever owls watch the meadow from the silver tower",
    "the orchestra plays a gentle tune for the sleepy village",
    "gardeners plant tulips beside the curved stone bridge",
    "our captain notes the weather in a blue notebook",
)

MODELS: dict[str, TinySpec] = {
    "vllm-orch-sim/tiny-llama-a": TinySpec("vllm-orch-sim/tiny-llama-a", 1501, _SENTENCES_A),
    "vllm-orch-sim/tiny-llama-b": TinySpec("vllm-orch-sim/tiny-llama-b", 2602, _SENTENCES_B,
                                           num_hidden_layers=3),
}


# -- tokenizer ---------------------------------------------------------------------------------
def train_vocab(sentences: tuple[str, ...]) -> dict[str, int]:
    """What the `tokenizers` WordLevelTrainer learns from these sentences: the special tokens
    first, then every word by descending frequency (ties alphabetical)."""
    counts: dict[str, int] = {}
    for sentence in sentences:
        for word in sentence.lower().split():
            counts[word] = counts.get(word, 0) + 1
    words = sorted(counts, key=lambda w: (-counts[w], w))
    return {tok: i for i, tok in enumerate(list(SPECIAL) + words)}


def tokenizer_json(vocab: dict[str, int]) -> dict:
    added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for t in SPECIAL]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": SPECIAL[UNK]}}


def tokenizer_config(spec: TinySpec) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[BOS],
            "eos_token": SPECIAL[EOS], "unk_token": SPECIAL[UNK], "pad_token": SPECIAL[EOS],
            "model_max_length": spec.max_position_embeddings, "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE}


# -- weights -----------------------------------------------------------------------------------
def _shapes(spec: TinySpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    h, i, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q = spec.num_attention_heads * hd
    out = {"model.embed_tokens.weight": (vocab_size, h), "model.norm.weight": (h,),
           "lm_head.weight": (vocab_size, h)}
    for n in range(spec.num_hidden_layers):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (q, h),
                    p + "self_attn.v_proj.weight": (q, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    return out


def _tensor(rng: random.Random, name: str, shape: tuple[int, ...]) -> array.array:
    n = 1
    for d in shape:
        n *= d
    if name.endswith("norm.weight"):
        data = array.array("f", [1.0]) * n
    else:
        gauss = rng.gauss
        data = array.array("f", [gauss(0.0, 0.02) for _ in range(n)])
    if name == "lm_head.weight":                 # special tokens can never be the greedy choice
        data[:len(SPECIAL) * shape[1]] = array.array("f", [0.0]) * (len(SPECIAL) * shape[1])
    return data


def safetensors_bytes(tensors: dict[str, tuple[tuple[int, ...], array.array]]) -> bytes:
    """A safetensors file: u64 LE header length, JSON header (8-byte aligned), F32 data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        shape, data = tensors[name]
        if sys.byteorder != "little":
            data = array.array("f", data)
            data.byteswap()
        raw = data.tobytes()
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def config_json(spec: TinySpec, vocab_size: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": BOS, "eos_token_id": EOS, "head_dim": spec.head_dim, "hidden_act": "silu",
            "hidden_size": spec.hidden_size, "initializer_range": 0.02,
            "intermediate_size": spec.intermediate_size,
            "max_position_embeddings": spec.max_position_embeddings, "mlp_bias": False,
            "model_type": "llama", "num_attention_heads": spec.num_attention_heads,
            "num_hidden_layers": spec.num_hidden_layers,
            "num_key_value_heads": spec.num_attention_heads, "pretraining_tp": 1,
            "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "tie_word_embeddings": False, "dtype": "float32",
            "transformers_version": TRANSFORMERS_VERSION, "use_cache": True, "vocab_size": vocab_size}


def model_files(spec: TinySpec) -> dict[str, bytes]:
    """Every file of the model's repo, path -> bytes (deterministic for a spec)."""
    vocab = train_vocab(spec.sentences)
    rng = random.Random(spec.seed)
    tensors = {name: (shape, _tensor(rng, name, shape))
               for name, shape in _shapes(spec, len(vocab)).items()}

    def js(obj) -> bytes:
        return (json.dumps(obj, indent=2) + "\n").encode()

    readme = (f"# {spec.repo_id} (SIMULATED, random weights)\n\nA tiny Llama with random weights "
              f"made by vllm-orch's tiny model generator, for rehearsing with a real vLLM on CPU.\n"
              f"It answers with random words from its training sentences.\n")
    return {
        "config.json": js(config_json(spec, len(vocab))),
        "generation_config.json": js({"_from_model_config": True, "bos_token_id": BOS,
                                      "eos_token_id": EOS, "transformers_version": TRANSFORMERS_VERSION}),
        "model.safetensors": safetensors_bytes(tensors),
        "tokenizer.json": js(tokenizer_json(vocab)),
        "tokenizer_config.json": js(tokenizer_config(spec)),
        "special_tokens_map.json": js({"bos_token": SPECIAL[BOS], "eos_token": SPECIAL[EOS],
                                       "unk_token": SPECIAL[UNK], "pad_token": SPECIAL[EOS]}),
        "README.md": readme.encode(),
    }


def write_model(out: Path, repo_id: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for path, data in model_files(MODELS[repo_id]).items():
        (out / path).write_bytes(data)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.sim.tinymodel", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--repo", default="vllm-orch-sim/tiny-llama-a", choices=sorted(MODELS))
    args = ap.parse_args(argv)
    print(write_model(args.out, args.repo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
