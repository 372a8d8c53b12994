"""``kvweave train``: the router fit, the gates, the collection on a random model, the weights file, errors."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import transformers

from kvweave.core.errors import KvweaveError
from kvweave.engine.generation import cache_kwargs
from kvweave.engine.pipeline import build_cache
from kvweave.core.registry import load_pipeline, load_registry
from kvweave.core.trainable import TrainableRouter, missing_members
from kvweave.tools.router_fit import Sample, auc, evaluate, fit_logistic, gate_terms, gates_from, top_fraction
from kvweave.tools.training import (
    TrainingError,
    add_train_command,
    check_pipeline,
    collect_sample,
    read_text,
    record_forward,
    token_windows,
    train,
    write_json_atomic,
)
from kvweave.plugins.routers.sigmoid_multilevel import FEATURES, SigmoidMultilevelRouter, load_weights

VOCAB = 128


class ToyTokenizer:
    """What the delimiter feature asks of a tokenizer (every tenth id is a full stop), plus encoding:
    one id per character."""

    all_special_ids = [0]

    def __len__(self) -> int:
        return VOCAB

    def decode(self, ids: list[int]) -> str:
        return "." if ids[0] % 10 == 0 else "a"

    def __call__(self, text: str, **kwargs) -> dict:
        return {"input_ids": [ord(c) % VOCAB for c in text]}


@pytest.fixture(scope="module")
def model() -> transformers.LlamaForCausalLM:
    """A random Llama with head_dim 64 (so depthweave-kv's 8.5x budget is reachable), 4 layers, 2 KV heads."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def trained(model) -> dict:
    generator = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, VOCAB, (192,), generator=generator) for _ in range(2)]
    return train(model, ToyTokenizer(), load_pipeline("depthweave-kv"), windows, steps=30, progress=False)


def test_the_fit_separates_a_label_that_depends_on_one_feature():
    generator = torch.Generator().manual_seed(0)
    phi = torch.rand(4000, len(FEATURES), generator=generator)
    target = (phi[:, 2] + 0.05 * torch.randn(4000, generator=generator) > 0.75).float()
    u, bias = fit_logistic(phi[:3000], target[:3000], steps=300, init=([1.5, 2.0, 1.5, 4.0, 3.0], -2.0))
    scores = phi[3000:] @ torch.tensor(u) + bias
    assert auc(scores, target[3000:]) > 0.9
    assert u[2] == max(u)


