"""Fill a cache with synthetic keys and values, without running a model: for kernel tests and benchmarks
at sizes where a real prompt's prefill would dominate (a 64K-token cache for 64 sequences).

The vectors have the structure cross-layer factorization is built for: per batch row and KV head, a
token factor ``z_t`` [rank] shared by every layer, mixed per layer (``x_{l,t} = z_t A_l``) plus
per-layer noise of relative size ``noise``. Queries for the router and probe are random vectors of the
same scale (as are those a keys quantizer weighing channels by the queries' energy reads), token ids (for a
cache bound to a model that taps them) random. Chunks go through the cache's
own ``update`` and flush (the same code as a prompt), so the stored bytes, basis versions and residual
lists are what a real forward would store for such vectors. An evictor that chooses by context importance
(``kvzip``) gets random scores for the whole fill (its sinks kept, as the evictor keeps them whatever scored them), which then goes in as one chunk (the scores serve the first
forward only): which tokens it keeps changes neither the bytes nor the speed of what is stored, though its
``copying`` layers, which need the model, are not kept whole here.
"""

from __future__ import annotations

from typing import Any

import torch

from kvweave.engine.cache import KVWeaveCache


def _generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def fill_cache(
    cache: KVWeaveCache, batch: int, tokens: int, *, chunk: int = 2048, rank: int = 24, noise: float = 0.3,
    dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", seed: int = 0, progress: Any = None,
    layer_devices: Any = None,
) -> KVWeaveCache:
    """Append ``tokens`` synthetic tokens for ``batch`` rows to every layer of ``cache`` (``chunk`` at a time),
    generated on ``device``; ``layer_devices`` (one per layer, for a model split over devices) places each
    layer's tokens where that layer computes."""
    engine = cache.engine
    shape = engine.shape
    device = torch.device(device)
    gen = _generator(seed, device)
    heads, dim = shape.num_kv_heads, shape.head_dim
    mixing = {
        kind: torch.randn(shape.num_layers, heads, rank, dim, generator=gen, device=device) / rank**0.5
        for kind in ("keys", "values")
    }
    if engine.evicts and engine.eviction.evictor.needs_importance and engine.seq_length(0) == 0:
        cache.set_importance(torch.rand(shape.num_layers, batch, heads, tokens, generator=gen, device=device))
        chunk = tokens
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        factors = {kind: torch.randn(batch, heads, n, rank, generator=gen, device=device) for kind in mixing}
        if engine.observer.tap is not None:  # a bound cache reads delimiter flags from the token ids
            engine.observer.tap.pending = torch.randint(0, 1 << 15, (batch, n), generator=gen, device=device)
        for layer in range(shape.num_layers):
            new = []
            for kind in ("keys", "values"):
                x = torch.einsum("bhnr,hrd->bhnd", factors[kind], mixing[kind][layer])
                x = x + noise * torch.randn(x.shape, generator=gen, device=device)
                new.append(x.to(dtype=dtype, device=layer_devices[layer] if layer_devices else device))
            engine.update(layer, new[0], new[1], materialize=False)
            if engine.own_attention:
                if engine.energy is not None:  # keys weighed by the queries' energy: random queries of the same scale
                    energy_queries = torch.randn(batch, shape.num_query_heads, min(n, 64), dim, generator=gen, device=device)
                    engine.energy.record(layer, energy_queries.to(new[0].device), heads)
                if engine.observer.active:
                    queries = torch.randn(batch, shape.num_query_heads, min(n, engine.observer.keep), dim, generator=gen, device=device)
                    queries = queries.to(dtype=dtype, device=new[0].device)
                    engine.observer.record(layer, queries, dim**-0.5, keys_seen=engine.seq_length(layer))
                engine.returned_keys.pop(layer, None)
                engine.after_attention(layer)
        done += n
        if progress is not None:
            progress(n)
    return cache
