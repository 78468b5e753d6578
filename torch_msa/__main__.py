"""`python -m torch_msa`: a self-check of the MSA ops on this machine.

Runs `select_blocks -> sparse_attention -> backward` on MiniMax-M3-shaped packed documents on the
best device, times each stage, and checks against an independent float64 computation written
here: selection, out, lse and dq on sampled tokens, and dv, dk through two identities exact for
any selection (`sum_j dv[j] = sum_{t, h} grad_out[t, h]`, `sum_j dk[j] = 0`). Prints
`self-check: PASS` (exit 0) or `self-check: FAIL` (exit 1) last.
"""

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import sys
import time
import traceback
import urllib.parse
import urllib.request
from pathlib import Path

import torch

import torch_msa
from torch_msa import backends
from torch_msa._progress import Progress, format_duration
from torch_msa.contract import M3, Shape
from torch_msa.testing import pick_device

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
SAMPLED_TOKENS = 32

# Share of --seqlen held by each document; the first is longer than topk * block_size keys, so its
# late queries really choose among blocks.
DOCUMENT_SHARES = (0.75, 0.125, 0.078125, 0.046875)
# This share of the first document's keys has no query, so `p(t) = Lk - Lq + t` runs with Lq < Lk.
SUFFIX_KEY_SHARE = 0.15
DEFAULT_SEQLEN = 4096
# Queries on CPU, where the reference's time is proportional to the queries (not their positions).
CPU_DEFAULT_QUERIES = 640
# Queries of the first document in the CPU warm-up that sizes the expected times.
CPU_WARMUP_QUERIES = 32


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Largest allowed error per check, each relative to the scale of the quantity (see `Check`)."""

    out: float
    lse: float
    dq: float
    dv_sum: float
    dk_sum: float
    selection: float = 1e-3  # relative score gap allowed at the top-k threshold (GEMM ties)


# bf16/fp16 errors come mostly from rounding the outputs to the input dtype; fp32/fp64 must
# accumulate at least as precisely as the inputs (a TF32 shortcut fails on purpose).
TOLERANCES = {
    torch.bfloat16: Tolerance(out=1e-2, lse=1e-4, dq=2e-2, dv_sum=1e-2, dk_sum=1e-2),
    torch.float16: Tolerance(out=2e-3, lse=1e-4, dq=4e-3, dv_sum=2e-3, dk_sum=2e-3),
    torch.float32: Tolerance(out=1e-4, lse=1e-4, dq=1e-4, dv_sum=1e-4, dk_sum=1e-4),
    torch.float64: Tolerance(out=1e-10, lse=1e-12, dq=1e-10, dv_sum=1e-10, dk_sum=1e-10),
}


@dataclasses.dataclass(frozen=True)
class Document:
    queries: int  # Lq
    keys: int  # Lk >= Lq; the queries sit at key positions Lk - Lq .. Lk - 1


def _proportional_split(total: int, weights: list[int]) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders), each part between 1 and its
    weight. Needs `len(weights) <= total <= sum(weights)` and every weight >= 1."""
    whole = sum(weights)
    exact = [weight * total / whole for weight in weights]
    parts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: parts[i] - exact[i])
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    for i, part in enumerate(parts):
        if part == 0:  # lend one query from the largest part (it has more than one)
            parts[i] = 1
            parts[max(range(len(parts)), key=parts.__getitem__)] -= 1
    return parts


def document_layout(seqlen: int, queries: int | None = None) -> list[Document]:
    """Split `seqlen` key tokens into `len(DOCUMENT_SHARES)` documents, each with the causal suffix
    of its keys as queries; fewer `queries` than the full layout (None) are split in proportion."""
    if seqlen < len(DOCUMENT_SHARES):
        raise ValueError(f"seqlen: expected at least {len(DOCUMENT_SHARES)} tokens (one per document), got {seqlen}")
    rest = [max(1, int(seqlen * share)) for share in DOCUMENT_SHARES[1:]]
    first = seqlen - sum(rest)
    keys = [first] + rest
    full_queries = [first - int(first * SUFFIX_KEY_SHARE)] + rest
    if queries is None:
        queries = sum(full_queries)
    if not len(keys) <= queries <= sum(full_queries):
        raise ValueError(f"queries: expected {len(keys)} (one per document) to {sum(full_queries)} (the full layout "
                         f"of {seqlen} keys), got {queries}")
    return [Document(q, k) for q, k in zip(_proportional_split(queries, full_queries), keys)]


