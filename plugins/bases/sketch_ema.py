"""``sketch-ema``: cross-layer low-rank bases from a randomized sketch, updated by an EMA.

The basis of DepthWeave-KV (Córdoba et al., 2026, "DepthWeave-KV: Token-Adaptive Cross-Layer Residual
Factorization for Long-Context KV Cache Compression", arXiv:2607.06523, Eq. (1) and section 3): per
depth window, attention head, and separately for keys and values, a rank-``r`` basis is fitted online
to the window's first compressed block by a randomized low-rank sketch, then updated with an
exponential moving average as more blocks arrive.

Shapes: ``x`` [G, B, H, n, D] (G layers of the window) -> coefficients [S, B, H, n, r] -> the member-th
layer's vectors [B, H, T, D].

Decisions (DESIGN.md, "DepthWeave-KV: how the paper's gaps are closed"):

1. What is shared across depth -- both readings, chosen by ``share``:

   - ``"token-factor"`` (default; the "layer-specific mixing weights" reading, A_{l,h,t} = c_{m,h,t} M_{l,h}):
     per (b, h) the G layers' vectors of a token are stacked along channels, ``Y`` [n, G*D]; the basis
     ``P`` [r, G*D] holds the top-r right singular vectors of ``Y``; one coefficient vector per token is
     shared by the window: ``c = Y P^T`` [1, B, H, n, r] (S = 1). Layer ``l`` decodes
     ``c @ P[:, l*D:(l+1)*D]``, so the column block of ``P`` is that layer's mixing matrix. Needs
     ``r <= G*D`` for the smallest window.
   - ``"basis"`` (Eq. (1) read literally: only the basis B_{m,h} [r, D] is shared): ``B`` is fitted on the
     G*n rows of the window stacked, coefficients ``a_l = x_l B^T`` [G, B, H, n, r] (S = G), layer ``l``
     decodes ``a_l B``. Needs ``r <= D``.

2. EMA updates vs. stored coefficients -- bases are *versioned*, never re-projected. Every
   ``update_every`` encoded blocks (when ``ema > 0``) a new version is appended; a block is encoded with
   the newest version and keeps decoding with it forever, so a token decodes exactly (bitwise) as it did
   when it was encoded. The EMA is one of second-moment matrices: the new basis is the top-r right
   singular vectors of ``[sqrt(ema) diag(sigma_old) P_old ; sqrt(1-ema) diag(sigma_new) P_new]``, where
   ``P_new, sigma_new`` is the top-r sketch of the new block's rows scaled by ``1/sqrt(rows)`` (so the
   singular values are per-row RMS, comparable across block sizes). ``ema = 0`` keeps the first fit.
   The cost is one stored basis version per ``update_every`` blocks.

6. Overlapping windows -- the windows here do not overlap: layers are partitioned into consecutive
   windows ``[0..w-1], [w..2w-1], ...`` (the last may be shorter), and each layer decodes from the one
   window that contains it (the engine requires a partition).

The randomized range finder (Halko et al., 2011) uses a Gaussian test matrix from a CPU
``torch.Generator`` seeded with ``seed + version``, ``oversample`` extra columns and ``power_iterations``
re-orthonormalized power iterations; batched over (B, H). It runs on the rows' Gram matrix ``Y^T Y``
[C, C], formed in one pass over the block (a 16-bit block on a GPU multiplied as it is, its products
summed in float32): the same span as power iterations on the rows, which pass over them ``2 q + 2``
times, then the top eigenvectors within it (Rayleigh-Ritz). A block with fewer rows than the sketch's
columns, or whose Gram steps break down, takes the range finder on the rows (Householder QR and an SVD).

State (one per window and per K/V; batch on dim 0, counted in the cache's bytes):

- ``bases`` float16 [B, H, V, r, C] -- the V versions (C = G*D for token-factor, D for basis). The
  encoder uses exactly these float16 values.
- ``version_tokens`` int32 [B, V] -- tokens of this window encoded with each version (equal rows).
- ``singular_values`` float32 [B, H, r] -- sigma of the newest version (for the EMA).
- ``blocks_since_update`` int32 [B, 1] -- blocks encoded with the newest version.
- ``group_layers`` int32 [B, 1] -- G (token-factor only; to split C into layers when decoding).

``decode(state, coefficients, member, start)`` takes the coefficients of the window's encoded tokens
``start .. start + T`` (in encoding order; all of them when ``start = 0``) and decodes each token with
the version it was encoded with.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import BasisBuilder, ModelShape
from kvweave.core.lazy import torch
from kvweave.core.linalg import tall_gram
from kvweave.core.params import choice, integer, number

from ._sketch import consecutive_windows, ema_subspace, gram_top_right, randomized_top_right

SHARES = ("token-factor", "basis")

#: host copies of a state's small counters (``group_layers``, ``version_tokens``, ``blocks_since_update``: device
#: tensors, so a batch selection or a shard takes them along), read once: a decode step reads the layer count for every
#: layer, a CUDA graph's capture may not read the device at all, and a flush would read the counters for every member.
#: A state's counters are never changed in place (each encode makes new tensors, whose values it records here). Keyed
#: by the tensor's id, with a weak reference that tells a tensor made since at the same address
_HOST: dict[int, tuple[weakref.ref, list[int]]] = {}


def _host(held: torch.Tensor) -> list[int]:
    """Row 0 of the counter ``held`` [B, V] (the same in every batch row), from the host's copy."""
    known = _HOST.get(id(held))
    if known is None or known[0]() is not held:
        known = _remember(held, held[0].tolist())
    return known[1]


