"""The GPU benchmark scripts keep working: decode_e2e.py's ``--smoke`` mode runs the same code path on a
tiny model on the CPU, including a batch grown from fewer encoder-filled rows. The scripts' ``main()`` runs in this
process (each run in a process of its own would import torch and transformers again); the bash scripts, and a
script that must turn Triton's interpreter on before it is imported, run in processes of their own."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import attrs
import pytest
import torch

from kvweave.core.errors import KvweaveError


ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture
def run_main(monkeypatch) -> Iterator[Callable[..., None]]:
    """``run_main(NAME, *args, cwd=benchmarks/, **kwargs)``: benchmarks/NAME.py's ``main(**kwargs)`` in this process with
    the command line ``args``, run from ``cwd`` (a failure raises, a refusal is a SystemExit). What the scripts change in
    the process is restored after the test: the environment (decode_e2e.py asks for the allocator's expandable segments
    as it is imported), torch's random state (the models are seeded), decode_e2e's log and registry (module globals
    that its main() sets and tp_capacity.py's caches read)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    state = torch.random.get_rng_state()
    with mock.patch.dict(os.environ):
        import decode_e2e

        monkeypatch.setattr(decode_e2e, "LOG", None)
        monkeypatch.setattr(decode_e2e, "REGISTRY", None)

        def run(name: str, *args: str, cwd: Path = BENCHMARKS, **kwargs) -> None:
            monkeypatch.chdir(cwd)
            monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / f"{name}.py"), *args])
            importlib.import_module(name).main(**kwargs)

        yield run
    torch.random.set_rng_state(state)


def decode_e2e_smoke(run_main, out: Path, *options: str) -> list[dict]:
    """benchmarks/decode_e2e.py --smoke with ``options`` (2 layers) writing to ``out``; the rows it logged."""
    run_main("decode_e2e", "--smoke", "--layers", "2", *options, "--out", str(out))
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def test_decode_e2e_smoke_grows_a_batch_from_filled_rows(tmp_path, run_main):
    rows = decode_e2e_smoke(run_main, tmp_path, "--context", "256", "--batches", "1,3", "--fill-rows", "2", "--methods", "depthweave-kv",
                            "--steps", "34")
    assert [r["batch"] for r in rows] == [1, 3]
    assert "filled_rows" not in rows[0] and rows[1]["filled_rows"] == 2
    # three rows store about three times the bytes of one (the grown rows are real copies; the rows'
    # residual entries differ with their contents), and both decoded
    assert 2.5 < rows[1]["cache_bytes"] / rows[0]["cache_bytes"] < 3.5
    assert all(r["median_step_ms"] > 0 for r in rows)
    assert "| depthweave-kv | 3 |" in (tmp_path / "decode_e2e.md").read_text()


def test_decode_e2e_smoke_fills_times_and_scores_a_kvzip_pipeline(tmp_path, run_main):
    """A pipeline whose evictor chooses by context importance: the synthetic fill gives it random scores (it
    evicts: fewer bytes than the codec alone), and the time to first token includes scoring the prompt."""
    rows = decode_e2e_smoke(run_main, tmp_path, "--context", "512", "--batches", "1", "--methods", "prerope-qa35v3,kvzip-qa35v3",
                            "--steps", "3", "--ttft", "256")
    ttft = {r["method"]: r for r in rows if "ttft_s" in r}
    decode = {r["method"]: r for r in rows if "median_step_ms" in r}
    assert set(ttft) == set(decode) == {"prerope-qa35v3", "kvzip-qa35v3"}
    assert ttft["kvzip-qa35v3"]["ratio"] > ttft["prerope-qa35v3"]["ratio"] > 1
    assert decode["kvzip-qa35v3"]["cache_bytes"] < 0.9 * decode["prerope-qa35v3"]["cache_bytes"]