def default_queries(device: torch.device, seqlen: int) -> int | None:
    """`--queries` when it is not given: the full layout (None) on a GPU, at most
    `CPU_DEFAULT_QUERIES` on CPU."""
    if device.type != "cpu":
        return None
    return min(CPU_DEFAULT_QUERIES, sum(d.queries for d in document_layout(seqlen)))


@dataclasses.dataclass
class Problem:
    """Random packed inputs; `grad_out` weights the loss `sum(out * grad_out)`."""

    shape: Shape
    documents: list[Document]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    index_q: torch.Tensor
    index_k: torch.Tensor
    grad_out: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor

    @property
    def document_args(self) -> tuple:
        """`(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)` as the ops take them."""
        return (self.cu_seqlens_q, self.cu_seqlens_k,
                max(d.queries for d in self.documents), max(d.keys for d in self.documents))

    def query_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per packed query token (CPU int64): the packed row of its document's first key, and p(t)."""
        key_start: list[int] = []
        position: list[int] = []
        offset = 0
        for doc in self.documents:
            key_start += [offset] * doc.queries
            position += range(doc.keys - doc.queries, doc.keys)
            offset += doc.keys
        return torch.tensor(key_start, dtype=torch.int64), torch.tensor(position, dtype=torch.int64)


def make_problem(documents: list[Document], dtype: torch.dtype, device: torch.device, seed: int,
                 shape: Shape = M3) -> Problem:
    # Drawn on the CPU so a seed gives the same inputs on every device.
    generator = torch.Generator().manual_seed(seed)
    num_queries = sum(d.queries for d in documents)
    num_keys = sum(d.keys for d in documents)

    def normal(*size):
        return torch.randn(*size, generator=generator).to(device=device, dtype=dtype)

    def boundaries(lengths):
        return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)

    return Problem(
        shape=shape,
        documents=documents,
        q=normal(num_queries, shape.query_heads, shape.head_dim),
        k=normal(num_keys, shape.kv_heads, shape.head_dim),
        v=normal(num_keys, shape.kv_heads, shape.head_dim),
        index_q=normal(num_queries, shape.kv_heads, shape.index_dim),
        index_k=normal(num_keys, 1, shape.index_dim),
        grad_out=normal(num_queries, shape.query_heads, shape.head_dim),
        cu_seqlens_q=boundaries([d.queries for d in documents]),
        cu_seqlens_k=boundaries([d.keys for d in documents]),
    )


# ---------------------------------------------------------------------------------------------
# Running the ops


@dataclasses.dataclass
class OpResults:
    block_indices: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    stage_ms: dict[str, float]


