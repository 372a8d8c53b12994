"""The command line: listings, JSON output, and one-paragraph errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvweave.tools.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_components_json_lists_parameters_with_types_and_defaults(capsys):
    code, out, _ = run(capsys, "components", "--group", "quantizers", "--json")
    assert code == 0
    items = {item["name"]: item for item in json.loads(out)}
    assert set(items) >= {"none", "int8-block", "int4-group"}
    group = next(p for p in items["int4-group"]["parameters"] if p["name"] == "group")
    assert group["default"] == 32 and group["type"] == "int"
    assert all(item["group"] == "quantizers" for item in items.values())


def test_plugins_lists_each_builtin_with_its_hooks(capsys):
    code, out, _ = run(capsys, "plugins", "--json")
    plugins = {p["name"]: p for p in json.loads(out)["plugins"]}
    assert code == 0 and plugins["uniform-router"]["hooks"] == ["kvweave_register_routers"]


def test_pipelines_and_resolve(capsys):
    code, out, _ = run(capsys, "pipelines", "--json")
    names = [p["name"] for p in json.loads(out)]
    assert code == 0 and names[:3] == ["full", "int8", "int4"]
    code, out, _ = run(capsys, "resolve", "int4", "--json")
    data = json.loads(out)
    assert code == 0 and data["extends_chain"] == ["int4", "full"]
    assert data["slots"]["quantizer"]["params"] == {"group": 32, "scale_dtype": "float16"}


def test_resolve_human_output_names_every_slot(capsys):
    code, out, _ = run(capsys, "resolve", "int4-outliers")
    assert code == 0
    for slot in ("basis", "quantizer", "router", "residual_quantizer", "probe", "kernel"):
        assert slot in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["resolve", "nope"], "unknown pipeline 'nope'"),
        (["components", "--group", "widgets"], "unknown group 'widgets'"),
        (["pipelines", "--registry", "/no/such.toml"], "does not exist"),
        (["generate", "--pipeline", "nope", "--prompt", "hi"], "unknown pipeline 'nope'"),
        (["generate", "--pipeline", "int4", "--model", "./no/such/model", "--prompt", "hi"], "./no/such/model"),
        (["generate", "--pipeline", "int4", "--prompt-file", "/no/prompt.txt"], "/no/prompt.txt"),
        (["generate", "--pipeline", "int4", "--prompt", "hi", "--cuda-graphs", "--sample"], "got --device cpu, --sample"),
    ],
)
def test_errors_exit_2_with_one_paragraph(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("kvweave: error:") and fragment in err
    assert err.strip().count("\n") == 0


# ---------------------------------------------------------------------------- registry and prompt files
def test_a_registry_that_is_a_folder_or_not_utf8_is_one_paragraph(capsys, tmp_path):
    (tmp_path / "mine.toml").write_text('[pipelines.mine]\nextends = "int4"\n')
    code, _, err = run(capsys, "pipelines", "--registry", str(tmp_path))
    assert code == 2 and "is a folder, not a registry file" in err and "mine.toml" in err and "does not exist" not in err
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('[pipelines.caf\u00e9]\nextends = "int4"\n'.encode("latin-1"))
    for command in (["pipelines"], ["resolve", "int4"], ["generate", "--pipeline", "int4", "--prompt", "hi"]):
        code, _, err = run(capsys, *command, "--registry", str(latin1))
        assert code == 2 and "is not UTF-8 text: byte 0xe9 at offset 14 (line 1)" in err and err.strip().count("\n") == 0


# ------------------------------------------------------------------------------------------- Ctrl-C
def test_ctrl_c_while_the_model_loads_exits_130_with_one_line(capsys, monkeypatch):
    from kvweave.tools import models

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "load_model", interrupted)
    code, out, err = run(capsys, "generate", "--pipeline", "int4", "--prompt", "hi")
    assert code == 130 and out == "" and err.strip() == "kvweave: interrupted"


def test_ctrl_c_while_generating_exits_130_with_one_line(capsys, monkeypatch, tmp_path):
    from test_bad_input import make_tiny_model

    from kvweave.engine import generation

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(generation, "generate", interrupted)
    code, out, err = run(capsys, "generate", "--pipeline", "int4", "--model", str(make_tiny_model(tmp_path)), "--prompt", "hi")
    assert code == 130 and out == "" and err.strip().splitlines()[-1] == "kvweave: interrupted"


def test_ctrl_c_while_an_evaluation_loads_its_model_leaves_no_folder(capsys, monkeypatch, tmp_path):
    from kvweave.tools import models

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "load_model", interrupted)
    out = tmp_path / "results"
    code, _, err = run(capsys, "eval", "needle", "--pipelines", "full", "--out", str(out))
    assert code == 130 and err.strip() == "kvweave: interrupted" and not out.exists()


# -------------------------------------------------------------------------------------- help and torch
def test_help_shows_defaults_as_the_command_line_spells_them(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "needle", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0
    assert "(default: 1024,2048,4096,8000)" in out and "(default: 0.0,0.25,0.5,0.75,1.0)" in out
    assert "(default: 24)" in out and "(default: auto)" in out and "auto is float32 on cpu, bfloat16 on cuda" in out
    assert "(default: False)" not in out and "(default: None)" not in out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--max-new-tokens MAX_NEW_TOKENS (default: 64)" in out and "(default: 0.9)" in out and "--seed SEED (default: 0)" in out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--epochs EPOCHS optimizer steps of the router fit (default: 200)" in " ".join(capsys.readouterr().out.split())


def test_the_placeholder_commands_have_the_help_of_the_real_ones():
    from kvweave.tools import cli

    def helps(parser):
        sub = next(a for a in parser._actions if isinstance(a, cli.argparse._SubParsersAction))
        return {choice.dest: choice.help for choice in sub._choices_actions}

    assert helps(cli.build_parser("")) == helps(cli.build_parser())


_NO_TORCH = """
import sys
from kvweave.tools.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(name for name in ("torch", "transformers") if name in sys.modules)
print("IMPORTED:" + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["generate", "--help"],
    ["pipelines"],
    ["resolve", "int4"],
    ["components"],
    ["plugins"],
])
def test_listing_commands_do_not_import_torch(argv):
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "IMPORTED:\n" in done.stderr, done.stderr.splitlines()[-1]


