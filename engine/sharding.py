"""A compressed cache on a model spread over several devices: heads sharded over ranks (tensor
parallelism), or layers placed on different devices (``device_map``). See docs/scale-out.md.

**Heads sharded over ranks.** Under transformers' tensor-parallel plans (``tp_plan="auto"`` or
``DistributedConfig(tp_size=N)`` under ``torchrun``) the key/value projections are split column-wise:
rank ``r`` of ``N`` computes KV heads ``r*H/N .. (r+1)*H/N - 1`` (and the matching query heads) and its
attention layers hand the cache only those. :func:`detect_head_shard` reads that split from the model
(the key projection's sharded weight, else the model's ``tp_size``); the cache then stores and compresses
only the rank's heads (:meth:`HeadShard.local_shape`). Nothing is communicated on the decode path: every
component decides per rank. How each component behaves when the heads are split
(:func:`check_shardable`, at build time):

- ``head-local``: a head's stored bytes and values depend on that head's data only, so the ranks
  together store exactly what one process stores;
- ``rank-budget``: per head, except a byte budget met over the heads of a block (a router's threshold, a
  probe's budget share); each rank holds the same share of the heads and meets its own share of the
  budget, so the budget holds per rank and in total, but which tokens get residuals can differ from one
  process;
- anything else is a reason the component cannot work sharded (its state mixes heads), and building the
  cache refuses the pipeline with that reason. A third-party component declares its behaviour with a
  class attribute ``head_sharding = "head-local"`` (or ``"rank-budget"``); one that declares nothing is
  refused, since the cache cannot know.

Stats: each rank's cache reports its own bytes; :func:`gather_counts` sums them with one all-gather at
stats time (never during decoding).

**Layers on several devices.** Each layer's storage is created from the keys it receives, so it lives on
that layer's device. Layers a basis encodes together (a group) must share one device:
:func:`check_layer_split` refuses a placement that splits a group, and :func:`align_device_map` moves
whole groups onto one device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from kvweave.core.errors import ComponentError, ModelError
from kvweave.core.groups import SLOT_GROUPS
from kvweave.core.interfaces import KINDS, ModelShape

HEAD_LOCAL = "head-local"
RANK_BUDGET = "rank-budget"
POLICIES = (HEAD_LOCAL, RANK_BUDGET)



@attrs.frozen
class HeadShard:
    """This process's share of the KV heads: rank ``rank`` of ``size`` holds heads
    ``rank * H / size .. (rank + 1) * H / size - 1``; ``group`` is the process group the ranks share
    (None: no collective is possible, e.g. a shard driven by hand in one process)."""

    rank: int
    size: int
    group: Any = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 1 and isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise ModelError(f"a head shard needs 0 <= rank < size, got rank {self.rank} of {self.size}")

    def local_shape(self, shape: ModelShape) -> ModelShape:
        """``shape`` with the heads this rank holds."""
        for what, heads in (("KV heads", shape.num_kv_heads), ("query heads", shape.num_query_heads)):
            if heads % self.size:
                raise ModelError(
                    f"the model's {heads} {what} cannot be split evenly over {self.size} tensor-parallel ranks; "
                    f"use a tensor-parallel size that divides {heads}"
                )
        return attrs.evolve(shape, num_query_heads=shape.num_query_heads // self.size, num_kv_heads=shape.num_kv_heads // self.size)

    def kv_heads(self, shape: ModelShape) -> range:
        """The model's KV head indices this rank holds."""
        local = shape.num_kv_heads // self.size
        return range(self.rank * local, (self.rank + 1) * local)


# ------------------------------------------------------------------------------------ detection
def _key_projection(model: Any) -> Any:
    """The first attention module's key projection (``k_proj``), or None."""
    if not isinstance(model, torch.nn.Module):
        return None
    for module in model.modules():
        projection = getattr(module, "k_proj", None)
        if isinstance(projection, torch.nn.Module) and getattr(projection, "weight", None) is not None:
            return projection
    return None