def about(seconds: float) -> str:
    """A duration for people: `0.4 s`, `12 s`, `1:05`."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s" if seconds < 60 else format_duration(seconds)


@contextlib.contextmanager
def timed_stage(label: str, device: torch.device, stage_ms: dict[str, float] | None = None, name: str = "",
                progress: Progress | None = None, expected_s: float | None = None):
    """Time the block, printing `label ...` (with `expected_s`) when it starts and `label: <ms> ms`
    when it ends; CUDA is synchronised around it, as launches return before the work is done."""
    expectation = "" if expected_s is None else f" (expected about {about(expected_s)})"
    if progress is not None:
        progress.start(name or label, expected_s)
    _print(f"{label} ...{expectation}", progress)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    if stage_ms is not None:
        stage_ms[name] = elapsed_ms
    if progress is not None:
        progress.advance()
    _print(f"{label}: {elapsed_ms:.1f} ms", progress)


def _print(line: str, progress: Progress | None) -> None:
    """`line` on stdout, flushed; on a terminal the progress display is redrawn below it."""
    if progress is None:
        print(line, flush=True)
    else:
        progress.write(line, file=sys.stdout)


STAGES = ("select_blocks", "forward", "backward")


def run_ops(problem: Problem, step: str = "", timed: bool = True, label: str = "running the ops",
            expected_s: dict[str, float] | None = None) -> OpResults:
    """select_blocks -> sparse_attention(return_lse=True) -> backward of sum(out * grad_out), timed."""
    shape, device = problem.shape, problem.q.device
    expected_s = expected_s or {}
    q, k, v = (x.detach().clone().requires_grad_() for x in (problem.q, problem.k, problem.v))
    stage_ms: dict[str, float] = {}
    # The stages differ too much for a mean time per stage to predict the next one.
    with Progress(label, len(STAGES), rate_estimate=False, summary=False, leave=False) as progress:

        def stage(name):
            return timed_stage(f"{step}{name}", device, stage_ms, name, progress, expected_s.get(name))

        with stage("select_blocks"):
            block_indices = torch_msa.select_blocks(problem.index_q, problem.index_k, *problem.document_args,
                                                    topk=shape.topk, block_size=shape.block_size)
        with stage("forward"):
            out, lse = torch_msa.sparse_attention(q, k, v, block_indices, *problem.document_args,
                                                  block_size=shape.block_size, return_lse=True)
        # The loss reads only `out`, so the gradient reaching the op is exactly `grad_out` (in any
        # dtype: d(sum)/d(out * w) is 1) and lse gets none.
        loss = (out * problem.grad_out).sum()
        with stage("backward"):
            dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    return OpResults(block_indices, out.detach(), lse.detach(), dq, dk, dv, stage_ms if timed else {})


def warm_up_problem(problem: Problem, seed: int) -> Problem:
    """On CPU the last `CPU_WARMUP_QUERIES` queries of the first document (the reference's time per
    query is constant, so a slice predicts the whole); elsewhere `problem`, compiling the kernels."""
    if problem.q.device.type != "cpu":
        return problem
    first = problem.documents[0]
    documents = [Document(min(CPU_WARMUP_QUERIES, first.queries), first.keys)]
    return make_problem(documents, problem.q.dtype, problem.q.device, seed, problem.shape)


# Sampled tokens the warm-up checks, to time the float64 check per token.
WARMUP_CHECKED_TOKENS = 4


def warm_up(problem: Problem, seed: int) -> dict[str, float]:
    """Each stage's expected seconds on `problem`, from its time on `warm_up_problem`."""
    warm = warm_up_problem(problem, seed)
    if warm is problem:
        print("warm-up on the same inputs, which also compiles the kernels on first use", flush=True)
    else:
        print(f"warm-up on {warm.q.shape[0]} queries of the first document, to time the stages", flush=True)
    scale = problem.q.shape[0] / warm.q.shape[0]
    results = run_ops(warm, step="  ", label="warm-up")
    tokens = sample_tokens(warm.documents)[:WARMUP_CHECKED_TOKENS]
    start = time.perf_counter()
    run_checks(warm, results, tokens, warm.q.dtype)
    check_s = (time.perf_counter() - start) * len(sample_tokens(problem.documents)) / len(tokens)
    return {name: ms * scale / 1e3 for name, ms in results.stage_ms.items()} | {"check": check_s}


# ---------------------------------------------------------------------------------------------
# Independent float64 checks


@dataclasses.dataclass
class Check:
    """One compared quantity: `error = max_abs / max(scale, 1)` must stay <= `tolerance`.

    The floor of 1 makes it absolute where the quantity vanishes exactly (dq, dk of a query
    seeing one key); the inputs are unit normals, so 1 is their natural size.
    """

    name: str
    max_abs: float
    scale: float
    tolerance: float
    note: str = ""

    @property
    def error(self) -> float:
        return self.max_abs / max(self.scale, 1.0)

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance  # False for NaN

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        text = f"  {self.name:<10} max abs {self.max_abs:9.2e}   rel {self.error:9.2e} <= {self.tolerance:.0e}   {verdict}"
        return f"{text}   {self.note}" if self.note else text


def sample_tokens(documents: list[Document], count: int = SAMPLED_TOKENS) -> list[int]:
    """About `count` packed query rows, evenly spaced inside each document (first and last token
    included), at least two per document, the rest in proportion to the document's queries."""
    total = sum(d.queries for d in documents)
    tokens, start = [], 0
    for doc in documents:
        if doc.queries:
            wanted = max(2, round(count * doc.queries / total))
            local = torch.linspace(0, doc.queries - 1, wanted).round().long().unique()
            tokens += (start + local).tolist()
        start += doc.queries
    return tokens