def _remember(held: torch.Tensor, values: list[int]) -> tuple[weakref.ref, list[int]]:
    known = (weakref.ref(held, lambda _, key=id(held): _HOST.pop(key, None)), values)
    _HOST[id(held)] = known
    return known


def _group_layers(state: dict[str, torch.Tensor]) -> int:
    """The number of layers whose channels ``state``'s token-factor bases span (``group_layers``)."""
    return _host(state["group_layers"])[0]


def _below_one(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1.0:
        raise ValueError(f"'{attribute.alias}' must be < 1 (a decay in [0, 1)), got {value}")


@attrs.frozen
class SketchEmaBasis(BasisBuilder):
    """Rank-``rank`` bases per window of ``window`` layers, head and K/V; versioned EMA updates."""

    head_sharding: ClassVar[str] = "head-local"
    reads_block: ClassVar[bool] = True

    window: int = attrs.field(default=4, validator=integer(1), metadata={"doc": "layers per depth window (consecutive; the last window may be shorter)"})
    rank: int = attrs.field(default=16, validator=integer(1), metadata={"doc": "r, coefficients per token (per window for token-factor, per layer for basis)"})
    share: str = attrs.field(default="token-factor", validator=choice(SHARES), metadata={"doc": "'token-factor': one coefficient vector per token shared by the window, basis [r, G*D]; 'basis': per-layer coefficients, one basis [r, D] shared by the window"})
    oversample: int = attrs.field(default=8, validator=integer(0), metadata={"doc": "extra columns of the randomized sketch"})
    power_iterations: int = attrs.field(default=2, validator=integer(0, 32), metadata={"doc": "power iterations of the randomized range finder"})
    ema: float = attrs.field(default=0.9, validator=[number(0.0, 1.0), _below_one], metadata={"doc": "EMA decay of the basis in [0, 1); 0 keeps the first fit"})
    update_every: int = attrs.field(default=8, validator=integer(1), metadata={"doc": "encoded blocks between basis versions"})
    seed: int = attrs.field(default=0, validator=integer(0, 2**62), metadata={"doc": "seed of the Gaussian test matrices (version v uses seed + v)"})

    # ------------------------------------------------------------------------------ shape
    def layer_groups(self, shape: ModelShape) -> list[tuple[int, ...]]:
        return consecutive_windows(shape.num_layers, self.window)

    def coefficient_width(self, shape: ModelShape) -> int:
        return self.rank

    def check_model(self, shape: ModelShape) -> None:
        if self.share == "token-factor":
            smallest = min(len(group) for group in self.layer_groups(shape))
            limit, what = smallest * shape.head_dim, f"{smallest} layers x head_dim {shape.head_dim} (smallest window)"
        else:
            limit, what = shape.head_dim, f"head_dim {shape.head_dim}"
        if self.rank > limit:
            raise ModelError(
                f"sketch-ema (share={self.share!r}): rank {self.rank} exceeds {what} = {limit}; use rank <= {limit}"
            )

    # ------------------------------------------------------------------------------ rows
    def _rows(self, x: torch.Tensor, scaled: bool = False) -> torch.Tensor:
        """[G, B, H, n, D] -> rows [B, H, m, C] (token-factor: m = n, C = G*D; basis: m = G*n, C = D) in ``x``'s dtype;
        ``scaled``: float32, divided by ``sqrt(m)`` in the same pass as the copy into the rows' order (what the sketch
        fits)."""
        if x.dim() != 5:
            raise ValueError(f"sketch-ema expects x shaped [G, B, H, n, D], got {tuple(x.shape)}")
        g, b, h, n, d = x.shape
        if self.share == "token-factor":
            order, shape = (1, 2, 3, 0, 4), (b, h, n, g * d)
        else:
            order, shape = (1, 2, 0, 3, 4), (b, h, g * n, d)
        moved = x.permute(*order)
        if not scaled:
            return moved.reshape(shape)
        out = torch.empty(moved.shape, dtype=torch.float32, device=x.device)
        return torch.div(moved, shape[-2] ** 0.5, out=out).view(shape)

    def _fit(self, scaled: torch.Tensor, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-``rank`` sketch of rows already divided by ``sqrt(m)`` (the range finder on the rows)."""
        return randomized_top_right(scaled, self.rank, self.oversample, self.power_iterations, self.seed + version)

    def _width(self, x: torch.Tensor) -> int:
        if x.dim() != 5:
            raise ValueError(f"sketch-ema expects x shaped [G, B, H, n, D], got {tuple(x.shape)}")
        return x.shape[0] * x.shape[-1] if self.share == "token-factor" else x.shape[-1]

    def _fit_block(self, x: torch.Tensor, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-``rank`` sketch of the block ``x`` [G, B, H, n, D]'s rows (:meth:`_rows`), in any float dtype: from
        their Gram matrix (:func:`gram_top_right`; one pass over the block, a 16-bit block on a GPU read as it is), or
        the range finder on the rows where the block has fewer rows than the sketch's columns or the Gram steps break
        down."""
        width = self._width(x)
        rows = x.shape[-2] * (1 if self.share == "token-factor" else x.shape[0])
        found = None
        if rows >= min(self.rank + self.oversample, width):
            if self.share == "token-factor":  # [B, H, n, G*D]: a copy in the block's own dtype
                gram = tall_gram(self._rows(x))
            else:  # every layer's tokens are rows of the one basis: the layers' Gram matrices summed, no copy
                gram = tall_gram(x).sum(0)
            found = gram_top_right(gram.div_(rows), self.rank, self.oversample, self.power_iterations, self.seed + version)
        return found if found is not None else self._fit(self._rows(x, scaled=True), version)

    # ------------------------------------------------------------------------------ state
    def init_state(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The first version's bases from the group's first block ``x`` in the model's dtype (``reads_block``)."""
        if self.rank > self._width(x):
            raise ModelError(f"sketch-ema: rank {self.rank} exceeds the {self.share} channel width {self._width(x)}")
        p, sigma = self._fit_block(x, 0)
        batch, device = x.shape[1], x.device
        state = {
            "bases": p.to(torch.float16).unsqueeze(2).contiguous(),
            "version_tokens": torch.zeros(batch, 1, dtype=torch.int32, device=device),
            "singular_values": sigma.float(),
            "blocks_since_update": torch.zeros(batch, 1, dtype=torch.int32, device=device),
        }
        if self.share == "token-factor":
            state["group_layers"] = torch.full((batch, 1), x.shape[0], dtype=torch.int32, device=device)
            _remember(state["group_layers"], [x.shape[0]])
        _remember(state["version_tokens"], [0])
        _remember(state["blocks_since_update"], [0])
        return state

    def _new_version(self, state: dict[str, torch.Tensor], x: torch.Tensor) -> None:
        bases = state["bases"]
        version = bases.shape[2]
        p_new, sigma_new = self._fit_block(x, version)
        p, sigma = ema_subspace(
            bases[:, :, -1], state["singular_values"], p_new, sigma_new, self.ema, self.seed + version
        )
        state["bases"] = torch.cat((bases, p.to(torch.float16).unsqueeze(2)), dim=2).contiguous()
        state["singular_values"] = sigma.float()
        tokens = state["version_tokens"]
        counts = _host(tokens)
        state["version_tokens"] = torch.cat((tokens, tokens.new_zeros(tokens.shape[0], 1)), dim=1)
        _remember(state["version_tokens"], [*counts, 0])
        state["blocks_since_update"] = torch.zeros_like(state["blocks_since_update"])
        _remember(state["blocks_since_update"], [0])

    # ------------------------------------------------------------------------------ encode / decode
    def encode(self, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        width = self._width(x)
        if width != state["bases"].shape[-1]:
            raise CacheStateError(
                f"sketch-ema: block has channel width {width} but the state's bases have {state['bases'].shape[-1]}"
            )
        if self.ema > 0 and _host(state["blocks_since_update"])[0] >= self.update_every:
            self._new_version(state, x)
        # [B, H, r, C], exactly the stored float16 values; contiguous so results do not depend on layout
        basis = state["bases"][:, :, -1].float().contiguous()
        x = x.float()
        g, b, h, n, d = x.shape
        if self.share == "token-factor":  # each layer's channels times its slice of the basis, summed: no copy of the block
            slices = basis.view(b * h, self.rank, g, d).permute(2, 0, 3, 1)  # [G, B*H, D, r]
            coefficients = torch.bmm(x[0].reshape(b * h, n, d), slices[0])
            for member in range(1, g):
                coefficients.baddbmm_(x[member].reshape(b * h, n, d), slices[member])
            coefficients = coefficients.view(b, h, n, self.rank)
        else:  # one basis for every layer: [G, B, H, n, r] as it is returned
            coefficients = x @ basis.transpose(-1, -2)
        counts, since = _host(state["version_tokens"]), _host(state["blocks_since_update"])[0]
        tokens = state["version_tokens"].clone()
        tokens[:, -1] += n
        state["version_tokens"] = tokens
        _remember(tokens, [*counts[:-1], counts[-1] + n])
        state["blocks_since_update"] = state["blocks_since_update"] + 1
        _remember(state["blocks_since_update"], [since + 1])
        if self.share == "token-factor":
            return coefficients.unsqueeze(0)
        return coefficients

    def coefficient_rows(self, group_size: int) -> int:
        return 1 if self.share == "token-factor" else group_size

    def factor_bases(self, state: dict[str, torch.Tensor], member: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if "bases" not in state:
            return None
        bases = state["bases"]  # [B, H, V, r, C]
        if self.share == "token-factor":
            width = bases.shape[-1] // _group_layers(state)
            bases = bases[..., member * width : (member + 1) * width]
        return bases, state["version_tokens"][0]

    def decode(
        self, state: dict[str, torch.Tensor], coefficients: torch.Tensor, member: int, start: int = 0
    ) -> torch.Tensor:
        if "bases" not in state:
            raise CacheStateError("sketch-ema: decode called before any block was encoded (no bases in the state)")
        bases = state["bases"]  # [B, H, V, r, C]
        if self.share == "token-factor":
            layers = _group_layers(state)
            width = bases.shape[-1] // layers
            if not 0 <= member < layers:
                raise CacheStateError(f"sketch-ema: member {member} outside the window's {layers} layers")
            bases = bases[..., member * width : (member + 1) * width]
            coeffs = coefficients[0]
        else:
            coeffs = coefficients[member]
        return self._through_versions(state, coeffs, bases, start).to(coefficients.dtype)

    def decode_group(self, state: dict[str, torch.Tensor], coefficients: torch.Tensor, members: int, start: int = 0) -> torch.Tensor:
        """Token factors: every layer's channels from one product with the whole [r, G*D] basis."""
        if self.share != "token-factor" or "bases" not in state or members != _group_layers(state):
            return super().decode_group(state, coefficients, members, start)
        coeffs, bases = coefficients[0], state["bases"]
        version = self._one_version(state, start, coeffs.shape[-2])
        if version is None:  # tokens of several versions: one product a version, then the layers apart
            joined = self._through_versions(state, coeffs, bases, start)  # [B, H, T, G*D]
            batch, heads, tokens, _ = joined.shape
            return joined.view(batch, heads, tokens, members, -1).permute(3, 0, 1, 2, 4).to(coefficients.dtype).contiguous()
        # one version: each layer's product written in its place, no copy of the block into the layers' order
        batch, heads, tokens, _ = coeffs.shape
        width = bases.shape[-1] // members
        chunk, basis = coeffs.float().contiguous(), bases[:, :, version].float()
        out = torch.empty(members, batch, heads, tokens, width, dtype=torch.float32, device=coeffs.device)
        for member in range(members):
            torch.matmul(chunk, basis[..., member * width : (member + 1) * width].contiguous(), out=out[member])
        return out.to(coefficients.dtype)

    @staticmethod
    def _one_version(state: dict[str, torch.Tensor], start: int, tokens: int) -> int | None:
        """The basis version every one of tokens ``start .. start + tokens`` was encoded with (None: several, or none)."""
        end = 0
        for version, count in enumerate(_host(state["version_tokens"])):
            begin, end = end, end + count
            if begin <= start and start + tokens <= end and tokens:
                return version
            if begin < start + tokens and start < end:
                return None
        return None

    def _through_versions(self, state: dict[str, torch.Tensor], coeffs: torch.Tensor, bases: torch.Tensor, start: int) -> torch.Tensor:
        """Tokens ``start ..`` of ``coeffs`` [B, H, T, r], each through the basis version it was encoded with (``bases``
        [B, H, V, r, C]), float32."""
        counts = _host(state["version_tokens"])
        total, stop = sum(counts), start + coeffs.shape[-2]
        if start < 0 or stop > total:
            raise CacheStateError(f"sketch-ema: decode asked for tokens {start}..{stop} but only {total} were encoded")
        end, parts = 0, []
        for version, count in enumerate(counts):
            begin, end = end, end + count
            lo, hi = max(begin, start), min(end, stop)
            if lo >= hi:
                continue
            chunk = coeffs[..., lo - start : hi - start, :].float().contiguous()
            parts.append(chunk @ bases[:, :, version].float().contiguous())
        if not parts:
            return coeffs.new_zeros(*coeffs.shape[:-1], bases.shape[-1], dtype=torch.float32)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


@hookimpl
def kvweave_register_bases(registrar) -> None:
    registrar.add("sketch-ema", SketchEmaBasis)
