"""kvweave.tools.metrics on a tiny random Llama (CPU, seconds): Eq. (3) error, chunked perplexity, needles."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvweave.engine import build_cache
from kvweave.tools import metrics


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def input_ids() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, 128, (1, 400))


@pytest.fixture(scope="module")
def reference(model, input_ids):
    return metrics.reference_pass(model, input_ids, chunk=64)


def test_segments_cover_the_input_once():
    assert metrics.segments(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert metrics.segments(10, 4, prefill=5) == [(0, 5), (5, 9), (9, 10)]


def test_full_pipeline_has_no_attention_output_error(model, input_ids, reference):
    result = metrics.attention_output_error(model, None, "full", input_ids, "cpu", reference=reference)
    assert len(result["per_layer"]) == 2 and len(result["per_head"][0]) == 2
    assert result["mean"] < 1e-5
    assert result["memory_bytes"] > 0


def test_int4_error_is_positive_and_bounded(model, input_ids, reference):
    result = metrics.attention_output_error(model, None, "int4", input_ids, "cpu", reference=reference)
    assert 0 < result["mean"] < 1
    assert all(0 < e < 1 for e in result["per_layer"])
    assert result["memory_bytes"] < result["full_16bit_bytes"]  # tokens were really packed
    again = metrics.attention_output_error(model, None, "int4", input_ids, "cpu")  # own reference pass
    assert again["mean"] == pytest.approx(result["mean"], rel=1e-5)


def test_reference_must_match_the_settings(model, input_ids, reference):
    with pytest.raises(ValueError, match="reference"):
        metrics.attention_output_error(model, None, "full", input_ids, "cpu", chunk=32, reference=reference)


def test_attention_outputs_match_sdpa():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    ours = metrics.attention_outputs(q, k, v, 8**-0.5)  # [1, 2, 2, 5, 8]
    mask = torch.ones(5, 12, dtype=torch.bool).tril(diagonal=12 - 5)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    torch.testing.assert_close(ours.reshape(1, 4, 5, 8), expected)


def test_attention_over_kept_keys_at_their_positions_equals_masking_the_dropped_ones():
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    kept = torch.tensor([[[0, 1, 5, 9, 10, 11], [0, 3, 4, 8, 10, 11]]])  # a different set per KV head
    kept_k, kept_v = (x.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, 8)) for x in (k, v))
    positions = torch.cat((kept[..., :4], torch.full((1, 2, 1), -1), kept[..., 4:]), dim=-1)  # a filler slot too
    filler = torch.randn(1, 2, 1, 8)
    ours = metrics.attention_outputs(q, torch.cat((kept_k[..., :4, :], filler, kept_k[..., 4:, :]), 2),
                                     torch.cat((kept_v[..., :4, :], filler, kept_v[..., 4:, :]), 2), 8**-0.5, positions, total=12)
    dropped = torch.ones(1, 2, 12, dtype=torch.bool).scatter(2, kept, False)
    mask = torch.ones(5, 12, dtype=torch.bool).tril(diagonal=12 - 5) & ~dropped[:, :, None, :]  # [1, 2, 5, 12]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask.repeat_interleave(2, 1))
    torch.testing.assert_close(ours.reshape(1, 4, 5, 8), expected)


def test_an_evicting_pipeline_is_measured_over_what_it_kept(model, input_ids, reference):
    result = metrics.attention_output_error(model, None, "streaming-llm", input_ids, "cpu", reference=reference)
    assert result["breakdown"]["eviction"] > 0 and result["memory_bytes"] < result["full_16bit_bytes"] / 2
    assert 0 < result["mean"] < 1.5 and all(e == e for e in result["per_layer"])  # finite, not NaN


def test_full_perplexity_equals_dynamic_cache(model, input_ids):
    dynamic = metrics.perplexity(model, None, input_ids, 64)
    full = metrics.perplexity(model, build_cache("full", model), input_ids, 64)
    assert full == pytest.approx(dynamic, rel=1e-6)
    assert 1 < dynamic < 1000
    # one forward over everything scores the same tokens
    with torch.inference_mode():
        logits = model(input_ids=input_ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, input_ids[0, 1:])
    assert dynamic == pytest.approx(float(nll.exp()), rel=1e-4)
    int4 = metrics.perplexity(model, build_cache("int4", model), input_ids, 64)
    assert int4 != dynamic and int4 == pytest.approx(dynamic, rel=0.2)


# --------------------------------------------------------------------------------------------- needles
@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on a few sentences (no download); decode(encode(text)) == text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator([HAYSTACK], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe)


HAYSTACK = " ".join(
    f"Sentence {i} says that the {w} of the river changes with the season." for i, w in
    zip(range(400), ["colour", "level", "speed", "sound", "smell"] * 80)
)
NEEDLE = "The secret code for the blue door is 7341."
QUESTION = "What is the secret code for the blue door?"


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("length", [300, 1000])
def test_needle_prompt_places_the_needle_at_depth(tokenizer, depth, length):
    prompt = metrics.needle_prompt(tokenizer, HAYSTACK, NEEDLE, QUESTION, length, depth)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    total = count(prompt)
    assert 0.9 * length <= total <= 1.05 * length
    assert prompt.count(NEEDLE) == 1 and prompt.rstrip().endswith("Answer with the exact value from the text.")
    start = prompt.index(NEEDLE)
    assert prompt[start - 1] in " \n" and prompt[start + len(NEEDLE)] in " \n"  # a sentence of its own
    # the needle's token position within the haystack part (between the instruction and the question)
    intro, tail = count(metrics.PROMPT_INTRO), count(metrics.PROMPT_QUESTION.format(question=QUESTION))
    haystack = total - intro - tail - count(" " + NEEDLE)
    assert abs((count(prompt[:start]) - intro) / haystack - depth) <= 0.1


def test_needle_prompt_rejects_bad_arguments(tokenizer):
    with pytest.raises(ValueError, match="depth"):
        metrics.needle_prompt(tokenizer, HAYSTACK, NEEDLE, QUESTION, 500, 1.5)
    with pytest.raises(ValueError, match="room"):
        metrics.needle_prompt(tokenizer, HAYSTACK, NEEDLE, QUESTION, 10, 0.5)


def test_sentence_boundaries_handle_missing_spaces():
    text = "One.Two! Three? \"Four.\" Five"
    assert metrics.sentence_boundaries(text) == [0, 4, 8, 15, 23, len(text)]


@pytest.mark.parametrize("answer, expected, hit", [
    ("The code is 7341.", "7341", True),
    ("  7,341 ", "7341", True),
    ("THE MAGIC WORD IS PINEAPPLE!", "pineapple", True),
    ("It is   Harbor-Owl.", "harbor owl", True),
    ("harbor\nowl", "Harbor-Owl", True),
    ("The code is 7431.", "7341", False),
    ("", "7341", False),
    ("anything", "", False),
])
def test_needle_hit_ignores_case_and_punctuation(answer, expected, hit):
    assert metrics.needle_hit(answer, expected) is hit


# ------------------------------------------------------------------------------- the benchmark script
def _family_table():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "family_table.py"
    spec = importlib.util.spec_from_file_location("family_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_family_table_bf16_gemm_emulation_and_error_rows(model):
    family = _family_table()
    torch.manual_seed(3)
    config = model.config
    tiny = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128, (1, 20))
    with torch.inference_mode():
        native = tiny(input_ids=ids).logits.float()
        assert family.emulate_bf16_gemm(tiny) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, lm_head
        emulated = tiny(input_ids=ids).logits.float()
    assert emulated.dtype == native.dtype and (emulated - native).abs().max() < 0.05 * native.abs().max()
    rows = [{"pipeline": "broken", "error": "error: the budget cannot be met"}]
    lines = family.table(rows).splitlines()
    assert lines[0].startswith("| pipeline | KV bytes") and "| broken | error: the budget cannot be met |" in lines[2]