def selected_key_positions(block_ids: list[int], position: int, block_size: int) -> torch.Tensor:
    """Document-local key positions a query at `position` reads: the keys of its distinct valid
    blocks up to the causal horizon (ids are a set; -1 and blocks past the horizon add nothing)."""
    blocks = sorted({b for b in block_ids if b >= 0 and b * block_size <= position})
    parts = [torch.arange(b * block_size, min(b * block_size + block_size, position + 1)) for b in blocks]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _max_error(name: str, actual: torch.Tensor, expected: torch.Tensor, tolerance: float, note: str = "") -> Check:
    difference = (actual.double() - expected).abs()
    max_abs = difference.max().item() if difference.isfinite().all() else math.inf
    return Check(name, max_abs, expected.abs().max().item(), tolerance, note)


def check_attention(problem: Problem, results: OpResults, tokens: list[int], tolerance: Tolerance) -> list[Check]:
    """out, lse and dq of the sampled tokens against float64, over the key sets of the op's own
    block indices. dq[t] needs only row t: dS = P * (dP - delta), delta = rowsum(dO * O)."""
    shape = problem.shape
    scale = shape.head_dim ** -0.5
    key_start, position = problem.query_layout()
    rows = torch.tensor(tokens)
    q, grad_out = (x[rows.to(x.device)].cpu().double() for x in (problem.q, problem.grad_out))
    k, v = problem.k.cpu().double(), problem.v.cpu().double()
    block_indices = results.block_indices[:, rows.to(results.block_indices.device)].cpu()
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:2], dtype=torch.float64)
    dq = torch.zeros_like(q)
    for i, token in enumerate(tokens):
        for r in range(shape.kv_heads):
            ids = block_indices[r, i].tolist()
            keys = key_start[token] + selected_key_positions(ids, int(position[token]), shape.block_size)
            heads = slice(r * shape.group, (r + 1) * shape.group)
            key, value = k[keys, r], v[keys, r]
            scores = scale * q[i, heads] @ key.T
            lse[i, heads] = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - lse[i, heads, None])
            out[i, heads] = probs @ value
            delta = (grad_out[i, heads] * out[i, heads]).sum(-1, keepdim=True)
            grad_scores = probs * (grad_out[i, heads] @ value.T - delta)
            dq[i, heads] = scale * grad_scores @ key
    actual = {name: getattr(results, name)[rows.to(results.out.device)].cpu() for name in ("out", "lse", "dq")}
    return [
        _max_error("out", actual["out"], out, tolerance.out),
        _max_error("lse", actual["lse"], lse, tolerance.lse),
        _max_error("dq", actual["dq"], dq, tolerance.dq),
    ]


def check_selection(problem: Problem, block_indices: torch.Tensor, tokens: list[int], tolerance: Tolerance) -> Check:
    """The sampled tokens' block choices against float64 index scores.

    The error is the worst inversion (best rejected minus worst chosen block score) relative to
    max(|best rejected|, 1): within the tolerance, a near-tie that independent GEMMs may break
    either way. A broken id contract is an infinite error.
    """
    shape = problem.shape
    key_start, position = problem.query_layout()
    index_q = problem.index_q.cpu().double()
    index_k = problem.index_k[:, 0].cpu().double()
    chosen_rows = block_indices[:, torch.tensor(tokens).to(block_indices.device)].cpu()
    worst, exact, broken = 0.0, 0, []
    for i, token in enumerate(tokens):
        p = int(position[token])
        visible_blocks = p // shape.block_size + 1
        local_block = visible_blocks - 1
        keys = index_k[key_start[token]: key_start[token] + p + 1]
        # Pad the local block with -inf so every block max-pools over its visible keys only.
        padded = torch.full((visible_blocks * shape.block_size,), -math.inf, dtype=torch.float64)
        for r in range(shape.kv_heads):
            padded[: p + 1] = shape.index_dim ** -0.5 * (keys @ index_q[token, r])
            block_score = padded.view(visible_blocks, shape.block_size).amax(-1)
            ids = chosen_rows[r, i].tolist()
            valid = [b for b in ids if b >= 0]
            expected_count = min(shape.topk, visible_blocks)
            if (ids[: len(valid)] != valid or len(valid) != expected_count or valid[-1] != local_block
                    or len(set(valid)) != len(valid) or max(valid) >= visible_blocks):
                broken.append(f"token {token} head {r}: {ids}")
                continue
            chosen = valid[:-1]
            rejected = sorted(set(range(local_block)) - set(chosen))
            if not chosen or not rejected:
                exact += 1
                continue
            best_rejected = block_score[rejected].max().item()
            inversion = best_rejected - block_score[chosen].min().item()
            exact += inversion <= 0
            worst = max(worst, inversion / max(abs(best_rejected), 1.0))
    rows = len(tokens) * shape.kv_heads
    note = f"{exact}/{rows} (token, head) sets exact"
    if broken:
        note += f"; {len(broken)} break the id contract, e.g. {broken[0]}"
        worst = math.inf
    return Check("selection", worst, 1.0, tolerance.selection, note)


