"""What :class:`kvweave.engine.engine.CompressionEngine` checks of a pipeline against a model before it stores
anything (widths, rank levels, token groups), and of each block before it is encoded (finite values)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvweave.core.deferred import check
from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import KINDS

if TYPE_CHECKING:
    from kvweave.engine.engine import CompressionEngine


def check_widths(engine: CompressionEngine, where: str) -> None:
    """Every quantizer takes the basis's coefficient width; every router rank level lies in 0..head_dim and
    its residual quantizer takes that width."""
    pipeline, shape = engine.pipeline, engine.shape
    for kind in KINDS:
        slot = pipeline.slot_for("quantizer", kind)
        for quantizer in {id(q[kind]): q[kind] for q in engine.group_quantizers}.values():
            quantizer.check_width(engine.basis.coefficient_width(shape), f"{where}, slot '{slot}' (coefficients)")
    for rank in engine.levels:
        if rank > shape.head_dim or rank < 0:
            raise ModelError(
                f"{where}, slot 'router': rank level {rank} is outside 0..head_dim ({shape.head_dim}); a router "
                "gives residual ranks, dropping tokens is the 'evictor' slot's work"
            )
        for kind in KINDS:
            if rank > 0:
                slot = pipeline.slot_for("residual_quantizer", kind)
                engine.residual_quantizers[kind].check_width(rank, f"{where}, slot '{slot}' (rank level {rank})")


def check_block_groups(engine: CompressionEngine, where: str) -> None:
    """A quantizer packing groups of tokens needs them to divide the pipeline's block."""
    pipeline, block = engine.pipeline, engine.settings.block_tokens
    for kind, quantizer in ((k, q[k]) for q in engine.group_quantizers for k in KINDS):
        group = quantizer.tokens_per_group()
        if block % group:
            slot = pipeline.slot_for("quantizer", kind)
            raise ModelError(
                f"{where}, slot '{slot}' ('{pipeline.use(slot)}'): it packs groups of {group} tokens, "
                f"which must divide the pipeline's block_tokens ({block})"
            )


def check_finite(engine: CompressionEngine, members: tuple[int, ...], count: int) -> None:
    """Refuse a block holding NaN or infinite keys or values (the first ``count`` tokens of each (layer, kind) of the
    exact windows): quantizing them would corrupt whole scale groups silently. Within a flush the check reads the host
    with the forward's other checks (:mod:`kvweave.core.deferred`; the engine resolves them before any of the block is
    read back), elsewhere at once."""
    for layer in members:  # decode steps' tokens beyond an int8 window's range, named before they read back as NaN
        engine.windows[layer].exact.settle()
    names = [(layer, kind) for layer in members for kind in KINDS]
    # [blocks, B, H, count], kept to name the first offender (the blocks themselves are not): an int8 window's scales
    # (NaN for a vector holding NaN or infinity), else each vector's largest magnitude (ExactTokens.magnitude); one
    # test for all of them
    finite = torch.isfinite(torch.stack([engine.windows[layer].exact.magnitude(kind, count) for layer, kind in names]))
    passed = engine.windows[members[0]].passed_tokens

    def fail() -> None:
        for (layer, kind), tokens in zip(names, finite):
            bad = (~tokens).nonzero()
            if bad.numel():
                row, head, token = bad[0].tolist()
                raise CacheStateError(
                    f"pipeline '{engine.pipeline.name}': layer {layer} sent non-finite {kind} (first at batch row {row}, "
                    f"KV head {head}, token {passed + token}); the model's forward "
                    "produced NaN or infinity, which a compressing cache cannot store"
                )

    check(~finite.all(), fail)