def _sharded_weight(weight: Any) -> tuple[Any, int, int] | None:
    """(mesh, mesh dim, local rows) when ``weight`` is a DTensor split along its output rows (the heads)."""
    if not hasattr(weight, "placements") or not hasattr(weight, "to_local"):
        return None
    for dim, placement in enumerate(weight.placements):
        if placement.is_shard() and placement.dim in (0, -weight.dim()):
            return weight.device_mesh, dim, int(weight.to_local().shape[0])
    return None


def _tp_mesh(model: Any) -> tuple[Any, int] | None:
    """The model's tensor-parallel mesh and its dimension (transformers keeps it as ``_device_mesh``)."""
    mesh = getattr(model, "_device_mesh", None) or getattr(model, "device_mesh", None)
    if mesh is None:
        return None
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" in names:
        return mesh, names.index("tp")
    return (mesh, 0) if mesh.ndim == 1 else None


def detect_head_shard(model: Any) -> HeadShard | None:
    """The share of KV heads ``model``'s attention hands this process, or None when it holds every head
    (no tensor parallelism, or a plan that leaves the key projection whole)."""
    projection = _key_projection(model)
    sharded = _sharded_weight(projection.weight) if projection is not None else None
    if sharded is not None:  # (whole heads per rank are checked by HeadShard.local_shape)
        mesh, dim, _ = sharded
        size = int(mesh.size(dim))
        return HeadShard(int(mesh.get_local_rank(dim)), size, mesh.get_group(dim)) if size > 1 else None
    size = int(getattr(model, "_tp_size", None) or 1)
    plan = getattr(model, "_tp_plan", None) or getattr(model, "tp_plan", None) or {}
    key_sharded = any(str(name).rsplit(".", 1)[-1] in ("k_proj", "qkv_proj", "query_key_value") and "colwise" in str(style)
                      for name, style in dict(plan).items())
    if size <= 1 or not key_sharded:
        return None
    found = _tp_mesh(model)
    if found is None:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        return HeadShard(dist.get_rank(), size, dist.group.WORLD if dist.get_world_size() == size else None)
    mesh, dim = found
    return HeadShard(int(mesh.get_local_rank(dim)), size, mesh.get_group(dim))


# ------------------------------------------------------------------------------------ policies
def component_policy(component: Any) -> str | None:
    """``head-local``, ``rank-budget``, a reason the component cannot work on a rank's share of the heads,
    or None when it declares nothing."""
    declared = type(component).__dict__.get("head_sharding")  # its own class's word: a subclass may store otherwise
    return None if declared is None else str(declared)


def check_shardable(pipeline: Any, shard: HeadShard) -> dict[str, str]:
    """Each slot's policy (``head-local`` or ``rank-budget``) when ``pipeline`` can run on one rank's share of
    the KV heads; else a :class:`ComponentError` naming the pipeline, the slot and why."""
    policies: dict[str, str] = {}
    for slot, config in pipeline.slots.items():
        component = config.component
        group = SLOT_GROUPS.get(slot.rsplit(".", 1)[-1], "?")  # 'keys.quantizer' takes a quantizer
        policy = component_policy(component)
        where = f"pipeline '{pipeline.name}', slot '{slot}' ({group} '{config.use}')"
        if policy is None:
            raise ComponentError(
                f"{where} does not say whether it works on a share of the KV heads, and the model shards its heads over "
                f"{shard.size} tensor-parallel ranks; its class can declare head_sharding = 'head-local' (a head's storage "
                "depends on that head only) or 'rank-budget' (only a byte budget spans heads); see docs/scale-out.md"
            )
        if policy not in POLICIES:
            raise ComponentError(
                f"{where} cannot run with the KV heads split over {shard.size} tensor-parallel ranks: {policy}; "
                "run this pipeline without tensor parallelism (one process, or layers split with device_map)"
            )
        policies[slot] = policy
    router = pipeline.component("router")
    for kind in KINDS:
        if router.gates(0, kind) is not None:
            raise ComponentError(
                f"pipeline '{pipeline.name}', slot 'router' ('{pipeline.use('router')}'): its residual gates are per KV "
                f"head of the whole model, and a sharded cache does not split per-head parameters; turn the gates off "
                "(use_gates = false) or run without tensor parallelism"
            )
    return policies


