"""The contract every registered component must keep, checked on every component of every group.

The components come from :func:`kvweave.core.plugins.catalog`, so a newly registered one (built-in or a
third-party plugin installed here) runs through the same checks without editing this file. Each is built
with its default parameters through :func:`kvweave.core.plugins.build_component` (or with the parameters
a built-in pipeline gives it, when the defaults are not enough) and shown a model of shape :data:`SHAPE`
first (``check_model``).

A check a component legitimately cannot run is skipped with its reason in :data:`SKIPS` (never
silently); ``test_every_skip_is_still_needed`` fails when a listed component could run the check after
all. The pipelines built from them are checked in test_contract_pipelines.py.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import pytest
import torch

from kvweave.core import plugins
from kvweave.core.errors import ComponentError
from kvweave.core.evictor import EvictionBlock, Evictor
from kvweave.core.groups import GROUP_INTERFACES, SLOT_GROUPS
from kvweave.core.interfaces import KINDS, AttentionKernel, ModelShape, Probe, RouteBlock
from kvweave.core.registry import load_registry
from kvweave.core.storage import tensor_bytes

#: the model every component is shown: small, with grouped queries, and a head_dim every built-in takes
SHAPE = ModelShape(num_layers=4, num_query_heads=4, num_kv_heads=2, head_dim=64)
B, N = 2, 24  # batch rows and tokens of the synthetic blocks

CATALOG = plugins.catalog()
COMPONENTS = [(info.group, info.name) for info in CATALOG.iter_components()]


def _of(group: str) -> list[str]:
    return [name for g, name in COMPONENTS if g == group]


def _ids(pairs: list[tuple[str, str]]) -> list[str]:
    return [f"{group}/{name}" for group, name in pairs]


#: (group, component, check) -> why that component cannot run that check
SKIPS: dict[tuple[str, str, str], str] = {
    ("probes", "none", "measure"): "observes nothing: wants() is always false and measure is Probe's (not implemented)",
    ("probes", "prefill-logit", "measure"): (
        "only picks the query positions (wants() is always false): the head-mode router computes the loss"
    ),
}


def skip_listed(group: str, name: str, check: str) -> None:
    reason = SKIPS.get((group, name, check))
    if reason is not None:
        pytest.skip(f"{group} '{name}' cannot run '{check}': {reason}")


@functools.cache
def registry_params(group: str, name: str) -> dict[str, Any] | None:
    """The parameters the first built-in pipeline that uses ``name`` in a slot of ``group`` gives it."""
    registry = load_registry()
    for pipeline in registry.names():
        resolved = registry.resolve(pipeline)
        for slot, config in resolved.slots.items():
            if SLOT_GROUPS[slot.split(".")[-1]] == group and config.use == name:
                return dict(config.params)
    return None


def build(group: str, name: str) -> Any:
    """``name`` of ``group`` built by the plugin machinery and checked against :data:`SHAPE`."""
    info = CATALOG.get(group, name)
    where = f"contract test, {group} component '{name}'"
    try:
        component = plugins.build_component(info, {}, where)
    except ComponentError:
        params = registry_params(group, name)
        if params is None:
            raise
        component = plugins.build_component(info, params, where)
    component.check_model(SHAPE)
    return component


# ============================================================================================ every component
def test_the_builtin_plugins_all_load():
    assert not [f for f in CATALOG.failures if f.distribution == "kvweave"], CATALOG.failures
    assert set(CATALOG.components) == set(GROUP_INTERFACES)
    assert all(_of(group) for group in GROUP_INTERFACES), "a group without any component"


@pytest.mark.parametrize("group, name", COMPONENTS, ids=_ids(COMPONENTS))
def test_component_is_a_frozen_documented_attrs_class(group, name):
    info = CATALOG.get(group, name)
    cls = info.factory
    component = build(group, name)
    # (not ``component.group``: a parameter named ``group``, as kivi's, shadows the interface's class attribute)
    assert isinstance(component, GROUP_INTERFACES[group])
    assert attrs.has(cls)
    assert (cls.__doc__ or "").strip(), f"{cls.__qualname__} has no docstring"
    for field in attrs.fields(cls):
        if field.init:  # the registry.toml parameters (init=False fields are private state)
            doc = field.metadata.get("doc")
            assert isinstance(doc, str) and doc.strip(), f"parameter '{field.alias}' of {group} '{name}' has no metadata doc"
    first = next((f for f in attrs.fields(cls) if f.init), None)
    target = first.name if first is not None else "anything"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(component, target, getattr(component, target, 1))
    assert build(group, name) == component and hash(build(group, name)) == hash(component)


# ============================================================================================ quantizers
QUANTIZER_CASES = [
    (name, kind, dtype) for name in _of("quantizers") for kind in (None, *KINDS) for dtype in (torch.float32, torch.bfloat16)
]


@pytest.mark.parametrize(
    "name, kind, dtype", QUANTIZER_CASES, ids=[f"{n}-{k or 'any'}-{str(d)[6:]}" for n, k, d in QUANTIZER_CASES]
)
def test_quantizer_round_trip_shapes_and_bytes(name, kind, dtype):
    base = build("quantizers", name)
    quantizer = base if kind is None else base.for_kind(kind)
    assert isinstance(base.packed_format, str) and base.packed_format.strip()
    width = SHAPE.head_dim
    quantizer.check_width(width, "contract test")
    group = quantizer.tokens_per_group()
    assert isinstance(group, int) and group >= 1
    tokens = 2 * group
    torch.manual_seed(0)
    x = (torch.randn(B, SHAPE.num_kv_heads, tokens, width) * torch.linspace(0.2, 4.0, width)).to(dtype)
    packed = quantizer.quantize(x)
    assert isinstance(packed, dict) and packed and all(isinstance(k, str) for k in packed)
    for field, tensor in packed.items():
        assert isinstance(tensor, torch.Tensor), field
        # leading dims are x's; the token axis may be per group of tokens (tokens_per_group > 1)
        assert tensor.shape[:-2] == x.shape[:-2], (field, tuple(tensor.shape))
        assert tensor.shape[-2] in (tokens, tokens // group), (field, tuple(tensor.shape))
        if group == 1:
            assert tensor.shape[:-1] == x.shape[:-1], (field, tuple(tensor.shape))
    restored = quantizer.dequantize(packed, dtype)
    assert restored.shape == x.shape and restored.dtype == dtype
    assert bool(torch.isfinite(restored).all())
    error = float((restored.float() - x.float()).norm() / x.float().norm())
    assert error < 1.0, error  # better than storing nothing
    vectors = x[..., 0].numel()
    assert tensor_bytes(packed.values()) == quantizer.bytes_per_vector(width, dtype) * vectors
    # the cache concatenates packed blocks along the token axis: two halves read back as the whole
    halves = [quantizer.quantize(part) for part in x.split(group, dim=-2)]
    joined = {field: torch.cat([half[field] for half in halves], dim=-2) for field in packed}
    assert torch.equal(quantizer.dequantize(joined, dtype), restored)
    # the first group of tokens' fields, taken from the whole (the encoder reconstructs only the tokens a router may route)
    lead = quantizer.leading_tokens(packed, group, tokens)
    assert lead.keys() == packed.keys()
    for field, tensor in lead.items():
        assert torch.equal(tensor, halves[0][field]), field
    assert torch.equal(quantizer.dequantize(lead, dtype), restored[..., :group, :])


# ============================================================================================ bases
def _block(layers: int, tokens: int = N, seed: int = 0) -> torch.Tensor:
    """x [G, B, H, n, D]: a shared low-rank signal across the layers plus noise."""
    gen = torch.Generator().manual_seed(seed)
    d, h = SHAPE.head_dim, SHAPE.num_kv_heads
    signal = torch.randn(1, B, h, tokens, 4, generator=gen) @ torch.randn(layers, 1, 1, 4, d, generator=gen)
    return signal + 0.3 * torch.randn(layers, B, h, tokens, d, generator=gen)


@pytest.mark.parametrize("name", _of("bases"))
def test_basis_encodes_and_decodes_every_group(name):
    basis = build("bases", name)
    groups = basis.layer_groups(SHAPE)
    assert all(isinstance(g, tuple) and g and all(isinstance(layer, int) for layer in g) for g in groups), groups
    members = [layer for g in groups for layer in g]
    assert sorted(members) == list(range(SHAPE.num_layers)), f"layer_groups {groups} do not partition the layers"
    width = basis.coefficient_width(SHAPE)
    assert isinstance(width, int) and width >= 1
    for index, group in enumerate(groups):
        size = len(group)
        x = _block(size, seed=index)
        state = basis.init_state(x)
        coefficients = basis.encode(state, x)
        assert coefficients.shape == (basis.coefficient_rows(size), B, SHAPE.num_kv_heads, N, width), (group, coefficients.shape)
        assert bool(torch.isfinite(coefficients).all())
        assert all(t.shape[0] == B for t in state.values()), "state tensors keep the batch on dim 0"
        for member in range(size):
            out = basis.decode(state, coefficients, member)
            assert out.shape == (B, SHAPE.num_kv_heads, N, SHAPE.head_dim) and out.dtype == coefficients.dtype
            assert bool(torch.isfinite(out).all())
            tail = basis.decode(state, coefficients[..., 8:, :], member, start=8)  # a later range of the tokens
            assert torch.allclose(tail, out[..., 8:, :], atol=1e-5), (group, member)
            assert basis.decode(state, coefficients.to(torch.bfloat16), member).dtype == torch.bfloat16
            if basis.identity:  # the engine then takes the block as its coefficients without calling encode
                assert coefficients is x and torch.equal(out, x[member]) and not state
        mixing = basis.residual_mixing(size)
        if mixing is not None:
            assert mixing.shape == (size, size) and abs(float(torch.linalg.det(mixing.double()))) > 1e-6
        for member in range(size):
            factors = basis.factor_bases(state, member)
            if factors is None:
                continue
            bases, versions = factors
            assert bases.shape[:2] == (B, SHAPE.num_kv_heads) and bases.shape[-2:] == (width, SHAPE.head_dim)
            assert versions.dtype == torch.int32 and versions.shape == (bases.shape[2],) and int(versions.sum()) == N
            row = member if basis.coefficient_rows(size) == size else 0
            assert bases.shape[2] == 1  # one block encoded: one version, k = c P
            expected = coefficients[row].float() @ bases[:, :, 0].float()
            assert torch.allclose(basis.decode(state, coefficients, member).float(), expected, atol=1e-4)


# ============================================================================================ routers
def route_block(router: Any, kind: str, state: dict, budget: float | None) -> RouteBlock:
    """A synthetic block of 2 layers with every optional field a router may read."""
    gen = torch.Generator().manual_seed(1)
    g, h, d = 2, SHAPE.num_kv_heads, SHAPE.head_dim
    vectors = torch.randn(g, B, h, N, d, generator=gen)
    approx = vectors - 0.3 * torch.randn(g, B, h, N, d, generator=gen)
    misses = vectors - approx
    level_bytes = {level: 8.0 + 2.5 * level for level in router.levels() if level > 0}
    observed = 6
    return RouteBlock(
        layers=(0, 1), kind=kind, vectors=vectors, level_bytes=level_bytes, budget_bytes=budget,
        attention_mass=torch.rand(g, B, h, N, generator=gen), attention_spike=torch.rand(g, B, h, N, generator=gen),
        boundary=(torch.rand(B, N, generator=gen) < 0.2).float(), probe_error=0.1 * torch.rand(g, h, generator=gen),
        miss=misses.norm(dim=-1) / vectors.norm(dim=-1), approx=approx, rows=misses, mixing=None,
        queries=torch.randn(g, B, SHAPE.num_query_heads, observed, d, generator=gen),
        query_positions=torch.arange(N, N + observed, dtype=torch.int32).expand(g, B, observed),
        query_scale=d**-0.5, first=0, state=state,
    )


@pytest.mark.parametrize("name", _of("routers"))
def test_router_levels_and_assignments(name):
    router = build("routers", name)
    levels = router.levels()
    assert isinstance(levels, tuple) and levels and all(isinstance(v, int) for v in levels)
    assert list(levels) == sorted(set(levels)) and levels[0] >= 0 and levels[-1] <= SHAPE.head_dim, levels
    assert isinstance(router.needs_attention, bool) and isinstance(router.needs_boundaries, bool)
    target = router.target_reduction()
    assert target is None or target >= 1.0
    top = max(levels)
    for budget in (None, 0.3 * 2 * B * SHAPE.num_kv_heads * N * (8.0 + 2.5 * top)):
        state: dict = {}
        for kind in KINDS:  # the engine routes a block's keys, then its values with the same state
            block = route_block(router, kind, state, budget)
            ranks = router.assign(block)
            assert ranks.dtype == torch.long and ranks.shape == block.vectors.shape[:-1]
            assert set(ranks.unique().tolist()) <= set(levels)
            if budget is not None and target is not None:  # a budgeted router keeps the block within its bytes
                spent = sum(block.level_bytes[level] * int((ranks == level).sum()) for level in block.level_bytes)
                assert spent <= budget, (kind, spent, budget)
    for layer in range(SHAPE.num_layers):
        for kind in KINDS:
            gates = router.gates(layer, kind)
            if gates is not None:
                assert gates.shape == (SHAPE.num_kv_heads,) and bool(((gates >= 0) & (gates <= 1)).all())


# ============================================================================================ evictors
def eviction_block(forward_tokens: int) -> EvictionBlock:
    """A block of 2 layers leaving an 8-token window; row 1 is left-padded by 4 slots."""
    gen = torch.Generator().manual_seed(2)
    g, h, window = 2, SHAPE.num_kv_heads, 8
    valid = torch.ones(g, B, h, N, dtype=torch.bool)
    valid[:, 1, :, :4] = False
    positions = (valid.long().cumsum(-1) - 1).masked_fill(~valid, -1)
    importance = torch.rand(g, B, h, N + window, generator=gen)  # the scored forward: block, then the window
    return EvictionBlock(
        layers=(0, 1), keys=torch.randn(g, B, h, N, SHAPE.head_dim, generator=gen), valid=valid, positions=positions,
        row_tokens=torch.tensor([N + window, N - 4 + window]), window_tokens=window,
        attention_mass=torch.rand(g, B, h, N, generator=gen), attention_spike=torch.rand(g, B, h, N, generator=gen),
        scores=torch.rand(g, B, h, N, generator=gen), boundary=(torch.rand(B, N, generator=gen) < 0.2).float(),
        stored=0, held=(0, 0), forward_tokens=forward_tokens, shared_tokens=False,
        importance=importance[:, :, :, :N], context_importance=importance,
    )


@pytest.mark.parametrize("name", _of("evictors"))
def test_evictor_keep_is_a_bool_mask_of_the_block(name):
    evictor = build("evictors", name)
    assert isinstance(evictor, Evictor)
    for flag in ("evicts", "needs_attention", "accumulates", "reselects", "needs_importance"):
        assert isinstance(getattr(evictor, flag), bool), flag
    evictor.check_window(8, 1, "contract test")  # the default budget holds an 8-token window
    for forward_tokens in (N + 8, 1):  # a prefill, then one decoding step
        block = eviction_block(forward_tokens)
        keep = evictor.keep(block)
        assert keep.dtype == torch.bool and keep.shape == block.valid.shape, (forward_tokens, keep.dtype, keep.shape)


# ============================================================================================ probes
@pytest.mark.parametrize("name", _of("probes"))
def test_probe_flags_and_budget_share(name):
    probe = build("probes", name)
    for flag in ("needs_queries", "needs_boundaries", "selects_queries"):
        assert isinstance(getattr(probe, flag), bool), flag
    assert all(isinstance(probe.wants(index), bool) for index in range(4))
    share = probe.adjust(1.0, torch.full((2, SHAPE.num_kv_heads), 0.5), {})
    assert isinstance(share, float) and share > 0


@pytest.mark.parametrize("name", _of("probes"))
def test_probe_measures_a_finite_error_per_head(name):
    skip_listed("probes", name, "measure")
    probe = build("probes", name)
    gen = torch.Generator().manual_seed(3)
    d, h = SHAPE.head_dim, SHAPE.num_kv_heads
    queries = torch.randn(1, SHAPE.num_query_heads, 3, d, generator=gen)
    keys, values = torch.randn(1, h, 10, d, generator=gen), torch.randn(1, h, 10, d, generator=gen)
    context = torch.randn(1, h, 5, d, generator=gen), torch.randn(1, h, 5, d, generator=gen)
    noisy = keys + 0.5 * torch.randn(keys.shape, generator=gen)
    error = probe.measure(queries, keys, values, noisy, values, *context)
    assert error.shape == (h,) and bool(torch.isfinite(error).all()) and bool((error >= 0).all())
    assert torch.allclose(probe.measure(queries, keys, values, keys, values, *context), torch.zeros(h), atol=1e-5)


@pytest.mark.parametrize("name", [n for n in _of("probes") if build("probes", n).selects_queries])
def test_probe_selects_distinct_positions_of_the_forward(name):
    probe = build("probes", name)
    gen = torch.Generator().manual_seed(4)
    new, d = 40, SHAPE.head_dim
    query = torch.randn(B, SHAPE.num_query_heads, new, d, generator=gen)
    keys = torch.randn(B, SHAPE.num_kv_heads, new, d, generator=gen)
    boundary = (torch.rand(B, new, generator=gen) < 0.2).float()
    picked = probe.select_queries(query, keys, boundary, None)
    assert picked.dtype == torch.long and picked.dim() == 2 and picked.shape[0] == B and 0 < picked.shape[1] <= new
    assert bool(((picked >= 0) & (picked < new)).all())
    assert all(len(set(row)) == len(row) for row in picked.tolist())


# ============================================================================================ kernels
def written_formats() -> set[str]:
    """The packed formats the registered quantizers write (their own and their keys'/values' quantizers')."""
    formats = set()
    for name in _of("quantizers"):
        quantizer = build("quantizers", name)
        formats |= {quantizer.packed_format, *(quantizer.for_kind(kind).packed_format for kind in KINDS)}
        formats |= set(quantizer.packed_formats)
        if quantizer.packed_formats:  # a class that names its layouts writes one of them
            assert quantizer.packed_format in quantizer.packed_formats, name
    return formats


@pytest.mark.parametrize("name", _of("kernels"))
def test_kernel_declares_what_it_reads(name):
    kernel = build("kernels", name)
    assert isinstance(kernel.materializes, bool)
    for declared in (kernel.coefficient_formats, kernel.residual_formats):
        assert isinstance(declared, tuple) and all(isinstance(f, str) and f for f in declared)
        assert set(declared) <= written_formats(), f"kernel '{name}' reads formats no registered quantizer writes: {declared}"
    if not kernel.materializes:
        assert kernel.coefficient_formats, f"kernel '{name}' reads packed storage but declares no coefficient_formats"
        assert type(kernel).attend is not AttentionKernel.attend, f"kernel '{name}' does not materialize but has no attend"


# ============================================================================================ the skip tables
def test_every_skip_is_still_needed():
    for (group, name, check), reason in SKIPS.items():
        assert (group, name) in COMPONENTS, f"SKIPS names {group} '{name}', which is not registered"
        assert reason.strip()
        component = build(group, name)
        if check == "measure":  # the engine only calls measure when wants() is true
            assert type(component).measure is Probe.measure, f"{name} implements measure now: remove its skip"
            assert not any(component.wants(index) for index in range(16))
        else:
            raise AssertionError(f"SKIPS entry for an unknown check '{check}'")
