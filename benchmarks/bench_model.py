"""The benchmarks' model: a Llama-3-8B-shaped model with random bf16 weights (speed does not depend on the weights), a
tiny one of the same head shape for checking the scripts on a CPU, and a stand-in tokenizer for random token ids."""

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


def smoke_config(layers: int) -> LlamaConfig:
    """A tiny model of the Llama-3-8B head shape (head_dim 128, GQA 4), for checking the scripts on a CPU."""
    return LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=1024, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=128)


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
