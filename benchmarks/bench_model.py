"""The benchmarks' model: a Llama-3-8B-shaped model with random bf16 weights (speed does not depend on the weights), or
one of Gemma-2-9B's attention shape (head_dim 256), a tiny one of the same head shape for checking the scripts on a
CPU, and a stand-in tokenizer for random token ids."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


class Ids:
    """What a delimiter-aware router asks of a tokenizer, for random token ids: no id is a delimiter; and what
    context scoring asks (text to ids: each character's code point, no chat template)."""

    all_special_ids: list[int] = []
    name_or_path = "random-ids"
    chat_template = None

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __len__(self) -> int:
        return self.vocab

    def batch_decode(self, ids: list[list[int]]) -> list[str]:
        return ["a"] * len(ids)

    def __call__(self, text: str, add_special_tokens: bool = False, return_tensors: str = "pt") -> dict:
        return {"input_ids": torch.tensor([[ord(c) % self.vocab for c in text]])}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def llama3_8b(layers: int = 32, vocab: int = 128256) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
        max_position_embeddings=262144, torch_dtype="bfloat16",
    )


def d256(layers: int = 42, vocab: int = 256000) -> LlamaConfig:
    """Gemma-2-9B's sizes and attention shape (16 query heads on 8 KV heads at head_dim 256, rope theta 10,000) as a
    Llama: the decode kernels see the same shapes; Gemma's sliding windows, soft-capping and norms are left out."""
    return LlamaConfig(
        vocab_size=vocab, hidden_size=3584, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, rope_theta=10000.0,
        max_position_embeddings=262144, torch_dtype="bfloat16",
    )


#: the models the benchmarks build by ``--shape``: each a function of the layers
SHAPES = {"llama3-8b": llama3_8b, "d256": d256}


def smoke_config(layers: int, shape: str = "llama3-8b") -> LlamaConfig:
    """A tiny model of :data:`SHAPES` ``shape``'s head shape (its head_dim and query heads a KV head, on 2 KV heads:
    Llama-3-8B's head_dim 128, GQA 4; d256's head_dim 256, GQA 2), for checking the scripts on a CPU."""
    full = SHAPES[shape](layers)
    group = full.num_attention_heads // full.num_key_value_heads
    return LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=1024, num_hidden_layers=layers,
                       num_attention_heads=2 * group, num_key_value_heads=2, head_dim=full.head_dim)


def attention_shape(shape: str) -> tuple[int, int, int, float]:
    """:data:`SHAPES` ``shape``'s attention: (query heads, KV heads, head_dim, rope theta)."""
    config = SHAPES[shape](1)
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]  # where transformers keeps it
    return config.num_attention_heads, config.num_key_value_heads, config.head_dim, float(theta)


def random_model(config: LlamaConfig, device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.config._attn_implementation = "sdpa"
    return model.eval()