def key_counts(problem: Problem, block_indices: torch.Tensor) -> torch.Tensor:
    """`[Hkv, Tq]` number of keys each (KV head, query) reads: the visible keys of its distinct
    valid blocks."""
    block_size = problem.shape.block_size
    _, position = problem.query_layout()
    ids = block_indices.cpu().to(torch.int64).sort(-1).values
    repeated = torch.zeros_like(ids, dtype=torch.bool)
    repeated[..., 1:] = ids[..., 1:] == ids[..., :-1]
    visible = (position[None, :, None] - ids * block_size + 1).clamp(0, block_size)
    return torch.where((ids >= 0) & ~repeated, visible, 0).sum(-1)


def check_gradient_sums(problem: Problem, results: OpResults, tolerance: Tolerance) -> list[Check]:
    """Per KV head r, over all keys: sum dv = sum of grad_out over the queries (with a nonempty
    key set) and the G heads of group r; sum dk = 0. Each residual is measured against the sum
    of |terms| (the size a rounding error in the sum can reach)."""
    shape = problem.shape
    reads_keys = key_counts(problem, results.block_indices) > 0  # [Hkv, Tq]
    grad_out = problem.grad_out.cpu().double().view(-1, shape.kv_heads, shape.group, shape.head_dim)
    grad_out_total = torch.einsum("rt,trgd->rd", reads_keys.double(), grad_out)
    dv, dk = results.dv.cpu().double(), results.dk.cpu().double()
    dv_residual = (dv.sum(0) - grad_out_total).abs().max().item()
    dk_residual = dk.sum(0).abs().max().item()
    return [
        Check("sum dv", dv_residual, dv.abs().sum(0).max().item(), tolerance.dv_sum, "sum_j dv = sum_{t,h} dO"),
        Check("sum dk", dk_residual, dk.abs().sum(0).max().item(), tolerance.dk_sum, "sum_j dk = 0"),
    ]


def run_checks(problem: Problem, results: OpResults, tokens: list[int], dtype: torch.dtype) -> list[Check]:
    tolerance = TOLERANCES[dtype]
    return [
        check_selection(problem, results.block_indices, tokens, tolerance),
        *check_attention(problem, results, tokens, tolerance),
        *check_gradient_sums(problem, results, tolerance),
    ]


