"""Which codes a ``lowbit`` storage holds that the kernels' fast paths read (whole-byte codes, value groups that fit),
and which conversions the kernels leave out (``tricks`` of :func:`kvweave.kernels.lowbit_decode.lowbit_decode`): the
names, and the check of a launch against them."""

from __future__ import annotations

from typing import Any


def wide_groups(view: Any) -> bool:
    """Whether ``view``'s values fit the "wide" and "dense" kernels' products: at most 4 channel groups of at least 16."""
    return 16 <= view.v_group and view.exact_k.shape[-1] // view.v_group <= 4


def tiled_pairs(view: Any) -> bool:
    """Whether ``view``'s values are stored in tiles (``token_tiles``) of at most two channel groups: what the "dense"
    kernel can load a step ahead (its ``vahead``)."""
    return bool(view.v_tiled) and view.exact_k.shape[-1] // view.v_group <= 2


def whole_byte_keys(view: Any) -> bool:
    """Whether ``view``'s key codes fill whole bytes (2 or 4 bits, ``channel-group`` keys: no per-channel widths)."""
    return view.k_widths is None and view.k_bits in (2, 4)


def whole_byte_codes(view: Any) -> tuple[bool, bool]:
    """Whether ``view``'s key codes and its value codes fill whole bytes (2 or 4 bits; keys ``channel-group``, whose
    widths do not vary): the codes the "wide" kernel unpacks with interleaves instead of reading each from the one or
    two bytes it lies in (its ``FASTK`` / ``FASTV``)."""
    return whole_byte_keys(view), view.v_bits in (2, 4)


def fast_path(view: Any) -> bool:
    """Whether both keys and values take the interleave unpacking (:func:`whole_byte_codes`)."""
    return all(whole_byte_codes(view))


#: conversions the kernels can leave out (``tricks``, "+"-separated; none by default until timed on a GPU): "magic" int
#: codes made float32 by their bits (keys, uniform value levels; the general kernel's keys too), "vb16" the "wide"
#: kernel's value operands made bfloat16 without converting (128 + code, bfloat16 constants or table), "ktf32" its key
#: products on TF32 (no bfloat16 conversion of the rotated keys), "kfold" (keys stored after RoPE in whole-byte
#: channel-group codes) each channel's scale and minimum folded into the query, the codes fed to the products as they are;
#: and the "dense" kernel's :data:`DENSE_SETTINGS`.
TRICKS = ("magic", "vb16", "ktf32", "kfold", "kahead", "vahead", "r128", "l2ahead2", "l2ahead4", "l2ahead8")

#: the launch settings of the "dense" kernel named like tricks, to time them against its rule in one run: "kahead" its key
#: words and "vahead" its value tiles' words loaded a step before the step that reads them, "r128" 128 registers a
#: thread instead of 96 (:func:`kvweave.kernels.lowbit_dense.dense_launch` takes them where its rule would not), and
#: "l2aheadN" each step's codes asked of the L2 cache N steps before the step that reads them (GPU builds: inline PTX,
#: :mod:`kvweave.kernels.prefetch_triton`)
DENSE_SETTINGS = ("kahead", "vahead", "r128", "l2ahead2", "l2ahead4", "l2ahead8")


def parse_tricks(tricks: str, variant: str, lowp: bool, view: Any = None) -> dict:
    """The kernel constants ``MAGIC``, ``VB16``, ``KTF32``, ``KFOLD`` of ``tricks``, and the dense kernel's settings
    ``KAHEAD``, ``VAHEAD``, ``R128``, ``L2AHEAD`` (steps; 0: none) ("+"-separated :data:`TRICKS`, "" none); a name
    not in :data:`TRICKS`, or one the launch cannot take, refused."""
    names = [t for t in tricks.split("+") if t]
    unknown = [t for t in names if t not in TRICKS]
    if unknown:
        raise ValueError(f"lowbit kernel tricks {unknown}: expected '+'-separated names of {', '.join(TRICKS)}")
    if variant == "general" and set(names) - {"magic"}:
        raise ValueError(f"the lowbit 'general' kernel takes only the 'magic' trick, got {tricks!r}")
    if variant != "dense" and set(names) & set(DENSE_SETTINGS):
        raise ValueError(f"lowbit kernel tricks {sorted(set(names) & set(DENSE_SETTINGS))} are launch settings of the "
                         f"'dense' kernel, not of the '{variant}' one")
    if "vahead" in names and (view is None or not tiled_pairs(view)):
        raise ValueError("the lowbit 'vahead' trick loads value tiles' words a step ahead: it takes values stored in tiles "
                         "(token_tiles) in at most 2 channel groups")
    prefetch = [int(t.removeprefix("l2ahead")) for t in names if t.startswith("l2ahead")]
    if len(prefetch) > 1:
        raise ValueError(f"lowbit kernel tricks {tricks!r}: one 'l2aheadN' at most (the steps asked of the L2 cache ahead)")
    if variant == "dense" and "ktf32" in names:
        raise ValueError("the lowbit 'dense' kernel's key products take the codes as bfloat16 (128 + code), not 'ktf32'")
    if not lowp and set(names) & {"vb16", "ktf32"}:
        raise ValueError(f"lowbit kernel tricks {tricks!r}: 'vb16' and 'ktf32' change the bfloat16 tile operands of a GPU "
                         "(lowp); float32 operands have no conversion to leave out")
    if "kfold" in names and (view is None or view.inv_freq is not None or not whole_byte_keys(view) or "ktf32" in names):
        raise ValueError("the lowbit 'kfold' trick folds channel scales into the query: it takes keys stored after RoPE "
                         "in 2- or 4-bit channel-group codes, without 'ktf32'")
    return {"MAGIC": "magic" in names, "VB16": "vb16" in names, "KTF32": "ktf32" in names, "KFOLD": "kfold" in names,
            "KAHEAD": "kahead" in names, "VAHEAD": "vahead" in names, "R128": "r128" in names,
            "L2AHEAD": prefetch[0] if prefetch else 0}