@pytest.mark.interpreter
def test_decode_e2e_smoke_decodes_a_pipeline_with_cuda_graphs_as_generate_does(tmp_path, run_main):
    """``NAME@graphs``: the same pipeline decoded by graph_decode (its steps eager on a CPU, the window's put in torch)
    over a flush: the same stored bytes as ``model.generate``'s run, every step timed; and
    ``full@graphs``, the full cache as a StaticCache, counts the tokens it holds, not its room."""
    rows = decode_e2e_smoke(run_main, tmp_path, "--context", "512", "--batches", "1", "--steps", "40", "--registry",
                            str(BENCHMARKS / "dense_sweep.toml"), "--methods", "full,full@graphs,kzd-k4v2-f48-d128,kzd-k4v2-f48-d128@graphs")
    full, full_graphs, eager, graphs = rows
    assert full_graphs["cache_bytes"] == full["cache_bytes"] > eager["cache_bytes"]
    assert graphs["method"] == "kzd-k4v2-f48-d128@graphs" and graphs["cache_bytes"] == eager["cache_bytes"]
    assert graphs["median_step_ms"] > 0 and len(graphs["slowest_steps_ms"]) == 3
    assert "| kzd-k4v2-f48-d128@graphs | 1 |" in (tmp_path / "decode_e2e.md").read_text()


@pytest.mark.interpreter
def test_decode_e2e_smoke_takes_the_head_dim_256_shape(tmp_path, run_main):
    """``--shape d256``: a model of head_dim 256 (the tiny one: 4 query heads on 2 KV heads), the full cache's bytes
    those of 256 channels a head; the 8x class's storage for that head_dim (``kzd-k4v2t-f48-d256``, its sinks restored
    at rank 256) decoded eagerly and from CUDA graphs' steps to the same bytes, several times fewer than the full
    cache's."""
    rows = decode_e2e_smoke(run_main, tmp_path, "--shape", "d256", "--context", "512", "--batches", "1", "--steps", "40",
                            "--registry", str(BENCHMARKS / "dense_sweep.toml"), "--methods",
                            "full,kzd-k4v2t-f48-d256,kzd-k4v2t-f48-d256@graphs")
    full, eager, graphs = rows
    assert full["cache_bytes"] == 2 * 2 * 2 * (512 + 40) * 256 * 2  # K and V, 2 layers, 2 KV heads, bf16
    assert graphs["cache_bytes"] == eager["cache_bytes"] < full["cache_bytes"] / 5
    assert "d=256" in (tmp_path / "decode_e2e.md").read_text()


def test_tp_capacity_smoke_finds_a_larger_batch_for_a_smaller_cache(tmp_path, run_main, capsys):
    """benchmarks/tp_capacity.py's ``--smoke`` path in this process (one rank): the largest batch follows the
    cache bytes per sequence, a refused pipeline is a row saying why, and ``table`` merges the rows."""
    out = tmp_path / "one"
    run_main("tp_capacity", "tp", "--smoke", "--layers", "2", "--contexts", "192", "--methods", "full,int4,minicache", "--steps", "3",
             "--probe-batch", "2", "--smoke-limit", "2000000", "--out", str(out))
    rows = {r["method"]: r for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())}
    full, int4 = rows["full"], rows["int4"]
    assert full["seq_bytes_per_gpu"] == 2 * 2 * 2 * 192 * 128 * 2  # K and V, 2 layers, 2 KV heads, 192 tokens, d = 128, bf16
    assert int4["seq_bytes_per_gpu"] < full["seq_bytes_per_gpu"] and int4["max_batch"] > full["max_batch"] >= 1
    assert full["max_batch"] * full["seq_bytes_per_gpu"] <= 2_000_000 < (full["max_batch"] + 1) * full["seq_bytes_per_gpu"]
    assert "refused" in rows["minicache"] and "minicache" in rows["minicache"]["refused"]
    capsys.readouterr()
    run_main("tp_capacity", "table", str(out))
    assert "| smoke | tp | 1 | 192 | int4 |" in capsys.readouterr().out