# ---------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torch_msa",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Self-check of the MSA ops: MiniMax-M3-shaped random inputs (Hq=64, Hkv=4, D=128, Hi=4,\n"
                    "Di=128, block_size=128, topk=16) packed as 4 documents; select -> forward -> backward\n"
                    "through torch.ops.msa, timed, and compared with float64.",
        epilog="How long it takes: on CPU (the reference backend) the default run takes 10 to 20 s on two\n"
               "cores and under a minute on two cores that a test suite also uses (about 20 s of CPU time\n"
               "in all; its threads are sized to the cores left free); the time grows with --queries,\n"
               "about 20 ms of CPU per query. On a GPU the ops take milliseconds, after a warm-up\n"
               "that compiles the kernels on first use (seconds per kernel). Each stage prints its expected\n"
               "time when it starts, measured by the warm-up.",
    )
    parser.add_argument("--device", help="torch device to run on (default: cuda if available, else cpu)")
    parser.add_argument("--seqlen", type=int, default=DEFAULT_SEQLEN,
                        help=f"key tokens in all, split into 4 documents (default: {DEFAULT_SEQLEN}); the first holds "
                             f"75%% of them, more than the topk * block_size = 2048 keys a query reads from 2730 on")
    parser.add_argument("--queries", type=int,
                        help=f"query tokens in all; each document's queries are the causal suffix of its keys. "
                             f"Default: on a GPU the full layout (3636 at --seqlen 4096: all keys of the first "
                             f"document but its first 15%%, all keys of the others); on CPU, where the time grows "
                             f"with the queries, {CPU_DEFAULT_QUERIES}, shared among the documents in proportion to "
                             f"the full layout")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16",
                        help="dtype of q, k, v and the index inputs (default: bf16)")
    parser.add_argument("--backend",
                        help=f"force a backend for the ops it implements (sets {backends.BACKEND_ENV}); the other "
                             f"ops resolve as usual; registered: {', '.join(backends.registered_backends())}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked; `args.device` is a `torch.device` and `args.queries` is set
    (None: the full layout)."""
    parser = _parser()
    args = parser.parse_args(argv)
    registered = backends.registered_backends()
    if args.backend is not None and args.backend not in registered:
        parser.error(f"argument --backend: unknown backend {args.backend!r}; registered backends: {', '.join(registered)}")
    if args.seqlen < len(DOCUMENT_SHARES):
        parser.error(f"argument --seqlen: expected at least {len(DOCUMENT_SHARES)} (one token per document), got {args.seqlen}")
    try:
        args.device = pick_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    if args.queries is None:
        args.queries = default_queries(args.device, args.seqlen)
    else:
        try:
            document_layout(args.seqlen, args.queries)
        except ValueError as error:
            parser.error(f"argument --{error}")
    return args


# ---------------------------------------------------------------------------------------------
# The machine and the package


def cpu_threads(cores: int, load: float, current: int) -> int:
    """Threads for torch's CPU ops: free cores (`cores` less the rounded 1-minute `load`), between 1
    and `current`; more threads than free cores preempt each other in every parallel region."""
    return max(1, min(current, cores - math.floor(load + 0.5)))


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a
    container's `--cpus`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def size_cpu_threads() -> str:
    """Set torch's CPU threads with `cpu_threads` (unless OMP_NUM_THREADS chose them) and say how."""
    if "OMP_NUM_THREADS" in os.environ:
        return f"{torch.get_num_threads()} threads, from OMP_NUM_THREADS"
    cores = available_cores()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = cpu_threads(cores, load, torch.get_num_threads())
    torch.set_num_threads(threads)
    return f"{threads} thread{'s' * (threads > 1)}: {cores} cores, load {load:.1f}"


@dataclasses.dataclass(frozen=True)
class InstalledCopy:
    """The torch_msa distribution installed in this environment."""

    version: str
    package_dir: Path  # its torch_msa package folder
    editable: bool  # `pip install -e`: package_dir is the checkout's own folder


def installed_copy() -> InstalledCopy | None:
    """The installed torch_msa distribution (from its metadata, whatever `import` finds), or None.

    Only a distribution with a `RECORD` counts: a checkout's build-time `torch_msa.egg-info` would
    otherwise pass for the installed copy.
    """
    distribution = next((d for d in importlib.metadata.distributions(name="torch_msa") if d.read_text("RECORD")), None)
    if distribution is None:
        return None
    direct_url = json.loads(distribution.read_text("direct_url.json") or "{}")
    editable = bool(direct_url.get("dir_info", {}).get("editable"))
    if editable:  # the package folder of the checkout it was installed from
        package_dir = Path(urllib.request.url2pathname(urllib.parse.urlparse(direct_url["url"]).path)) / "torch_msa"
    else:
        package_dir = Path(str(distribution.locate_file("torch_msa")))
    return InstalledCopy(distribution.version, package_dir, editable)


def package_report(imported_dir: Path, version: str, installed: InstalledCopy | None,
                   cwd: Path) -> tuple[str, str | None]:
    """`(line, warning)`: which torch_msa this run checks, and a warning (None if none) when that
    is not the installed copy, e.g. a checkout in the current directory, which `python -m` puts
    first on the module path."""
    imported_dir = imported_dir.resolve()
    from_cwd = imported_dir.parent == cwd.resolve()
    source = "the current directory" if from_cwd else "the module path"
    if installed is None:
        return f"{version} at {imported_dir} (not installed: imported from {source})", None
    kind = "an editable install" if installed.editable else "installed"
    if installed.package_dir.resolve() == imported_dir:
        return f"{version} at {imported_dir} ({kind})", None
    remedy = "run from another directory" if from_cwd else "remove its folder from PYTHONPATH"
    warning = (f"warning: this checks the torch_msa {version} at {imported_dir}, imported from {source} ahead of "
               f"the installed torch_msa {installed.version} at {installed.package_dir} ({kind}); {remedy} to check "
               f"the installed one")
    return f"{version} at {imported_dir} (not the installed copy: see the warning)", warning


def _describe_device(device: torch.device, threads: str) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"{device} ({threads})"


def _print_header(problem: Problem, args, resolved: dict[str, str], threads: str) -> None:
    shape, docs = problem.shape, problem.documents
    package, warning = package_report(Path(torch_msa.__file__).parent, torch_msa.__version__, installed_copy(),
                                      Path.cwd())
    print("torch_msa self-check", flush=True)
    print(f"  torch_msa  {package}")
    print(f"  device     {_describe_device(args.device, threads)}")
    print("  backends   " + "  ".join(f"{op}={name}" for op, name in resolved.items()))
    print(f"  dtype      {args.dtype}   seed {args.seed}")
    print(f"  shapes     q {list(problem.q.shape)}  k, v {list(problem.k.shape)}  "
          f"index_q {list(problem.index_q.shape)}  index_k {list(problem.index_k.shape)}")
    print(f"             block_size {shape.block_size}  topk {shape.topk}")
    print(f"  documents  Lk {[d.keys for d in docs]}  Lq {[d.queries for d in docs]}  "
          "(queries are the causal suffix of each document's keys)", flush=True)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)


