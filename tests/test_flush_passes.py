"""A flush's steps done for a basis group at once, and the host reads they leave out.

The attention-output probe measures every layer of a group in one pass, without joining the block's keys to the
window's; the group's residual entries are encoded by one call and split by the counts one host read gives; residuals
on a basis are added back by one product with a dense table of coordinates; ``sketch-ema`` keeps host copies of its
counters. Each is checked against the computation it replaces, written out here (the ``head-mode`` router's lambda:
tests/test_head_mode_lambda.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvweave.core.errors import ComponentError
from kvweave.engine.encoder import BlockEncoder
from kvweave.engine.residuals import add_residuals, encode_residuals, fit_residual_basis
from kvweave.plugins.bases.sketch_ema import SketchEmaBasis
from kvweave.plugins.probes.attention_output import AttentionOutputProbe
from kvweave.plugins.quantizers.int4_group import Int4GroupQuantizer

from test_graphs_warm import _HostReads


def _joined_attention(queries, keys, values, scale):
    """Causal attention of the last q positions over keys [B, H, T, D], the query heads of a KV head one after another."""
    batch, q_heads, observed, dim = queries.shape
    heads, total = keys.shape[1], keys.shape[2]
    out = torch.empty(batch, heads, q_heads // heads * observed, dim)
    for b in range(batch):
        for h in range(heads):
            for g in range(q_heads // heads):
                for i in range(observed):
                    visible = total - observed + i + 1
                    weights = (queries[b, h * (q_heads // heads) + g, i] @ keys[b, h, :visible].T * scale).softmax(-1)
                    out[b, h, g * observed + i] = weights @ values[b, h, :visible]
    return out


def test_the_probe_measures_each_layer_of_a_group_as_attention_over_the_joined_block_and_window():
    gen = torch.Generator().manual_seed(3)
    layers, batch, q_heads, heads, observed, n, m, dim = 3, 2, 4, 2, 3, 11, 5, 8
    queries = torch.randn(layers, batch, q_heads, observed, dim, generator=gen)
    keys, values = (torch.randn(layers, batch, heads, n, dim, generator=gen) for _ in range(2))
    approx_keys, approx_values = keys + 0.3 * torch.randn_like(keys), values + 0.2 * torch.randn_like(values)
    context_keys, context_values = (torch.randn(layers, batch, heads, m, dim, generator=gen) for _ in range(2))
    probe = AttentionOutputProbe()
    scale = 0.3
    errors = probe.measure_group(queries, keys, values, approx_keys, approx_values, context_keys, context_values, scale)
    assert errors.shape == (layers, heads)
    for g in range(layers):
        exact = _joined_attention(queries[g], torch.cat((keys[g], context_keys[g]), -2), torch.cat((values[g], context_values[g]), -2), scale)
        approx = _joined_attention(queries[g], torch.cat((approx_keys[g], context_keys[g]), -2), torch.cat((approx_values[g], context_values[g]), -2), scale)
        expected = ((exact - approx).flatten(2).norm(dim=-1) / (exact.flatten(2).norm(dim=-1) + 1e-6)).mean(0)
        assert torch.allclose(errors[g], expected, atol=1e-5), (g, errors[g], expected)
        single = probe.measure(queries[g], keys[g], values[g], approx_keys[g], approx_values[g], context_keys[g], context_values[g], scale)
        assert torch.allclose(single, errors[g], atol=1e-6)
    assert bool((errors > 0.01).all())


def test_residuals_on_a_basis_added_by_one_product_equal_each_entrys_own_directions():
    gen = torch.Generator().manual_seed(4)
    batch, heads, tokens, dim = 2, 3, 40, 16
    missing = torch.randn(batch, heads, tokens, dim, generator=gen)
    basis = fit_residual_basis(missing, 8)
    ranks = torch.tensor([0, 2, 4, 8])[torch.randint(0, 4, (batch, heads, tokens), generator=gen)]
    quantizer = Int4GroupQuantizer(group=2)
    entries = encode_residuals(missing, ranks, quantizer, basis)
    assert set(entries) == {2, 4, 8}
    gates = torch.tensor([1.0, 0.5, 0.25])
    start = torch.randn(batch, heads, tokens, dim, generator=gen)
    added = add_residuals(start, entries, quantizer, gates, basis, weight=0.5)
    expected = start.clone()
    for rank, fields in entries.items():
        values = quantizer.dequantize({k[2:]: t for k, t in fields.items() if k.startswith("q_")}, torch.float32)
        for i, (row, token) in enumerate(zip(fields["row"].tolist(), fields["token"].tolist())):
            b, h = divmod(row, heads)
            expected[b, h, token] += 0.5 * gates[h] * values[i] @ basis[b, h, :rank].float()
    assert torch.allclose(added, expected, atol=1e-5)
    untouched = ranks == 0
    assert torch.equal(added[untouched], start[untouched])


def _encoder(bases, levels=(0, 2, 4, 8), router="r-test"):
    windows = [SimpleNamespace(residual_basis={"keys": b}) for b in bases]
    engine = SimpleNamespace(windows=windows, levels=list(levels), pipeline=SimpleNamespace(use=lambda slot: router))
    return BlockEncoder(engine)  # type: ignore[arg-type]


@pytest.mark.parametrize("on_basis", [True, False])
def test_a_groups_residuals_encoded_in_one_call_are_each_members_own(on_basis):
    gen = torch.Generator().manual_seed(5)
    group, batch, heads, tokens, dim = 3, 2, 2, 24, 16
    missing = torch.randn(group, batch, heads, tokens, dim, generator=gen).to(torch.bfloat16)
    ranks = torch.tensor([0, 2, 4, 8])[torch.randint(0, 4, (group, batch, heads, tokens), generator=gen)]
    ranks[1] = 0  # a member without entries
    ranks[2, :, :, :5] = 8
    ranks[2, 0, 1, 23] = 8  # member 2's rank-8 entries end with the block
    bases = [fit_residual_basis(missing[g].float(), 8) if on_basis else None for g in range(group)]
    encoder = _encoder(bases)
    counts, ends = encoder.rank_counts(ranks, ranks.shape)
    assert counts == [{r: int((ranks[g] == r).sum()) for r in (2, 4, 8) if int((ranks[g] == r).sum())} for g in range(group)]
    assert ends == [{r: int((ranks[g] == r).nonzero()[:, -1].max()) + 1 for r in counts[g]} for g in range(group)]
    assert ends[2][8] == 24 and counts[1] == {}
    quantizer = Int4GroupQuantizer(group=2)
    joint = encoder.encode_members("keys", (0, 1, 2), missing, ranks, counts, quantizer)
    for g in range(group):
        own = encode_residuals(missing[g], ranks[g], quantizer, bases[g])
        assert joint[g].keys() == own.keys()
        for rank in own:
            assert joint[g][rank].keys() == own[rank].keys()
            for name, tensor in own[rank].items():
                assert torch.equal(joint[g][rank][name], tensor), (g, rank, name)
                assert joint[g][rank][name].untyped_storage().nbytes() == tensor.untyped_storage().nbytes()  # no shared storage kept


def test_ranks_outside_the_levels_or_of_the_wrong_shape_are_refused_naming_the_router():
    encoder = _encoder([None])
    ranks = torch.tensor([[[[0, 2, 3, 8]]]])
    with pytest.raises(ComponentError, match=r"router 'r-test' returned ranks \[3\]; expected values in \[0, 2, 4, 8\]"):
        encoder.rank_counts(ranks, ranks.shape)
    with pytest.raises(ComponentError, match=r"shaped \(1, 1, 1, 4\); expected \(1, 1, 4\)"):
        encoder.rank_counts(ranks, torch.Size((1, 1, 4)))
    with pytest.raises(ComponentError, match=r"returned ranks \[16\]"):  # above the largest level
        encoder.rank_counts(torch.tensor([[[[16]]]]), torch.Size((1, 1, 1, 1)))


def test_sketch_ema_encodes_and_decodes_from_its_host_copies_with_no_host_read():
    basis = SketchEmaBasis(window=3, rank=4, update_every=2, ema=0.5)
    gen = torch.Generator().manual_seed(6)
    blocks = [torch.randn(3, 2, 2, 8, 8, generator=gen) for _ in range(5)]
    state = basis.init_state(blocks[0])
    coefficients = []
    with _HostReads() as reads:
        for block in blocks:  # a new version every 2 blocks
            coefficients.append(basis.encode(state, block))
        joined = torch.cat(coefficients, dim=-2)
        decoded = [basis.decode(state, joined, m) for m in range(3)]
    assert not reads.sites, dict(reads.sites)
    assert state["bases"].shape[2] == 3 and state["version_tokens"][0].tolist() == [16, 16, 8]
    # the device's counters are what decoding follows: each version's tokens through their own basis
    width = 8
    for m in range(3):
        expected = torch.cat([joined[0, ..., 16 * v : 16 * (v + 1), :] @ state["bases"][:, :, v, :, m * width : (m + 1) * width].float() for v in range(3)], -2)
        assert torch.allclose(decoded[m], expected, atol=1e-5)
    # a batch selection makes new tensors: their counters are read once, then held
    picked = {name: t.index_select(0, torch.tensor([1])) for name, t in state.items()}
    again = basis.decode(picked, joined[:, 1:], 2)
    assert torch.allclose(again, decoded[2][1:], atol=1e-6)


@pytest.mark.parametrize("share", ["token-factor", "basis"])
def test_a_group_decoded_at_once_is_each_layer_decoded_alone(share):
    basis = SketchEmaBasis(window=3, rank=4, update_every=1, ema=0.5, share=share)
    gen = torch.Generator().manual_seed(7)
    blocks = [torch.randn(3, 2, 2, 8, 8, generator=gen) for _ in range(3)]
    state = basis.init_state(blocks[0])
    joined = torch.cat([basis.encode(state, block) for block in blocks], dim=-2)  # three versions
    assert state["bases"].shape[2] == 3
    for start in (0, 5):  # tokens from the middle of the first version on
        part = joined[..., start:, :]
        together = basis.decode_group(state, part, 3, start=start)
        alone = torch.stack([basis.decode(state, part, m, start=start) for m in range(3)])
        assert together.shape == (3, 2, 2, 24 - start, 8) and together.is_contiguous()
        assert torch.allclose(together, alone, atol=1e-6)


def test_the_prefill_probe_picks_its_positions_with_a_fixed_number_of_host_reads():
    from kvweave.plugins.probes.prefill_logit import PrefillLogitProbe

    gen = torch.Generator().manual_seed(8)
    reads = []
    for picks in (16, 96):  # many more candidates walked: no more reads
        probe = PrefillLogitProbe(queries=picks, recent=0.25, boundaries=0.25, candidates=256)
        query, keys = torch.randn(2, 4, 300, 8, generator=gen), torch.randn(2, 2, 300, 8, generator=gen)
        boundary = torch.zeros(2, 300)
        boundary[0, [10, 50, 90]] = 1
        boundary[1, [20, 280]] = 1
        with _HostReads(twins=()) as counter:
            picked = probe.select_queries(query, keys, boundary, None)
        reads.append(sum(counter.sites.values()))
        assert picked.shape == (2, picks) and all(len(set(row)) == picks for row in picked.tolist())
        assert {10, 50, 90} <= set(picked[0].tolist()) and {20, 280} <= set(picked[1].tolist())
    # the entropy order and the flags (3 reads), and per row the spread of its flags (a CPU tensor: 2 reads)
    assert reads[0] == reads[1] <= 3 + 2 * 2, reads


def test_a_long_blocks_probe_taken_a_few_layers_at_a_time_measures_the_same(monkeypatch):
    import kvweave.engine.encoder as encoder_module
    from conftest import tiny_llama
    from helpers import build_test_cache, random_ids, run

    def errors():
        model = tiny_llama(torch.float32, layers=4, hidden=256)
        cache = run(model, build_test_cache("t-dw", model), random_ids(2, 600, seed=1), decode=40)
        return [group[kind].probe_error for group in cache.engine.stores for kind in ("keys", "values")], cache.compression_ratio()

    together, ratio = errors()
    monkeypatch.setattr(encoder_module, "PROBE_BYTES", 1)  # one layer at a time
    apart, ratio_apart = errors()
    assert ratio == ratio_apart
    assert all(a.shape == b.shape and torch.allclose(a, b, atol=1e-6) for a, b in zip(together, apart))
    assert any(bool((a > 0).any()) for a in together)


class _Products(torch.overrides.TorchFunctionMode):
    """Counts the matrix products run inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("matmul", "__matmul__", "bmm", "mm", "einsum"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _probe_case(seed=5):
    gen = torch.Generator().manual_seed(seed)
    layers, batch, q_heads, heads, observed, n, m, dim = 2, 2, 4, 2, 3, 13, 6, 8
    queries = torch.randn(layers, batch, q_heads, observed, dim, generator=gen)
    keys, values = (torch.randn(layers, batch, heads, n, dim, generator=gen) for _ in range(2))
    approx_keys, approx_values = keys + 0.3 * torch.randn_like(keys), values + 0.2 * torch.randn_like(values)
    context = tuple(torch.randn(layers, batch, heads, m, dim, generator=gen) for _ in range(2))
    return queries, keys, values, approx_keys, approx_values, context


@pytest.mark.parametrize("keep", ["weights", "normalizers"])
def test_the_values_probe_takes_the_keys_probes_products_and_measures_the_same(monkeypatch, keep):
    import kvweave.plugins.probes.attention_output as probe_module

    if keep == "normalizers":  # weights past the limit: the values' measurement recomputes the block's logits
        monkeypatch.setattr(probe_module, "KEEP_WEIGHTS_BYTES", 0)
    queries, keys, values, approx_keys, approx_values, context = _probe_case()
    probe, scale = AttentionOutputProbe(), 0.3
    shared: dict = {}
    keys_error = probe.measure_group(queries, keys, values, approx_keys, values, *context, scale, shared=shared)
    assert ("weights" in shared) == (keep == "weights")
    assert torch.allclose(keys_error, probe.measure_group(queries, keys, values, approx_keys, values, *context, scale))
    with _Products() as products:
        values_error = probe.measure_group(queries, keys, values, keys, approx_values, *context, scale, shared=shared)
    assert products.count == (1 if keep == "weights" else 2)  # the block's difference (and its logits)
    for g in range(queries.shape[0]):  # against attention over the joined keys and values, written out
        joined_keys = torch.cat((keys[g], context[0][g]), -2)
        exact = _joined_attention(queries[g], joined_keys, torch.cat((values[g], context[1][g]), -2), scale)
        approx = _joined_attention(queries[g], joined_keys, torch.cat((approx_values[g], context[1][g]), -2), scale)
        expected = ((exact - approx).flatten(2).norm(dim=-1) / (exact.flatten(2).norm(dim=-1) + 1e-6)).mean(0)
        assert torch.allclose(values_error[g], expected, atol=1e-5), (g, values_error[g], expected)
    with _Products() as products:
        alone = probe.measure_group(queries, keys, values, keys, approx_values, *context, scale)
    assert products.count > 2 and torch.allclose(alone, values_error, atol=1e-6)
    assert bool((values_error > 0.01).all())


@pytest.mark.parametrize("keep", ["weights", "normalizers"])
def test_the_values_probe_needs_no_keys_where_the_keys_probe_kept_their_weights(monkeypatch, keep):
    """``reads_other``: false for the values' measurement where the keys' one kept the block's weights, and then the
    values' measurement without the keys (None) is the one with them; where only normalizers were kept it needs the
    keys, and refuses to measure without them."""
    import kvweave.plugins.probes.attention_output as probe_module

    if keep == "normalizers":
        monkeypatch.setattr(probe_module, "KEEP_WEIGHTS_BYTES", 0)
    queries, keys, values, approx_keys, approx_values, context = _probe_case()
    probe, shared = AttentionOutputProbe(), {}
    assert probe.reads_other("keys", None) and probe.reads_other("values", None)
    probe.measure_group(queries, keys, values, approx_keys, values, *context, 0.3, shared=shared)
    assert probe.reads_other("keys", shared) and probe.reads_other("values", shared) == (keep == "normalizers")
    with_keys = probe.measure_group(queries, keys, values, keys, approx_values, *context, 0.3, shared=dict(shared))
    if keep == "weights":
        assert torch.equal(probe.measure_group(queries, None, values, None, approx_values, *context, 0.3, shared=shared),
                           with_keys)
    else:
        with pytest.raises(ValueError, match="without the keys needs the block's weights"):
            probe.measure_group(queries, None, values, None, approx_values, *context, 0.3, shared=shared)


def test_products_shared_from_a_block_of_other_shapes_are_refused():
    queries, keys, values, approx_keys, approx_values, context = _probe_case()
    probe, shared = AttentionOutputProbe(), {}
    probe.measure_group(queries, keys, values, approx_keys, values, *context, 0.3, shared=shared)
    shorter = keys[..., :-1, :]
    with pytest.raises(ValueError, match="attention-output.*made for shapes"):
        probe.measure_group(queries, shorter, values[..., :-1, :], shorter, approx_values[..., :-1, :], *context, 0.3, shared=shared)


def test_a_flushs_values_probe_reuses_its_keys_probes_products_and_measures_what_it_measured_alone(monkeypatch):
    from conftest import tiny_llama
    from helpers import build_test_cache, random_ids, run

    handed = []
    measure_group = AttentionOutputProbe.measure_group

    def watched(self, *args, shared=None, **kwargs):
        handed.append(None if shared is None else dict(shared))
        return measure_group(self, *args, shared=shared, **kwargs)

    def errors():
        model = tiny_llama(torch.float32, layers=4, hidden=256)
        cache = run(model, build_test_cache("t-dw", model), random_ids(2, 600, seed=1), decode=40)
        return [group[kind].probe_error for group in cache.engine.stores for kind in ("keys", "values")]

    monkeypatch.setattr(AttentionOutputProbe, "measure_group", watched)
    sharing = errors()
    assert handed and handed[0] == {}  # the keys' measurement gets an empty dict, the values' one what it left
    assert all(a == {} and "weights" in b for a, b in zip(handed[::2], handed[1::2]))
    monkeypatch.setattr(AttentionOutputProbe, "shares_products", False)
    handed.clear()
    alone = errors()
    assert handed and all(h is None for h in handed)
    assert all(a.shape == b.shape and torch.allclose(a, b, atol=1e-5) for a, b in zip(sharing, alone))
    assert any(bool((a > 0).any()) for a in sharing)


@pytest.mark.parametrize("name", ["t-dw", "h2o-probed"])
def test_a_blocks_keys_and_values_probes_see_the_same_exact_block_and_context(monkeypatch, tmp_path, name):
    """Both measurements of a block take its exact keys and values from one place, also where the kept tokens are
    re-selected (H2O), so what the keys' measurement leaves holds for the values'."""
    from conftest import tiny_llama
    from helpers import TEST_PIPELINES, ToyTokenizer, random_ids, run

    from kvweave.core.registry import load_pipeline
    from kvweave.engine import build_cache

    registry = tmp_path / "probed.toml"
    registry.write_text('[pipelines.h2o-probed]\nextends = "h2o"\nrecent_window = 8\nobserve_queries = 4\n'
                        '[pipelines.h2o-probed.evictor]\nuse = "h2o"\nbudget = 20\n'
                        '[pipelines.h2o-probed.quantizer]\nuse = "int8-block"\nblock = 16\n'
                        '[pipelines.h2o-probed.probe]\nuse = "attention-output"\n')
    seen = []
    measure_group = AttentionOutputProbe.measure_group

    def watched(self, queries, keys, values, approx_keys, approx_values, context_keys, context_values, scale=None, shared=None):
        # the values' measurement may come without the keys (reads_other: the keys' measurement kept their weights)
        seen.append((approx_keys is keys, None if keys is None else keys.clone(), values.clone(), context_keys.clone(),
                     context_values.clone()))
        return measure_group(self, queries, keys, values, approx_keys, approx_values, context_keys, context_values, scale, shared=shared)

    monkeypatch.setattr(AttentionOutputProbe, "measure_group", watched)
    model = tiny_llama(torch.float32, layers=2, hidden=256)
    pipeline = load_pipeline(name, registry if name == "h2o-probed" else TEST_PIPELINES)
    run(model, build_cache(pipeline, model, tokenizer=ToyTokenizer()), random_ids(1, 120, seed=2), decode=30)
    assert len(seen) >= 4 and [s[0] for s in seen[:2]] == [False, True]
    for keys_call, values_call in zip(seen[::2], seen[1::2]):
        assert not keys_call[0] and values_call[0]
        assert all(b is None and a is keys_call[1] or torch.equal(a, b) for a, b in zip(keys_call[1:], values_call[1:]))
    assert any(call[1] is None for call in seen[1::2]) == (name == "t-dw")  # H2O's re-selected blocks take no reuse