def test_quantizer_error_attention_masks_a_sliding_layer_to_its_window(monkeypatch):
    """benchmarks/quantizer_error.py recomputes attention per layer: a sliding-window layer sees only its last
    ``window`` keys, so changing an older key changes the full layer's output and not the sliding one's."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import quantizer_error

    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 2, 3, 8, generator=gen), torch.randn(2, 1, 10, 8, generator=gen), torch.randn(2, 1, 10, 8, generator=gen)
    before = quantizer_error.attention(q, k, v, 0.3, [None, 3])
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 0] += 5.0
    v2[:, :, 0] -= 5.0
    after = quantizer_error.attention(q, k2, v2, 0.3, [None, 3])
    assert not torch.allclose(before[0], after[0])  # the full-attention layer reads token 0
    assert torch.allclose(before[1], after[1])  # the window of 3 never reaches it (queries at 7, 8, 9)
    assert torch.allclose(quantizer_error.attention(q, k, v, 0.3), quantizer_error.attention(q, k, v, 0.3, [None, None]))


def test_lowbit_twin_error_rows_under_the_interpreter(monkeypatch):
    """benchmarks/lowbit_twin_error.py's rows on the CPU (float32 operands): every variant equals the twin to float
    rounding, and rounding the query to bfloat16 moves the twin by far more than that."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import lowbit_twin_error

    rows = lowbit_twin_error.twin_errors("k4v2", 128, "cpu")
    assert [(r["variant"], r["block"]) for r in rows] == list(lowbit_twin_error.CONFIGS)
    for row in rows:
        assert row["worst"] < 1e-5 * row["scale"] and row["mean"] <= row["worst"]
        assert row["worst"] * 100 < row["noise"] < row["scale"]


def profile_prefill(run_main, monkeypatch, capsys, *options: str) -> str:
    """benchmarks/profile_prefill.py --smoke with ``options`` in this process (its stages' timers taken off after the
    test); what it printed."""
    capsys.readouterr()
    run_main("profile_prefill", "--smoke", *options, patch=monkeypatch.setattr)
    return capsys.readouterr().out


def surrogate_registry(run_main, out: Path, *options: str) -> None:
    """benchmarks/surrogate_registry.py --smoke (2 layers) writing to ``out``, run from the repository's root (its
    ``--base`` is benchmarks/dense_sweep.toml from there)."""
    run_main("surrogate_registry", "--out", str(out), "--smoke", "--layers", "2", *options, cwd=ROOT)


def test_profile_prefill_scores_the_context_of_a_kvzip_pipeline_and_times_the_scoring(run_main, monkeypatch, capsys):
    """benchmarks/profile_prefill.py --smoke on a KVzip pipeline: the context is scored before the prompt's forward
    (the cache refuses to evict without scores), and the scoring is a stage of its own in the table."""
    out = profile_prefill(run_main, monkeypatch, capsys, "--pipeline", "kvzip-qa35v3", "--tokens", "256", "--layers", "2")
    head = out.splitlines()[0]
    assert head.startswith("prompt 256 tokens, 2 layers, cpu: full cache") and "kvzip-qa35v3" in head
    stages = {line.split(" | ")[0].strip("| ") for line in out.splitlines() if line.startswith("| ")}
    assert {"importance.reconstruction_scores", "together.flush_together", "quantizer.quantize"} <= stages  # stored together


def test_a_surrogate_pipeline_is_scored_by_one_forward_in_the_prefill_profile(tmp_path, run_main, monkeypatch, capsys):
    """benchmarks/surrogate_registry.py writes a random surrogate of the smoke model's shape and NAME-s pipelines; in
    profile_prefill.py the context is then scored by the surrogate (a stage of its own) and KVzip's repetitions never
    run; an unknown base pipeline is refused before anything is written."""
    surrogate_registry(run_main, tmp_path / "reg")
    assert (tmp_path / "reg" / "surrogate.pt").is_file() and "kzd-k4v2-f48-d128-s" in capsys.readouterr().out
    out = profile_prefill(run_main, monkeypatch, capsys, "--registry", str(tmp_path / "reg" / "registry.toml"), "--pipeline",
                          "kzd-k4v2-f48-d128-s", "--tokens", "256", "--layers", "2")
    stages = {line.split(" | ")[0].strip("| ") for line in out.splitlines() if line.startswith("| ")}
    assert "importance.surrogate_scores" in stages and "importance.reconstruction_scores" not in stages
    assert "importance.ingest_context" in stages  # the context stored from the scoring pass, timed as a whole
    assert "together.flush_together" in stages  # its one-layer flushes a few layers a pass
    with pytest.raises(KvweaveError, match="nope"):
        surrogate_registry(run_main, tmp_path / "bad", "--pipelines", "nope")
    assert not (tmp_path / "bad").exists()