def resolve_ops(device: torch.device) -> dict[str, str]:
    """The backend serving each op on `device`. A forced backend serves the ops it implements
    (or raises `BackendError` saying why it cannot); the others resolve as usual."""
    return {op: torch_msa.resolve(op, device).name for op in backends.OPS}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.backend is not None:
        os.environ[backends.BACKEND_ENV] = args.backend
    dtype = DTYPES[args.dtype]
    try:
        resolved = resolve_ops(args.device)
    except torch_msa.BackendError as error:
        print(f"error: {error}", file=sys.stderr)
        print("self-check: FAIL")
        return 1
    threads = size_cpu_threads() if args.device.type == "cpu" else ""
    problem = make_problem(document_layout(args.seqlen, args.queries), dtype, args.device, args.seed)
    _print_header(problem, args, resolved, threads)
    try:
        expected_s = warm_up(problem, args.seed)
        total_s = sum(expected_s.values())
        print(f"running the ops (expected about {about(total_s)} with the float64 check)", flush=True)
        results = run_ops(problem, step="  ", expected_s=expected_s)
        tokens = sample_tokens(problem.documents)
        with timed_stage(f"float64 check of {len(tokens)} sampled tokens and the dk/dv sums", args.device,
                         expected_s=expected_s["check"]):
            checks = run_checks(problem, results, tokens, dtype)
    except Exception:  # a crashing op is a failed check; show why
        traceback.print_exc()
        print("self-check: FAIL", flush=True)
        return 1

    timings = "  ".join(f"{name} {ms:.1f}" for name, ms in results.stage_ms.items())
    print(f"time (ms)    {timings}")
    counts = key_counts(problem, results.block_indices).double()
    _, position = problem.query_layout()
    sparse, dense = counts.mean().item(), (position + 1).double().mean().item()
    print(f"keys read    {sparse:.0f} per query and KV head on average vs {dense:.0f} dense causal "
          f"({sparse / dense:.1%})")
    print("against float64 (rel = max abs error / max(1, max |float64 value|); sums: / max(1, sum |terms|);"
          " selection: worst score inversion):")
    for check in checks:
        print(check.line())
    passed = all(check.passed for check in checks)
    print(f"self-check: {'PASS' if passed else 'FAIL'}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
