"""The quantizers of a cache: one per basis group and kind.

A kind's slot gives one quantizer; :meth:`kvweave.core.interfaces.Quantizer.for_layer` gives each layer its
own (a per-layer width table, ``layer_bits``). The layers a basis encodes together share their packed
coefficients, so they must get the same one.
"""

from __future__ import annotations

from kvweave.core.errors import ModelError
from kvweave.core.interfaces import KINDS, Quantizer
from kvweave.core.registry import ResolvedPipeline


def group_quantizers(
    pipeline: ResolvedPipeline, quantizers: dict[str, Quantizer], groups: list[tuple[int, ...]], where: str
) -> list[dict[str, Quantizer]]:
    """Per basis group (``groups``, layer indices) and kind: the quantizer of its layers."""
    chosen = []
    for members in groups:
        per_kind = {}
        for kind in KINDS:
            layers = [quantizers[kind].for_layer(layer) for layer in members]
            if any(q != layers[0] for q in layers[1:]):
                raise ModelError(
                    f"{where}, slot '{pipeline.slot_for('quantizer', kind)}': layers {list(members)} are encoded together "
                    f"by basis '{pipeline.use('basis')}' but the quantizer's per-layer table gives them different settings; "
                    "give the layers of one basis group the same entry, or use a basis of one layer per group"
                )
            per_kind[kind] = layers[0]
        chosen.append(per_kind)
    return chosen
