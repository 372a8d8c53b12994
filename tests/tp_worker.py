"""One rank of the two-process tensor-parallel run of tests/test_tensor_parallel.py (started by the test with
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, as torchrun sets them; gloo on the CPU).

    python tests/tp_worker.py MODEL_FOLDER OUT_DIR PIPELINES EVAL_PIPELINES

Runs ``kvweave generate --tp 2 --json`` for each of PIPELINES and ``kvweave eval table --tasks needle,speed
--tp 2 --json`` for EVAL_PIPELINES through the command line's ``main``; each command's output goes to this
process's stdout after a marker line ``=== NAME`` that rank 0 prints (so the test can tell rank 0 printed
the output and rank 1 printed nothing). Then,
with the model loaded sharded, writes what each rank's cache holds to ``OUT_DIR/rank<R>.json``: the shard,
the cache's shape and whether a pipeline that mixes heads was refused.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# 191 tokens with the default model's tokenizer: int4 (window 128, blocks of 64), kivi-2 (96, 32) and
# prerope-k4v2 (16, 64) all compress a block during the 24 decoding steps, not only after the prompt
PROMPT = " ".join(("one two three four five six seven eight nine ten eleven twelve".split() * 16)[:-1])


def generate_args(folder: str, pipeline: str) -> list[str]:
    return ["generate", "--model", folder, "--pipeline", pipeline, "--no-chat", "--dtype", "float32", "--prompt", PROMPT,
            "--max-new-tokens", "24", "--json"]


def eval_args(folder: str, out: Path, pipelines: str) -> list[str]:
    return ["eval", "table", "--tasks", "needle,speed", "--model", folder, "--pipelines", pipelines, "--lengths", "300",
            "--depths", "0.5", "--needles", "1", "--max-new-tokens", "3", "--speed-tokens", "200", "--speed-new-tokens", "6",
            "--dtype", "float32", "--out", str(out), "--json"]


def main() -> int:
    folder, out, pipelines, evaluated = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    from kvweave.tools.cli import main as cli

    def mark(text: str) -> None:
        if os.environ["RANK"] == "0":
            print(f"=== {text}", flush=True)

    for name in pipelines.split(","):
        mark(f"generate {name}")
        mark(f"exit {cli([*generate_args(folder, name), '--tp', '2'])}")
    mark("eval")
    mark(f"exit {cli([*eval_args(folder, out / 'eval', evaluated), '--tp', '2'])}")
    mark("refused")
    mark(f"exit {cli([*generate_args(folder, 'minicache'), '--tp', '2'])}")

    from kvweave.core.errors import ComponentError
    from kvweave.engine import build_cache
    from kvweave.tools.distributed import TensorParallel

    tp = TensorParallel.start(2, "cpu")
    model, _ = tp.load_model(folder, device="cpu", progress=False)
    cache = build_cache("int4", model)
    try:
        build_cache("freqdepthkv", model)
        refusal = ""
    except ComponentError as exc:
        refusal = str(exc)
    record = {"rank": tp.rank, "shard": [cache.shard.rank, cache.shard.size], "kv_heads": cache.shape.num_kv_heads,
              "query_heads": cache.shape.num_query_heads, "model_kv_heads": cache.model_shape.num_kv_heads, "refusal": refusal}
    (out / f"rank{tp.rank}.json").write_text(json.dumps(record))
    tp.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