# ------------------------------------------------------------------------------------ stats
def gather_counts(values: Sequence[int], shard: HeadShard | None) -> list[list[int]]:
    """``values`` of every rank, in rank order: one all-gather over the shard's group (no communication
    without a shard or a group)."""
    if shard is None or shard.size == 1 or shard.group is None:
        return [list(values)]
    import torch.distributed as dist

    backend = str(dist.get_backend(shard.group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(shard.size)]
    dist.all_gather(every, mine, group=shard.group)
    return [tensor.tolist() for tensor in every]


# ------------------------------------------------------------------------------------ layer split
def _device(value: Any, main: torch.device | None) -> torch.device:
    """A ``device_map`` value as the device the module computes on: an offloaded module ("cpu" or "disk"
    next to GPUs) computes on the map's first GPU, where accelerate brings its weights."""
    if value == "disk" or (value == "cpu" and main is not None):
        return main if main is not None else torch.device("cpu")
    return torch.device("cuda", value) if isinstance(value, int) else torch.device(value)


def _layers_name(model: Any, num_layers: int) -> str | None:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return name
    return None


def layer_devices(model: Any, num_layers: int) -> list[torch.device] | None:
    """The device each decoder layer computes on, from the model's ``hf_device_map`` (``device_map``
    placement); None when the model is not split over devices."""
    placement = getattr(model, "hf_device_map", None)
    if not placement or len({str(v) for v in placement.values()}) < 2 or not isinstance(model, torch.nn.Module):
        return None
    prefix = _layers_name(model, num_layers)
    if prefix is None:
        return None
    gpus = [v for v in placement.values() if isinstance(v, int) or str(v).startswith("cuda")]
    main = torch.device("cuda", gpus[0]) if gpus and isinstance(gpus[0], int) else (torch.device(gpus[0]) if gpus else None)
    devices = []
    for layer in range(num_layers):
        name = f"{prefix}.{layer}"
        owners = [key for key in placement if key == "" or name == key or name.startswith(key + ".")]
        if not owners:  # the map places the layer's parts one by one: where its attention sits
            owners = [key for key in placement if key.startswith(name + ".") and "attn" in key] or \
                     [key for key in placement if key.startswith(name + ".")]
        if not owners:
            return None
        devices.append(_device(placement[max(owners, key=len)], main))
    return devices


def check_layer_split(pipeline: Any, groups: Sequence[tuple[int, ...]], devices: Sequence[torch.device]) -> None:
    """Refuse a placement that puts the layers of one basis group on different devices (they are encoded
    together, one tensor holding all of them)."""
    for members in groups:
        placed = {str(devices[layer]) for layer in members}
        if len(placed) > 1:
            where = ", ".join(f"layer {layer} on {devices[layer]}" for layer in members)
            raise ModelError(
                f"pipeline '{pipeline.name}', slot 'basis' ('{pipeline.use('basis')}'): layers {members[0]}..{members[-1]} are "
                f"encoded together, but the model places them on different devices ({where}); place each group on one "
                "device (kvweave.engine.sharding.align_device_map moves whole groups) or use a per-layer basis"
            )


def align_device_map(device_map: dict[str, Any], groups: Sequence[tuple[int, ...]], prefix: str = "model.layers") -> dict[str, Any]:
    """``device_map`` with every layer of a basis group on the device of the group's first layer (entries
    ``{prefix}.{layer}``; other entries unchanged)."""
    aligned = dict(device_map)
    for members in groups:
        first = f"{prefix}.{members[0]}"
        if first not in device_map:
            raise ModelError(f"device map has no entry '{first}'; it must place the decoder layers one by one under '{prefix}'")
        for layer in members:
            aligned[f"{prefix}.{layer}"] = device_map[first]
    return aligned
