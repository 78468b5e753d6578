"""The README's first code sample and the examples' command lines, as a newcomer meets them."""

import ast
import importlib.util
import re
import warnings
from pathlib import Path

import pytest
import torch

import torch_msa

REPOSITORY = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPOSITORY / "examples").glob("*.py"))


def readme_block(heading: str, language: str = "python") -> str:
    """The first fenced `language` block of README.md after the line `heading`."""
    text = (REPOSITORY / "README.md").read_text()
    after = text[text.index(f"\n{heading}\n"):]
    match = re.search(rf"^```{language}\n(.*?)^```", after, flags=re.MULTILINE | re.DOTALL)
    assert match, f"no {language} block after {heading!r} in README.md"
    return match.group(1)


def test_the_readme_training_loop_runs_as_written():
    """On this host's device (on CPU, the reference), without a warning, at a size the CPU runs in
    seconds: the cost guard is the sample's token count, not the clock."""
    code = readme_block("## Use it in a training loop")
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch_msa.TorchMSAWarning)
        exec(compile(code, "README.md (Use it in a training loop)", "exec"), namespace)
    assert namespace["dev"] == ("cuda" if torch.cuda.is_available() else "cpu")
    tokens = sum(namespace["lengths"])
    assert namespace["out"].shape == (tokens, 64, 128) and namespace["out"].isfinite().all()
    if namespace["dev"] == "cpu":
        assert tokens <= 128, "the CPU reference takes about 25 ms of CPU per token and step"


def test_every_option_of_every_example_has_a_description():
    undocumented = []
    for script in EXAMPLES:
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                if not any(keyword.arg == "help" for keyword in node.keywords):
                    undocumented.append(f"{script.name}: {ast.literal_eval(node.args[0])}")
    assert EXAMPLES and not undocumented, undocumented


def test_the_context_parallel_help_says_how_long_the_cpu_run_takes(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("context_parallel", REPOSITORY / "examples" / "context_parallel.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr("sys.argv", ["context_parallel.py", "--help"])
    with pytest.raises(SystemExit):
        example.parse_args()
    text = " ".join(capsys.readouterr().out.split())
    assert "with 2 ranks on 2 cores the default 4096 tokens take about 5 minutes" in text
    assert "--tokens TOKENS tokens of the whole pack (default: 32768 on CUDA, 4096 on CPU)" in text
