"""examples/train_long_context.py on a CPU: its corpus, every arm end to end, resuming, the report."""

import json
import sys
from pathlib import Path

import pytest
import torch

import torch_msa

EXAMPLES = Path(__file__).parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

import long_context_data as data  # noqa: E402
import train_long_context as recipe  # noqa: E402

PACKAGE = Path(torch_msa.__file__).parent  # real text that no test wrote: torch_msa's own sources


def _text_folder(root: Path) -> Path:
    """A folder corpus: one sub-folder per source package of torch_msa, and a binary file to skip."""
    root.mkdir()
    for name in ("triton", "sm90", "cute_dsl", "sm100"):
        (root / name).mkdir()
        for path in sorted((PACKAGE / name).glob("*.py")):
            (root / name / path.name).write_bytes(path.read_bytes())
    (root / "api.py").write_bytes((PACKAGE / "api.py").read_bytes())
    (root / "blob.bin").write_bytes(bytes(range(256)) * 64)
    return root


def test_package_sources_group_files_by_top_level_folder(tmp_path):
    for package, files in (("alpha", {"a.py": "x = 1\n" * 100, "sub/b.py": "y = 2\n"}), ("beta", {"c.py": "z = 3\n"})):
        for name, text in files.items():
            (tmp_path / package / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / package / name).write_text(text)
    (tmp_path / "alpha" / "data.txt").write_text("not python")
    sources = {s.name: s for s in data.package_sources([tmp_path])}
    assert set(sources) == {"alpha", "beta"}
    assert sources["alpha"].files == 2 and sources["alpha"].data == ("x = 1\n" * 100 + "\n" + "y = 2\n").encode()
    assert sources["beta"].version is None and len(sources["alpha"].files_digest) == 16


def test_held_out_sources_are_whole_and_documents_exact(tmp_path):
    sources = data.folder_sources(_text_folder(tmp_path / "corpus"))
    assert "blob.bin" not in {s.name for s in sources}
    corpus = data.split_corpus(sources, seqlen=1024, held_out_documents=3)
    held_out = {d.source for d in corpus.held_out}
    assert len(corpus.held_out) == 3 and held_out.isdisjoint({d.source for d in corpus.train})
    assert all(len(d.tokens) == 1024 and d.tokens.dtype == torch.uint8 for d in corpus.train + corpus.held_out)
    by_name = {s.name: s for s in sources}
    document = corpus.train[0]
    assert bytes(document.tokens.tolist()) == by_name[document.source].data[document.offset:document.offset + 1024]
    manifest = corpus.manifest
    assert manifest["bytes"] == sum(len(s.data) for s in sources)
    assert {s["name"] for s in manifest["sources"] if s["held_out"]} == held_out
    assert [d["sha256_16"] for d in manifest["held_out"]] == [d.digest for d in corpus.held_out]
    with pytest.raises(ValueError, match="give a larger corpus or a shorter --seqlen"):
        data.split_corpus(sources, seqlen=10**7, held_out_documents=1)


class _StandInDataset:
    """The part of an HF `datasets.Dataset` the recipe uses: `column_names` and iteration over rows."""

    column_names = ["text", "id"]

    def __init__(self, rows: int):
        self.rows = [{"text": f"row {i}: " + "lorem ipsum " * 20, "id": i} for i in range(rows)]

    def __iter__(self):
        return iter(self.rows)


def test_dataset_rows_become_sources():
    sources = data.dataset_sources(_StandInDataset(data.ROWS_PER_DATASET_SOURCE + 3), "stand-in")
    assert [s.name for s in sources] == ["stand-in[0:256]", "stand-in[256:259]"]
    assert sources[1].data.startswith(b"row 256: lorem") and sources[1].files == 3
    with pytest.raises(ValueError, match="--text-field: expected one of the dataset's columns"):
        data.dataset_sources(_StandInDataset(1), "stand-in", text_field="content")


def _run(out: Path, corpus: Path, *extra: str) -> int:
    return recipe.main(["--out", str(out), "--tiny", "--device", "cpu", "--corpus", str(corpus), "--seqlen", "512",
                        "--docs-per-step", "1", "--steps", "2", "--warmup-steps", "1", "--eval-every", "2",
                        "--eval-documents", "1", "--recall-queries", "8", *extra])


@pytest.mark.slow
def test_every_arm_trains_resumes_and_reports(tmp_path):
    corpus = _text_folder(tmp_path / "corpus")
    out = tmp_path / "run"
    assert _run(out, corpus, "--time-budget", "0.001") == recipe.INCOMPLETE  # stops before its first step
    assert (out / "warmup_partial.pt").exists() and not (out / "warmup.pt").exists()
    assert _run(out, corpus, "--arms", "dense") == 0
    dense = (out / "dense.json").read_text()
    assert _run(out, corpus) == 0  # the dense arm is done: only sparse and control run
    assert (out / "dense.json").read_text() == dense
    assert recipe.main(["--out", str(out), "--report"]) == 0

    summary = json.loads((out / "summary.json").read_text())
    meta = json.loads((out / "meta.json").read_text())
    assert meta["parameters"] == sum(p.numel() for p in recipe.Model(recipe.TINY).parameters())
    assert meta["served"]["forward"] == "reference" and meta["corpus"]["held_out_documents"] == 1
    assert "msa::backward_with_index_loss=reference" in (out / "log.txt").read_text()  # the log names the backends
    for name in recipe.ARMS:
        arm = summary["arms"][name]
        assert arm["complete"] and arm["steps"] == 2 and arm["tokens"] == 2 * 512
        assert 0 < arm["held_out_loss"] < 8 and arm["by_position"]["0-2K"] == pytest.approx(arm["held_out_loss"])
        history = json.loads((out / f"{name}.json").read_text())["history"]
        assert [h["step"] for h in history] == [1, 2]  # the shared warm-up step, then the arm's
    sparse = summary["arms"]["sparse"]
    for selection in ("index", "control", "best"):
        assert len(sparse["recall"][selection]["per_layer"]) == recipe.TINY.layers
        assert 0 < sparse["recall"][selection]["mean"] <= 1 + 1e-6
    assert sparse["recall"]["best"]["mean"] >= sparse["recall"]["index"]["mean"] - 1e-6
    assert all(kl > 0 for kl in json.loads((out / "sparse.json").read_text())["history"][-1]["kl"])
    assert sparse["selection"][0]["group_8"]["overall"]["groups"] > 0
    selections = torch.load(out / "selections.pt", weights_only=False)
    block_indices = selections["block_indices"]  # [layers, Hkv, T, topk]
    assert block_indices.shape == (recipe.TINY.layers, 1, 512, recipe.TINY.attention.topk)
    q = torch.zeros(512, recipe.TINY.attention.query_heads, recipe.TINY.attention.head_dim)
    kv = torch.zeros(512, 1, recipe.TINY.attention.head_dim)
    torch_msa.validate_inputs(q, kv, kv, block_indices[0].int(), selections["cu_seqlens"], selections["cu_seqlens"],
                              block_size=recipe.TINY.attention.block_size)


@pytest.mark.parametrize(("argv", "message"), [
    (["--arms", "dense,sparse,both"], "--arms: expected a comma-separated subset"),
    (["--steps", "4", "--warmup-steps", "4"], "--warmup-steps: expected 0 <= W < --steps"),
    (["--seqlen", "10", "--tiny"], "--seqlen: expected >= 64"),
])
def test_bad_arguments_are_named(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(["--out", str(tmp_path), "--device", "cpu", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
