"""``--tp N``: a kvweave command run by ``torchrun --nproc-per-node N``, the model's attention heads sharded
over the N processes by transformers' tensor-parallel plan (each rank's cache holds its own heads).

Every rank runs the same command on the same inputs; the logits are gathered on every rank, so every rank
picks the same tokens. Rank 0 prints; the other ranks print nothing (their stdout and stderr go to the
null device; ``KVWEAVE_TP_ALL_RANKS=1`` keeps them). ``--tp 1`` is an ordinary single-process run.
See docs/scale-out.md.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import attrs

from kvweave.core.errors import KvweaveError, ModelError

ALL_RANKS_ENV = "KVWEAVE_TP_ALL_RANKS"
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def add_tp_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tp", type=int, default=1,
        help="tensor-parallel size: run under 'torchrun --nproc-per-node N' with --tp N; each process holds 1/N of "
             "the attention heads and of the cache (rank 0 prints)",
    )


def requested_tp(argv: Sequence[str]) -> int:
    """The ``--tp`` value ``argv`` gives (1 when none or unreadable: the parser reports a bad value)."""
    for index, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--tp=") else argv[index + 1] if arg == "--tp" and index + 1 < len(argv) else None
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return 1
    return 1


def silence_other_ranks(argv: Sequence[str]) -> None:
    """In a ``--tp N`` run, send the stdout and stderr of every rank but 0 to the null device (file
    descriptors included, so that libraries print nothing either)."""
    if requested_tp(argv) <= 1 or os.environ.get("RANK", "0") == "0" or os.environ.get(ALL_RANKS_ENV):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(null, fd)
    os.close(null)


@attrs.frozen
class TensorParallel:
    """This process's place in a ``--tp`` run (size 1: a single process, nothing distributed)."""

    size: int = 1
    rank: int = 0
    local_rank: int = 0
    shadow: list = attrs.field(factory=list, eq=False, repr=False)  # folders to remove when the run ends

    @property
    def main(self) -> bool:
        """Whether this process prints and writes results (rank 0)."""
        return self.rank == 0

    @classmethod
    def start(cls, size: int, device: str) -> TensorParallel:
        """Join the ``torchrun`` process group for ``--tp size`` on ``device`` ("cpu": gloo; "cuda": NCCL, each
        rank on the GPU of its LOCAL_RANK)."""
        if not isinstance(size, int) or size < 1:
            raise KvweaveError(f"--tp must be a positive number of processes, got {size}")
        if size == 1:
            return cls()
        missing = [name for name in TORCHRUN_ENV if name not in os.environ]
        if missing:
            raise KvweaveError(
                f"--tp {size} runs one process per rank under torchrun, and this process has no {', '.join(missing)}; start it "
                f"as: torchrun --nproc-per-node {size} -m kvweave.tools.cli ... --tp {size}"
            )
        world = int(os.environ["WORLD_SIZE"])
        if world != size:
            raise KvweaveError(
                f"--tp {size}, but torchrun started {world} processes (WORLD_SIZE); the heads are sharded over every "
                f"process: pass --tp {world}, or start torchrun with --nproc-per-node {size}"
            )
        if device not in ("cpu", "cuda"):
            raise KvweaveError(f"--device {device} with --tp {size}: each rank takes the GPU of its LOCAL_RANK; pass --device cuda (or cpu)")
        import torch
        import torch.distributed as dist

        local_rank = int(os.environ["LOCAL_RANK"])
        if device == "cuda":
            if not torch.cuda.is_available() or torch.cuda.device_count() <= local_rank:
                raise KvweaveError(
                    f"--device cuda with --tp {size}: rank {os.environ['RANK']} needs GPU {local_rank}, but this machine has "
                    f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} usable GPUs"
                )
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():  # joined once per process, left when it exits (later commands reuse it)
            dist.init_process_group("nccl" if device == "cuda" else "gloo")
            atexit.register(_leave_group)
        return cls(size, dist.get_rank(), local_rank)

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()

    def load_model(self, spec: str, *, device: str, dtype: Any = None, progress: bool = True) -> tuple[Any, Any]:
        """``(model, tokenizer)`` like :func:`kvweave.tools.models.load_model`, with the model's heads sharded over
        the ranks by its tensor-parallel plan (a GGUF file is converted once, by rank 0, while the others wait)."""
        from kvweave.tools import models

        if self.size == 1:
            return models.load_model(spec, device=device, dtype=dtype, progress=progress)
        load_dtype = models._check_environment(device, dtype)
        source = models.resolve_model_source(spec)
        converted = source.kind in ("default", "gguf-file")
        if converted and self.main:
            models._converted_folder(source, progress)
        self.barrier()
        location = str(models._converted_folder(source, progress and self.main)) if converted else source.location
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            from transformers.distributed import DistributedConfig

            sharding: dict[str, Any] = {"distributed_config": DistributedConfig(tp_size=self.size)}
        except ImportError:  # transformers before DistributedConfig: the plan argument of from_pretrained
            sharding = {"tp_plan": "auto"}
        try:
            with models._quiet_unless(progress and self.main):
                model = AutoModelForCausalLM.from_pretrained(location, dtype=load_dtype, attn_implementation="sdpa", **sharding)
                tokenizer = AutoTokenizer.from_pretrained(location)
        except models._LOAD_ERRORS as exc:
            raise ModelError(f"loading {source.location} with its heads sharded over {self.size} ranks (--tp) failed: {exc}") from exc
        except ValueError as exc:  # e.g. a model class without a tensor-parallel plan
            raise ModelError(f"model {spec} cannot be sharded over {self.size} ranks (--tp): {exc}") from exc
        model.eval()
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        return model, tokenizer

    def results_folder(self, out: Path) -> Path:
        """Where this rank keeps its results: ``out`` on rank 0; on the others a private copy of what rank 0
        holds in ``out`` once it has opened it (call on every rank after rank 0 opened the folder), so every
        rank resumes the same cells and only rank 0 writes ``out``."""
        self.barrier()
        if self.main:
            return out
        copy = Path(tempfile.mkdtemp(prefix=f"kvweave-tp-rank{self.rank}-"))
        self.shadow.append(copy)
        for name in ("settings.json", "cells.jsonl"):
            if (out / name).exists():
                shutil.copy(out / name, copy / name)
        return copy

    def finish(self) -> None:
        """Remove this rank's private copies (the process group is left when the process exits)."""
        for folder in self.shadow:
            shutil.rmtree(folder, ignore_errors=True)
        self.shadow.clear()


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