def test_decode_e2e_times_the_first_token_of_every_method_named(tmp_path, run_main):
    """--ttft with --batches "": each method's prompt is timed once, however many are named (a NAME@graphs method
    shares its pipeline's prefill), the full cache's ratio is 1 and the surrogate pipeline's is the compressed one's."""
    surrogate_registry(run_main, tmp_path / "reg")
    rows = decode_e2e_smoke(run_main, tmp_path / "e2e", "--registry", str(tmp_path / "reg" / "registry.toml"), "--batches", "",
                            "--methods", "full,prerope-qa35v3,prerope-qa35v3@graphs,kzd-k4v2-f48-d128-s", "--ttft", "128")
    assert [r["method"] for r in rows] == ["full", "prerope-qa35v3", "kzd-k4v2-f48-d128-s"]
    assert rows[0]["ratio"] == 1.0 and all(r["ratio"] > 1 and r["ttft_s"] > 0 for r in rows[1:])


def test_kernel_suite_runs_every_storage_it_names_and_refuses_what_it_cannot_time(tmp_path):
    """benchmarks/kernel_suite.sh: DRY=1 lists the GPU tests and one timing per storage plus the keys-after-RoPE one,
    with the configurations asked for; an unknown storage and a machine without CUDA are refused before anything runs."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    script = str(ROOT / "benchmarks" / "kernel_suite.sh")

    def suite(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", script, str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PATH": path, **env})

    dry = suite(DRY="1", STORAGES="kz8,k4v2", CONFIGS="wide:32:4", TOKENS="4096")
    lines = dry.stdout.splitlines()
    assert dry.returncode == 0 and len(lines) == 4 and "test_lowbit_gpu.py" in lines[0]
    assert ["--storage kz8" in lines[1], "--storage k4v2" in lines[2], "--post-rope" in lines[3]] == [True] * 3
    assert all("--configs wide:32:4 " in line and "--tokens 4096 " in line for line in lines[1:3])
    unknown = suite(DRY="1", STORAGES="kz8,kz9")
    assert unknown.returncode == 2 and "'kz9'" in unknown.stderr and unknown.stdout == ""
    if not torch.cuda.is_available():
        bare = suite()
        assert bare.returncode == 2 and "no CUDA GPU" in bare.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("storage", ["k4v2", "kz5", "kz8"])
def test_lowbit_kernel_storages_pack_what_they_name_and_the_kernel_reads_them(monkeypatch, storage):
    """benchmarks/lowbit_kernel.py's storages: the KVzip ones keep their share of the tokens (a multiple of 64) at
    sorted distinct positions before the exact window, count the positions' bytes, and store the shipped pipeline's
    widths; the lowbit kernel (interpreter) reads each as its torch twin does."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import lowbit_kernel
    from kvweave.kernels.lowbit_decode import lowbit_decode, torch_lowbit_decode

    view = lowbit_kernel.packed_view(1, 512, device="cpu", storage=storage)
    share = lowbit_kernel.STORAGES[storage][2]
    assert view.tokens == int(512 * share) // 64 * 64 and view.k_codes.shape[-2] == view.tokens
    if share < 1:
        positions = view.positions.long()
        assert view.positions.dtype == torch.int16 and view.exact_first == 512
        assert bool((positions.diff(dim=-1) > 0).all()) and int(positions.min()) >= 0 and int(positions.max()) < 512
        assert view.k_out_index is None or view.k_out_index.shape[-1] == 0  # the shipped pipelines keep no outlier
        assert lowbit_kernel.view_bytes(view) == lowbit_kernel.view_bytes(attrs.evolve(view, positions=None)) + view.positions.nbytes
        key_bits = 8 * view.k_codes.shape[-1] / 128
        assert key_bits == {"kz5": 3.5, "kz8": 3.0}[storage] and view.v_bits == {"kz5": 3, "kz8": 2}[storage]
    torch.manual_seed(1)
    q = torch.randn(1, lowbit_kernel.Q_HEADS, lowbit_kernel.HEAD_DIM)
    twin = torch_lowbit_decode(view, q, None, 0.09)
    assert torch.allclose(lowbit_decode(view, q, None, 0.09), twin, atol=2e-4, rtol=1e-4)