def test_resolving_the_fused_kernel_pipeline_imports_neither_torch_nor_triton():
    # resolving builds every component (the fused kernel's module imports kvweave.kernels)
    script = _NO_TORCH.replace('("torch", "transformers")', '("torch", "transformers", "triton")')
    assert "triton" in script
    done = subprocess.run([sys.executable, "-c", script, "resolve", "depthweave-kv", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["slots"]["kernel"]["use"] == "fused"
    assert "IMPORTED:\n" in done.stderr, done.stderr.splitlines()[-1]


# ------------------------------------------------------------------------------ dtype and prefill progress
def test_generate_and_eval_default_to_the_same_dtype_auto(capsys):
    from kvweave.tools import cli, evaluate

    parser = cli.build_parser()
    generate = parser.parse_args(["generate", "--pipeline", "int4", "--prompt", "hi"])
    evaluation = parser.parse_args(["eval", "needle", "--pipelines", "full"])
    assert generate.dtype == evaluation.dtype == "auto"
    assert evaluate.resolve_dtype("auto", "cpu") == "float32"  # what load_model(dtype=None) loads for generate
    assert evaluate.resolve_dtype("auto", "cuda:1") == "bfloat16" and evaluate.resolve_dtype("float16", "cpu") == "float16"
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "auto is float32 on cpu, bfloat16 on cuda" in " ".join(capsys.readouterr().out.split())


def _generate_json(capsys, folder, *extra):
    prompt = "one two three four five six seven eight nine ten " * 8  # 80-odd tokens
    code, out, err = run(capsys, "generate", "--model", str(folder), "--pipeline", "int4", "--no-chat", "--dtype", "float32",
                         "--prompt", prompt, "--max-new-tokens", "4", "--json", *extra)
    assert code == 0, err
    return json.loads(out), err


def test_a_long_prompt_shows_a_prefill_bar_and_generates_the_same_tokens(capsys, monkeypatch, tiny_model_folder):
    from kvweave.tools import cli

    monkeypatch.setattr(cli, "PROGRESS_TOKENS", 10**9)
    quiet, err = _generate_json(capsys, tiny_model_folder)
    assert "prefill" not in err
    monkeypatch.setattr(cli, "PROGRESS_TOKENS", 40)
    shown, err = _generate_json(capsys, tiny_model_folder)
    assert f"prefill {shown['stats']['prompt_tokens']:,} tokens" in err and "2/2" in err  # one step per layer of the 2-layer model
    assert shown["text"] == quiet["text"] and shown["stats"]["stored_bytes"] == quiet["stats"]["stored_bytes"]
    assert shown["stats"]["cached_tokens"] == quiet["stats"]["cached_tokens"]
    terms = shown["stats"]["breakdown_terms"]  # every part of the breakdown is explained in the JSON too
    assert set(terms) == set(shown["stats"]["breakdown"]) and all(terms.values())


def test_prefill_progress_falls_back_to_a_notice_and_changes_no_token(capsys, monkeypatch):
    import torch

    from conftest import tiny_llama
    from kvweave.engine import build_cache, generation

    model = tiny_llama(torch.float32, layers=3)
    assert len(generation.decoder_layers(model)) == 3
    torch.manual_seed(0)
    inputs = {"input_ids": torch.randint(1, 128, (1, 200))}
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    plain, _ = generation.generate(model, inputs, build_cache("int4", model), **options)
    with generation.show_prefill_progress(100):
        barred, _ = generation.generate(model, inputs, build_cache("int4", model), **options)
    assert "3/3" in capsys.readouterr().err and torch.equal(plain, barred)
    monkeypatch.setattr(generation, "decoder_layers", lambda model: [])  # layers it cannot find: one line, then the time
    noticed, _ = generation.generate(model, inputs, build_cache("int4", model), prefill_progress=100, **options)
    lines = capsys.readouterr().err.strip().splitlines()
    assert torch.equal(plain, noticed)
    assert lines[0] == "kvweave: prefilling 200 tokens..." and lines[1].startswith("kvweave: prefilled 200 tokens in ")
    generation.generate(model, inputs, build_cache("int4", model), prefill_progress=201, **options)  # shorter than the threshold
    assert capsys.readouterr().err == ""
