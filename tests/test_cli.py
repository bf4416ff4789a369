"""The `pdserve` command line, run as users run it: a real subprocess, its exit code, what it prints.
Errors a user can cause end with exit code 2 and one `pdserve: error:` line, never a traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.cli import main


def pdserve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def completion_blocks(stdout: str) -> list[tuple[str, str, int, str]]:
    """(prompt repr, text, token count, finish reason) for each block `generate` prints."""
    pattern = re.compile(r"^--- ([^\n]*)\n(.*?)\n\[(\d+) tokens, finish_reason=(\w+)\]$", re.M | re.S)
    return [(p, text, int(n), reason) for p, text, n, reason in pattern.findall(stdout)]


def assert_one_line_error(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve: error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr


def test_generate_prints_a_completion_block_per_prompt(tiny_llama: Path) -> None:
    result = pdserve(
        "generate",
        "--model",
        str(tiny_llama),
        "--dtype",
        "float32",
        "hello",
        "two words",
        "--max-tokens",
        "4",
    )
    assert result.returncode == 0, result.stderr
    blocks = completion_blocks(result.stdout)
    assert [b[0] for b in blocks] == ["'hello'", "'two words'"]
    # The same greedy text as the Python API gives.
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16)
    expected = llm.generate(["hello", "two words"], SamplingParams(max_tokens=4, temperature=0))
    for (_, text, count, reason), out in zip(blocks, expected, strict=True):
        assert text == out.outputs[0].text
        assert count == len(out.outputs[0].token_ids) and 1 <= count <= 4
        assert reason == out.outputs[0].finish_reason
    assert re.search(r"\[model .*: torch\.float32 on cpu, loaded in [\d.]+ s; \d+ tokens in", result.stderr)


def test_generate_chat_applies_the_chat_template(tiny_llama: Path) -> None:
    result = pdserve(
        "generate", "--model", str(tiny_llama), "--dtype", "float32", "--chat", "hi", "--max-tokens", "3"
    )
    assert result.returncode == 0, result.stderr
    [(prompt, text, count, reason)] = completion_blocks(result.stdout)
    assert prompt == "'hi'" and 1 <= count <= 3 and reason in ("stop", "length")
    llm = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=16)
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0))
    plain = llm.generate("hi", SamplingParams(max_tokens=3, temperature=0))
    assert text == chat[0].outputs[0].text
    assert chat[0].prompt_token_ids != plain[0].prompt_token_ids  # the template was applied


def test_a_bad_model_path_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    result = pdserve("generate", "--model", str(tmp_path / "missing-model"), "hello")
    assert_one_line_error(result, "not found")
    assert result.stdout == ""


@pytest.mark.parametrize(
    "options,message",
    [
        (["--max-tokens", "0"], "max_tokens"),
        (["--top-p", "1.5"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--threads", "0"], "threads"),
        (["--device", "tpu"], "--device 'tpu'"),
    ],
)
def test_bad_options_are_one_line_errors(
    tiny_llama: Path, options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # In process, for speed: the same main() the subprocess runs.
    assert main(["generate", "--model", str(tiny_llama), *options, "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pdserve: error: ") and message in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_cuda_without_a_gpu(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tiny_llama), "--device", "cuda", "hello"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_convert_refuses_a_hugging_face_folder(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["convert", str(tiny_llama), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve: error: ") and "already a Hugging Face folder" in err
    assert not (tmp_path / "out").exists()


def test_convert_of_a_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["convert", str(tmp_path / "nothing.gguf"), str(tmp_path / "out")]) == 2
    assert "not found" in capsys.readouterr().err


def test_usage_errors_exit_2_from_argparse() -> None:
    result = pdserve("generate")  # no prompt
    assert result.returncode == 2 and "usage: pdserve generate" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_generate_with_the_builtin_model_knows_the_capital_of_france() -> None:
    result = pdserve("generate", "--model", "smollm2-135m", "The capital of France is", "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    [(_, text, count, _)] = completion_blocks(result.stdout)
    assert "Paris" in text and count <= 8