def test_auc_and_top_fraction():
    assert auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0.0, 0.0, 1.0, 1.0])) == 1.0
    assert auc(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])) == 0.5  # ties count half
    chosen = top_fraction(torch.tensor([1.0, 5.0, 3.0, 2.0, 9.0, 8.0, 7.0, 6.0]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    assert chosen.tolist() == [0, 1, 0, 0, 1, 0, 0, 0]


def test_gates_are_one_for_exact_residuals_and_zero_for_orthogonal_noise():
    generator = torch.Generator().manual_seed(0)
    exact = torch.randn(1, 3, 50, 8, generator=generator)
    without = exact.clone()
    without[..., :4] = 0  # what the coefficients miss lives in channels 0..3
    noise = torch.zeros_like(exact)
    noise[..., 4:] = torch.randn(1, 3, 50, 4, generator=generator)  # orthogonal to the error
    assert torch.allclose(gates_from(*gate_terms(exact, without, exact)), torch.ones(3))
    assert torch.allclose(gates_from(*gate_terms(exact, without, without + noise)), torch.zeros(3))
    half = gates_from(*gate_terms(exact, without, without + 2 * (exact - without)))
    assert torch.allclose(half, torch.full((3,), 0.5))
    backwards = gates_from(*gate_terms(exact, without, without - (exact - without)))
    assert torch.equal(backwards, torch.zeros(3))  # clamped to [0, 1]
    assert gates_from(torch.zeros(2), torch.zeros(2)).tolist() == [1.0, 1.0]  # no residual seen


def test_collection_records_every_compressed_token_of_every_layer(model):
    pipeline = load_pipeline("depthweave-kv")
    sample = collect_sample(model, pipeline, torch.arange(192) % VOCAB, ToyTokenizer())
    settings = pipeline.settings
    packed = (192 - settings.recent_window) // settings.block_tokens * settings.block_tokens
    assert sample.phi.shape == (2 * 4 * 2 * packed, len(FEATURES))  # kinds x layers x KV heads x tokens
    assert torch.isfinite(sample.phi).all()
    assert sample.target.mean().item() == pytest.approx(0.25, abs=0.01)
    assert sample.numerator.shape == sample.denominator.shape == (2, 4, 2)
    assert (sample.denominator > 0).all()  # every token got a residual


def test_the_recorded_vectors_are_the_exact_keys_and_values_of_a_dynamic_cache(model):
    ids = (torch.arange(192) * 7) % VOCAB
    cache, recorder = record_forward(model, load_pipeline("depthweave-kv"), ids, ToyTokenizer())
    assert cache.engine.router is recorder  # swapped in through the engine's replace_router
    reference = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids.reshape(1, -1), use_cache=True, **cache_kwargs(model, reference))
    for block in recorder.blocks:
        for member, layer in enumerate(block["layers"]):
            exact = getattr(reference.layers[layer], block["kind"])
            packed = block["vectors"].shape[-2]
            assert torch.allclose(block["vectors"][member], exact[..., :packed, :].float(), atol=1e-5)
    assert {block["kind"] for block in recorder.blocks} == {"keys", "values"}


def test_training_writes_a_file_the_router_loads_and_a_pipeline_resolves(trained, tmp_path, model):
    gates = trained["gates"]
    assert len(gates["keys"]) == len(gates["values"]) == 4 and all(len(row) == 2 for row in gates["keys"])
    assert all(0.0 <= g <= 1.0 for kind in gates.values() for row in kind for g in row)
    assert trained["levels"] == [0, 2, 4, 8] and set(trained["heldout"]) >= {"trained_auc", "default_auc"}
    path = tmp_path / "weights.json"
    write_json_atomic(path, trained)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left
    assert path.stat().st_mode & 0o044  # readable by others, as any file the umask allows (mkstemp makes 0600)
    assert load_weights(str(path))["u"] == trained["u"]
    registry = tmp_path / "registry.toml"
    registry.write_text(f'[pipelines.mine]\nextends = "depthweave-kv"\n\n[pipelines.mine.router]\nweights = "{path}"\n')
    pipeline = load_registry(registry).resolve("mine")
    router = pipeline.component("router")
    assert isinstance(router, SigmoidMultilevelRouter)
    assert router.gates(3, "values").tolist() == pytest.approx(gates["values"][3])
    cache = build_cache(pipeline, model, tokenizer=ToyTokenizer())
    with torch.no_grad():
        model(input_ids=torch.arange(160).reshape(1, -1) % VOCAB, use_cache=True, **cache_kwargs(model, cache))
    assert cache.get_seq_length() == 160


def test_evaluation_compares_against_the_default_weights(trained):
    held = trained["heldout"]
    assert 0.0 <= held["trained_auc"] <= 1.0 and 0.0 <= held["default_auc"] <= 1.0
    assert 0.0 <= held["trained_accuracy"] <= 1.0 and held["rows"] > 0


def test_the_sigmoid_multilevel_router_is_trainable():
    router = SigmoidMultilevelRouter()
    assert isinstance(router, TrainableRouter) and missing_members(router) == []
    assert router.feature_names() == FEATURES and len(router.initial_weights()[0]) == len(FEATURES)


def test_missing_members_names_what_a_router_lacks():
    class Half:
        def features(self, block):
            return torch.zeros(1)

    assert missing_members(Half()) == ["feature_names", "initial_weights"]
    assert not isinstance(Half(), TrainableRouter)


def test_a_pipeline_whose_router_is_not_trainable_is_refused():
    with pytest.raises(TrainingError, match=r"pipeline 'int4-outliers' routes with 'uniform' \(UniformRouter\).*TrainableRouter "
                                            r"\(missing: feature_names, features, initial_weights\)"):
        check_pipeline(load_pipeline("int4-outliers"))
    with pytest.raises(TrainingError, match="attention statistics"):
        check_pipeline(load_pipeline("depthweave-kv-no-router"))


def _args(tmp_path, **overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_command(parser.add_subparsers())
    args = parser.parse_args(["train", "--out", str(tmp_path / "w.json")])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def test_command_errors_come_before_any_model_is_loaded(tmp_path):
    args = _args(tmp_path, pipeline="int4")
    with pytest.raises(KvweaveError, match="routes with 'uniform'"):
        args.func(args)
    args = _args(tmp_path, text_file=str(tmp_path / "missing.txt"))
    with pytest.raises(TrainingError, match="missing.txt does not exist"):
        args.func(args)
    args = _args(tmp_path, tokens=64)
    with pytest.raises(TrainingError, match="compresses nothing"):
        args.func(args)
    args = _args(tmp_path, samples=1)
    with pytest.raises(TrainingError, match="--samples must be at least 2"):
        args.func(args)


def test_text_files_and_windows(tmp_path):
    plain = tmp_path / "essay.txt"
    plain.write_text("abcdefghij" * 40)
    assert read_text(plain) == "abcdefghij" * 40
    data = tmp_path / "essays.json"
    data.write_text(json.dumps({"text": "hello world"}))
    assert read_text(data) == "hello world"
    (tmp_path / "bad.json").write_text(json.dumps({"title": "no text"}))
    with pytest.raises(TrainingError, match="no 'text'"):
        read_text(tmp_path / "bad.json")
    windows = token_windows(read_text(plain), ToyTokenizer(), samples=4, tokens=50, seed=3)
    assert [w.numel() for w in windows] == [50] * 4
    with pytest.raises(TrainingError, match="too short"):
        token_windows("short text", ToyTokenizer(), samples=2, tokens=50)


def test_evaluate_scores_a_perfect_router_at_one():
    phi = torch.zeros(8, len(FEATURES))
    phi[:, 0] = torch.arange(8.0)
    sample = Sample(phi, top_fraction(phi[:, 0], torch.zeros(8)), torch.zeros(8), torch.zeros(1), torch.zeros(1))
    result = evaluate(sample, [1.0, 0, 0, 0, 0], 0.0)
    assert result == {"auc": 1.0, "accuracy": 1.0}
