"""Real long documents for `train_long_context.py`: byte-level tokens, whole sources held out.

A *source* is one named byte stream: an installed Python package (its `.py` files concatenated in
path order), one entry of a folder of text files (a file, or a sub-folder's files concatenated), or
a run of rows of an HF `datasets` dataset. Each source is cut into documents of exactly `seqlen`
tokens (one token per byte, vocabulary 256); a tail shorter than that is dropped. Whole sources are
held out, chosen by a hash of their names, so the held-out set never shares text with training.
"""

import dataclasses
import hashlib
import importlib.metadata
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import torch

VOCAB_SIZE = 256
ROWS_PER_DATASET_SOURCE = 256  # rows of a dataset concatenated into one source


@dataclasses.dataclass
class Source:
    """One named byte stream and where it came from."""

    name: str
    data: bytes
    version: str | None = None
    files: int = 1
    files_digest: str = ""  # sha256 of the sorted relative paths and sizes (the file list, compactly)


@dataclasses.dataclass
class Document:
    """`seqlen` bytes of a source, starting at `offset`."""

    source: str
    offset: int
    tokens: torch.Tensor  # uint8 [seqlen]

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.tokens.numpy().tobytes()).hexdigest()[:16]


def _digest(entries: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def _is_text(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return b"\0" not in data


def _concatenate(files: list[Path], root: Path) -> tuple[bytes, str, int]:
    """The UTF-8 text files among `files` joined by newlines (others skipped), a digest of their
    list and their count."""
    parts, listing = [], []
    for path in files:
        data = path.read_bytes()
        if not _is_text(data):
            continue
        parts.append(data)
        listing.append(f"{path.relative_to(root)} {len(data)}")
    return b"\n".join(parts), _digest(listing), len(parts)


def package_sources(roots: Iterable[str | Path] | None = None) -> list[Source]:
    """The installed packages under `roots` (default: this interpreter's site-packages), one source
    per top-level package folder, its `.py` files concatenated in path order."""
    if roots is None:
        roots = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    distributions = importlib.metadata.packages_distributions()
    sources = []
    for root in map(Path, roots):
        if not root.is_dir():
            continue
        for folder in sorted(p for p in root.iterdir() if p.is_dir() and p.name.isidentifier()):
            files = sorted(folder.rglob("*.py"))
            if not files:
                continue
            data, digest, count = _concatenate(files, root)
            version = None
            for distribution in distributions.get(folder.name, [])[:1]:
                try:
                    version = importlib.metadata.version(distribution)
                except importlib.metadata.PackageNotFoundError:
                    pass
            if data:
                sources.append(Source(folder.name, data, version, count, digest))
    return sources


def folder_sources(folder: str | Path) -> list[Source]:
    """Each file of `folder` is a source, and each sub-folder (its files concatenated in path order);
    files that are not UTF-8 text are skipped."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"--corpus: expected a folder of text files, got {str(folder)!r} (not a folder)")
    sources = []
    for entry in sorted(root.iterdir()):
        files = [entry] if entry.is_file() else sorted(p for p in entry.rglob("*") if p.is_file())
        data, digest, count = _concatenate(files, root)
        if data:
            sources.append(Source(entry.name, data, None, count, digest))
    return sources


def dataset_sources(dataset, name: str, text_field: str = "text") -> list[Source]:
    """An HF `datasets` dataset (anything iterable over dicts with `column_names`): runs of
    `ROWS_PER_DATASET_SOURCE` rows, their `text_field` joined by blank lines, one source per run."""
    if text_field not in dataset.column_names:
        raise ValueError(f"--text-field: expected one of the dataset's columns {dataset.column_names}, got {text_field!r}")
    sources, rows = [], []

    def flush():
        if rows:
            data = "\n\n".join(rows).encode()
            first = len(sources) * ROWS_PER_DATASET_SOURCE
            sources.append(Source(f"{name}[{first}:{first + len(rows)}]", data, None, len(rows), _digest([str(len(data))])))
            rows.clear()

    for row in dataset:
        rows.append(str(row[text_field]))
        if len(rows) == ROWS_PER_DATASET_SOURCE:
            flush()
    flush()
    return sources


def load_hf_dataset(spec: str):
    """`hf:PATH_OR_NAME[:SPLIT]` -> a dataset, from disk (`save_to_disk`) or the local HF cache."""
    try:
        import datasets
    except ImportError as error:
        raise ValueError("--corpus hf:...: needs the `datasets` package (pip install datasets)") from error
    name, _, split = spec.removeprefix("hf:").partition(":")
    if Path(name).exists():
        loaded = datasets.load_from_disk(name)
        return loaded[split or "train"] if isinstance(loaded, datasets.DatasetDict) else loaded
    return datasets.load_dataset(name, split=split or "train")


def cut(source: Source, seqlen: int) -> list[Document]:
    """The source's whole `seqlen`-token documents, in order."""
    data = torch.frombuffer(bytearray(source.data), dtype=torch.uint8) if source.data else torch.empty(0, dtype=torch.uint8)
    return [Document(source.name, start, data[start:start + seqlen].clone())
            for start in range(0, len(source.data) - seqlen + 1, seqlen)]


@dataclasses.dataclass
class Corpus:
    """Training and held-out documents, and the manifest that says what they are."""

    train: list[Document]
    held_out: list[Document]
    manifest: dict


def split_corpus(sources: list[Source], seqlen: int, held_out_documents: int) -> Corpus:
    """Cut every source and hold out whole sources, in the order of their names' hashes, until
    `held_out_documents` documents are held out. Sources of more than `max(2 * held_out_documents,
    5% of the documents)` documents are passed over while others remain, so that one large package
    does not leave the training set."""
    order = sorted(sources, key=lambda source: hashlib.sha256(source.name.encode()).hexdigest())
    documents = {source.name: cut(source, seqlen) for source in order}
    cap = max(2 * held_out_documents, sum(map(len, documents.values())) // 20)
    held_out: list = []
    held_out_sources: set[str] = set()
    for small_only in (True, False):
        for source in order:
            found = documents[source.name]
            if (len(held_out) < held_out_documents and found and source.name not in held_out_sources
                    and (len(found) <= cap or not small_only)):
                held_out += found
                held_out_sources.add(source.name)
    train = [d for source in order if source.name not in held_out_sources for d in documents[source.name]]
    if len(held_out) < held_out_documents or not train:
        raise ValueError(f"--corpus: {len(train)} training and {len(held_out)} held-out documents of {seqlen} tokens; "
                         f"expected at least 1 and {held_out_documents}: give a larger corpus or a shorter --seqlen")
    manifest = {
        "seqlen": seqlen,
        "sources": [{"name": s.name, "version": s.version, "files": s.files, "files_digest": s.files_digest,
                     "bytes": len(s.data), "held_out": s.name in held_out_sources,
                     "documents_sha256_16": [d.digest for d in documents[s.name]]} for s in sources],
        "bytes": sum(len(s.data) for s in sources),
        "train_documents": len(train),
        "held_out_documents": held_out_documents,  # evaluated; the rest of the held-out sources goes unused
        "held_out_source_documents": len(held_out),
        "held_out": [{"source": d.source, "offset": d.offset, "sha256_16": d.digest} for d in held_out[:held_out_documents]],
    }
    return Corpus(train, held_out[:held_out_documents], manifest)