def test_lowbit_kernel_configs_name_variant_steps_warps_programs_and_tricks(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import lowbit_kernel

    configs = lowbit_kernel.parse_configs("wide:32:4,general:16:4:264,wide:32:8:1056:magic+vb16", 528)
    assert configs == [("wide", 32, 4, 528, ""), ("general", 16, 4, 264, ""), ("wide", 32, 8, 1056, "magic+vb16")]
    for bad in ("wide:32", "fast:32:4", "wide:32:4:528:turbo", "wide:x:4"):
        with pytest.raises(SystemExit, match="variant:block:warps"):
            lowbit_kernel.parse_configs(bad, 528)


def test_scoring_time_times_both_read_outs_and_compares_their_scores(run_main, capsys):
    """benchmarks/scoring_time.py --smoke: the scoring by each backend and the forwards alone, and the two backends'
    scores nearly equal (the kernels in Triton's interpreter)."""
    options = ["--smoke", "--tokens", "160", "--reps", "1"]
    if os.environ.get("TRITON_INTERPRET") == "1":  # this process's kernels run in the interpreter (conftest, off a GPU)
        run_main("scoring_time", *options)
        out = capsys.readouterr().out
    else:  # Triton decides when a kernel is defined: the script turns its interpreter on in a process of its own
        done = subprocess.run([sys.executable, str(BENCHMARKS / "scoring_time.py"), *options], capture_output=True, text=True,
                              timeout=300, cwd=BENCHMARKS)
        assert done.returncode == 0, done.stderr[-2000:]
        out = done.stdout
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert {"scoring, read-out by torch", "scoring, read-out by the Triton kernels", "the forwards alone (context pass + repetitions)"} <= set(rows)
    relative = float(out.strip().splitlines()[-1].split(",")[-1].split()[0])
    assert relative < 1e-3


@pytest.mark.interpreter
def test_decode_e2e_smoke_warm_times_graph_steps_after_as_many_untimed_ones(tmp_path, run_main, capsys):
    """``--warm``: a ``NAME@graphs`` method is timed after as many untimed steps over the same cache (so it stores the
    tokens of both passes), its row marked; a method decoded by ``model.generate`` is refused by name."""
    registry = str(BENCHMARKS / "dense_sweep.toml")
    method = "kzd-k4v2-f48-d128@graphs"
    cold = decode_e2e_smoke(run_main, tmp_path / "cold", "--context", "512", "--batches", "1", "--steps", "40", "--registry", registry,
                            "--methods", method)
    warm = decode_e2e_smoke(run_main, tmp_path / "warm", "--context", "512", "--batches", "1", "--steps", "40", "--registry", registry,
                            "--methods", method, "--warm")
    assert "warm" not in cold[0] and warm[0]["warm"] is True
    assert warm[0]["cache_bytes"] > cold[0]["cache_bytes"]  # 40 more tokens held (a block flushed)
    assert "(warm)" in (tmp_path / "warm" / "decode_e2e.md").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        run_main("decode_e2e", "--smoke", "--layers", "2", "--warm", "--methods", "full", "--out", str(tmp_path / "refused"))
    err = capsys.readouterr().err
    assert refused.value.code != 0 and "--warm takes NAME@graphs methods only" in err and "full" in err


def test_decode_kernel_takes_each_combine_and_the_one_pass_combines_programs(run_main, capsys):
    """``--combines`` entries: each combine by name, ``one-pass/N`` for N programs a query head; anything else is
    refused before a GPU is asked for."""
    import decode_kernel

    from kvweave.kernels import depthweave_decode

    assert decode_kernel.combine_slices("one-pass") == decode_kernel.combine_slices("two-pass") == depthweave_decode.COMBINE_SLICES
    assert decode_kernel.combine_slices("one-pass/8") == 8 and decode_kernel.combine_slices("one-pass/1") == 1
    assert all(decode_kernel.combine_slices(bad) is None for bad in ("one-pass/3", "one-pass/32", "two-pass/4", "three-pass", "one-pass/x"))
    with pytest.raises(SystemExit) as refused:
        run_main("decode_kernel", "--combines", "one-pass/8,fast", cwd=ROOT)
    assert refused.value.code == 2 and "--combines: unknown fast" in capsys.readouterr().err


def test_decode_kernel_takes_a_list_of_splits(run_main, capsys):
    """``--split``: token counts a program, a row each, 0 for the cache's own segments; a count that is not a multiple
    of the tile is refused before a GPU is asked for."""
    import decode_kernel

    assert decode_kernel.parse_splits("0,1024,1376") == [0, 1024, 1376]
    assert all(decode_kernel.parse_splits(bad) is None for bad in ("1000", "-32", "1024,x", ""))
    with pytest.raises(SystemExit) as refused:
        run_main("decode_kernel", "--split", "0,1000", cwd=ROOT)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--split" in err and "'0,1000'" in err
