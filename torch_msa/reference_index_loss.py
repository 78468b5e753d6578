"""Pure-PyTorch reference of the index loss (`msa::indexer_kl` and `msa::indexer_kl_backward`).

For query `t` and index head `r` (serving KV head `r` and its query heads `h = G * r + g`), over
the support `J(t, r)`: the visible keys of the selected blocks read as a set (sparse), or every key
`j <= p(t)` of `t`'s document (dense, `block_indices=None`). Teacher
`P_t[j] = mean_g exp(softmax_scale <q[t, h], k[j, r]> - lse[t, h])`, a constant (`lse` omitted:
the log-sum-exp over the support); student `P_s[j] = exp(u[j] - lse_s)`,
`u[j] = index_softmax_scale <index_q[t, r], index_k[j, 0]>`.

`loss = sum_(t, r) KL(P_t || P_s) / (Tq * Hi)`. With `A = sum_J P_t (log P_t - u)` and the mass
`M = sum_J P_t`: `KL = A + M * lse_s` and `dKL / du[j] = M * P_s[j] - P_t[j]`. The teacher half of
the gradient is reduced in the forward (`teacher_index_keys`, `teacher_index_queries`), so the
backward recomputes only the student. Queries go in chunks and keys in spans (no `T x T` buffer);
invalid slots are removed with `where`, so a NaN in one document never reaches another.
"""

import math

import torch

from .contract import compute_dtype
from .documents import Documents, QueryDocuments
from .reference import _chunks, _finite_or_zero, _heads_first, _KeyGather, _tokens_first


def loss_dtype(index_dtype: torch.dtype) -> torch.dtype:
    """Dtype of the loss, the student's lse and the teacher's mass: fp64 for fp64 index inputs, else fp32."""
    return compute_dtype(index_dtype)


class _Span:
    """A span of one query chunk's support: gathered per query (`[Hkv, C, N]`), or `shared` by the
    chunk's queries (`token_rows [N]`, `valid [1, C, N]`)."""

    def __init__(self, token_rows: torch.Tensor, valid: torch.Tensor, shared: bool):
        self.token_rows = token_rows
        self.valid = valid
        self.shared = shared


def _sparse_span(block_indices, docs: QueryDocuments, start, end, num_kv_heads, block_size) -> _Span:
    gather = _KeyGather(block_indices, docs, start, end, num_kv_heads, block_size)
    token_rows = (gather.rows // num_kv_heads).view(gather.shape)
    return _Span(token_rows, gather.valid.view(gather.shape), shared=False)


def _dense_spans(docs: QueryDocuments, start, end, num_keys, span_keys, device):
    key_start = docs.key_start[start:end, None]
    last_key = key_start + docs.position[start:end, None]  # < key_start for a query that sees nothing
    for first in range(0, num_keys, span_keys):
        rows = torch.arange(first, min(num_keys, first + span_keys), device=device)
        valid = (rows >= key_start) & (rows <= last_key)
        yield _Span(rows, valid[None], shared=True)


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, 0)


# Keys per span of the dense support: long enough for efficient GEMMs, short enough that a chunk
# still holds many queries.
_DENSE_SPAN_KEYS = 2048


class _Problem:
    """The inputs of one loss evaluation and the per-chunk pieces both passes share."""

    def __init__(self, q, k, index_q, index_k, block_indices, documents: Documents, block_size, softmax_scale,
                 index_softmax_scale):
        """`q`, `k` are None for the student alone, `index_q`, `index_k` for the teacher alone."""
        self.q, self.k, self.index_q, self.index_k = q, k, index_q, index_k
        self.block_indices, self.block_size = block_indices, block_size
        self.softmax_scale, self.index_softmax_scale = softmax_scale, index_softmax_scale
        if index_q is not None:
            self.num_queries, self.num_kv_heads, self.index_dim = index_q.shape
            self.num_keys = index_k.shape[0]
            self.dtype = loss_dtype(index_q.dtype)
            self.device = index_q.device
            self.index_keys = index_k.reshape(self.num_keys, self.index_dim)
            element_size = index_q.element_size()
        else:
            self.num_queries, (self.num_keys, self.num_kv_heads) = q.shape[0], k.shape[:2]
            self.index_dim = 0
            self.dtype = compute_dtype(q.dtype)
            self.device = q.device
            element_size = q.element_size()
        if q is not None:
            self.num_heads, self.dim = q.shape[1:]
            self.dtype = torch.promote_types(compute_dtype(q.dtype), self.dtype)
            self.k_flat = k.reshape(-1, self.dim)
        else:
            self.num_heads, self.dim = 0, 0
        self.docs = documents.locate(self.num_queries, self.num_keys)
        if block_indices is None:
            # Bytes per (query, key) pair of a shared span.
            per_key = 16 * self.num_heads + 32 * self.num_kv_heads
            self.span_keys = max(1, min(self.num_keys, _DENSE_SPAN_KEYS))
        else:
            # Bytes per (query, support key) pair: gathered keys in two dtypes, scores, student terms.
            per_key = (self.num_kv_heads * (self.dim + 2 * self.index_dim) * (element_size + 8)
                       + self.num_heads * 24 + self.num_kv_heads * 24)
            self.span_keys = block_indices.shape[-1] * block_size
        self.row_bytes = self.span_keys * per_key

    def chunks(self):
        return _chunks(self.num_queries, self.row_bytes, self.device)

    def spans(self, start, end):
        if self.block_indices is None:
            yield from _dense_spans(self.docs, start, end, self.num_keys, self.span_keys, self.device)
        else:
            yield _sparse_span(self.block_indices, self.docs, start, end, self.num_kv_heads, self.block_size)

    def teacher_scores(self, start, end, span: _Span) -> torch.Tensor:
        """`softmax_scale q k^T` over the span, `[Hkv, C, G, N]`, `-inf` outside the support."""
        heads = torch.arange(self.num_kv_heads, device=self.device).view(-1, 1, 1)
        query = _heads_first(self.q[start:end], self.num_kv_heads, self.dtype) * self.softmax_scale
        if span.shared:
            keys = self.k[span.token_rows].to(self.dtype).transpose(0, 1)  # [Hkv, N, D]
            count, group = query.shape[1], query.shape[2]
            scores = torch.matmul(query.reshape(self.num_kv_heads, count * group, self.dim), keys.transpose(-1, -2))
            scores = scores.view(self.num_kv_heads, count, group, -1)
        else:
            rows = torch.where(span.valid, span.token_rows * self.num_kv_heads + heads, 0)
            keys = self.k_flat.index_select(0, rows.reshape(-1)).view(*rows.shape, self.dim).to(self.dtype)
            scores = torch.matmul(query, keys.transpose(-1, -2))
        return scores.masked_fill(~span.valid[:, :, None, :], -math.inf)

    def index_keys_of(self, span: _Span) -> torch.Tensor:
        """Index keys of the span in the compute dtype: `[N, Di]` when shared, else `[Hkv, C, N, Di]`
        (row 0 at invalid slots)."""
        keys = self.index_keys.index_select(0, span.token_rows.reshape(-1))
        return keys.view(*span.token_rows.shape, self.index_dim).to(self.dtype)

    def index_queries(self, start, end) -> torch.Tensor:
        """`[Hi, C, Di]` index queries of the chunk."""
        return self.index_q[start:end].to(self.dtype).transpose(0, 1)

    def student_logits(self, index_queries, index_keys, span: _Span) -> torch.Tensor:
        """`u`, `[Hi, C, N]`, `-inf` outside the support."""
        if span.shared:
            logits = torch.matmul(index_queries, index_keys.t())
        else:
            logits = torch.matmul(index_queries[:, :, None, :], index_keys.transpose(-1, -2))[:, :, 0]
        return (logits * self.index_softmax_scale).masked_fill(~span.valid, -math.inf)

    def teacher_probs(self, scores, teacher_lse) -> torch.Tensor:
        """`P_t`, `[Hkv, C, N]`: the mean over the group of `exp(score - lse)` (0 outside the support)."""
        return scores.sub_(_finite_or_zero(teacher_lse)[..., None]).exp_().mean(-2)

    def given_teacher(self, teacher, start, end, span: _Span) -> torch.Tensor:
        """`P_t`, `[Hi, C, N]` in the compute dtype, of the chunk's rows of a `[Tq, Hi, topk,
        block_size]` teacher (sparse span): 0 outside the support, whatever those slots hold."""
        rows = teacher[start:end].to(self.dtype).transpose(0, 1).reshape(span.valid.shape)
        return torch.where(span.valid, rows, 0)

    def weighted_sums(self, weights, index_queries, index_keys, span: _Span, key_sums) -> torch.Tensor:
        """The two reductions of `weights [Hi, C, N]` (0 outside the support): returns
        `sum_j w[r, t, j] index_k[j]` as `[C, Hi, Di]`, and adds `sum_(t, r) w[r, t, j] index_q[t, r]`
        into the rows `j` of `key_sums [Tk, Di]`."""
        # A query's NaN lse makes its weights NaN off its support too.
        weights = torch.where(span.valid, weights, 0)
        if span.shared:
            # GEMMs over the chunk's queries and the span's keys: finite operands, so a NaN of one
            # document cannot reach another through a zero weight.
            query_sums = torch.matmul(weights, _finite(index_keys)).transpose(0, 1)
            key_sums.index_add_(0, span.token_rows,
                                torch.matmul(weights.transpose(-1, -2), _finite(index_queries)).sum(0))
        else:
            # Invalid slots gather row 0, which may be another document's.
            keys = torch.where(span.valid[..., None], index_keys, 0)
            query_sums = torch.matmul(weights[:, :, None, :], keys)[:, :, 0].transpose(0, 1)
            contribution = torch.where(span.valid[..., None], weights[..., None] * index_queries[:, :, None, :], 0)
            key_sums.index_add_(0, span.token_rows.reshape(-1), contribution.reshape(-1, self.index_dim))
        return query_sums


def _teacher_lse(problem: _Problem, start, end) -> torch.Tensor:
    """`[Hkv, C, G]` log-sum-exp of the teacher's scores over the support."""
    lse = torch.full((problem.num_kv_heads, end - start, problem.num_heads // problem.num_kv_heads), -math.inf,
                     dtype=problem.dtype, device=problem.device)
    for span in problem.spans(start, end):
        lse = torch.logaddexp(lse, torch.logsumexp(problem.teacher_scores(start, end, span), -1))
    return lse


def _chunk_teacher_lse(problem: _Problem, lse, start, end) -> torch.Tensor:
    """`[Hkv, C, G]` the teacher's lse of a chunk: `lse`'s rows, or (None) over the support."""
    if lse is None:
        return _teacher_lse(problem, start, end)
    return _heads_first(lse[start:end], problem.num_kv_heads, problem.dtype)


def _teacher_terms(probs, logits) -> tuple[torch.Tensor, torch.Tensor]:
    """`(A, M)`, `[Hi, C]` each, of one span: `sum P_t (log P_t - u)` and `sum P_t`, from
    `probs [Hi, C, N]` (0 outside the support) and the student's `logits` (`-inf` there)."""
    positive = probs > 0
    log_probs = torch.where(positive, probs, 1).log()
    weighted = torch.where(positive, probs * (log_probs - torch.where(positive, logits, 0)), 0).sum(-1)
    return weighted, probs.sum(-1)


def _divergence(weighted, mass, student_lse) -> torch.Tensor:
    """`KL = A + M * lse_s` per (index head, query); 0 where the teacher has no mass."""
    return weighted + torch.where(mass > 0, mass * _finite_or_zero(student_lse), 0)


def indexer_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor | None,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    block_indices: torch.Tensor | None,
    documents: Documents,
    block_size: int,
    softmax_scale: float,
    index_softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss and the forward's reductions its backward needs.

    Args:
        q: `[Tq, Hq, D]`, k: `[Tk, Hkv, D]`: the main branch's queries and keys.
        lse: `[Tq, Hq]` the main attention's log-sum-exp (fp32; fp64 for fp64 q), or None.
        index_q: `[Tq, Hi, Di]` with `Hi == Hkv`; index_k: `[Tk, 1, Di]`.
        block_indices: int32 `[Hkv, Tq, topk]`, or None for the dense support.

    Returns:
        `loss` (0-D), `teacher_lse [Tq, Hq]` (lse's dtype), `index_lse [Tq, Hi]` (`-inf` on an
        empty support), `teacher_mass [Tq, Hi]`, `teacher_index_keys [Tq, Hi, Di]`
        (`sum_J P_t[j] index_k[j]`) and `teacher_index_queries [Tk, 1, Di]`
        (`sum_((t, r): j in J) P_t[t, r, j] index_q[t, r]`); fp32, fp64 for fp64 index inputs.
    """
    problem = _Problem(q, k, index_q, index_k, block_indices, documents, block_size, softmax_scale, index_softmax_scale)
    out_dtype = loss_dtype(index_q.dtype)
    num_queries, num_index_heads, index_dim = index_q.shape
    index_lse = torch.full((num_queries, num_index_heads), -math.inf, dtype=out_dtype, device=q.device)
    teacher_mass = torch.zeros((num_queries, num_index_heads), dtype=out_dtype, device=q.device)
    teacher_index_keys = torch.zeros(index_q.shape, dtype=out_dtype, device=q.device)
    teacher_index_queries = torch.zeros((problem.num_keys, index_dim), dtype=problem.dtype, device=q.device)
    teacher_lse = (torch.full((num_queries, problem.num_heads), -math.inf, dtype=compute_dtype(q.dtype), device=q.device)
                   if lse is None else lse.clone())
    divergence = torch.zeros((num_queries, num_index_heads), dtype=problem.dtype, device=q.device)
    if num_queries > 0 and problem.num_keys > 0:
        for start, end in problem.chunks():
            chunk_lse = _chunk_teacher_lse(problem, lse, start, end)
            if lse is None:
                teacher_lse[start:end] = _tokens_first(chunk_lse).to(teacher_lse.dtype)
            index_queries = problem.index_queries(start, end)
            student_lse = torch.full((num_index_heads, end - start), -math.inf, dtype=problem.dtype, device=q.device)
            weighted = torch.zeros_like(student_lse)  # A
            mass = torch.zeros_like(student_lse)  # M
            index_key_sums = torch.zeros((end - start, num_index_heads, index_dim), dtype=problem.dtype, device=q.device)
            for span in problem.spans(start, end):
                probs = problem.teacher_probs(problem.teacher_scores(start, end, span), chunk_lse)
                index_keys = problem.index_keys_of(span)
                logits = problem.student_logits(index_queries, index_keys, span)
                student_lse = torch.logaddexp(student_lse, torch.logsumexp(logits, -1))
                span_weighted, span_mass = _teacher_terms(probs, logits)
                weighted += span_weighted
                mass += span_mass
                index_key_sums += problem.weighted_sums(probs, index_queries, index_keys, span, teacher_index_queries)
            divergence[start:end] = _divergence(weighted, mass, student_lse).transpose(0, 1)
            index_lse[start:end] = student_lse.transpose(0, 1).to(out_dtype)
            teacher_mass[start:end] = mass.transpose(0, 1).to(out_dtype)
            teacher_index_keys[start:end] = index_key_sums.to(out_dtype)
    loss = divergence.sum() / max(1, num_queries * num_index_heads)
    return (loss.to(out_dtype), teacher_lse, index_lse, teacher_mass, teacher_index_keys,
            teacher_index_queries.view(problem.num_keys, 1, index_dim).to(out_dtype))


def indexer_kl_backward(
    grad_loss: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_lse: torch.Tensor,
    teacher_mass: torch.Tensor,
    teacher_index_keys: torch.Tensor,
    teacher_index_queries: torch.Tensor,
    block_indices: torch.Tensor | None,
    documents: Documents,
    block_size: int,
    index_softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(d index_q [Tq, Hi, Di], d index_k [Tk, 1, Di])` in the index inputs' dtype, from the
    forward's `index_lse`, `teacher_mass` and teacher terms; only the student is recomputed.

    With `c = grad_loss * index_softmax_scale / (Tq * Hi)`:
    `d index_q[t, r] = c * (M * sum_J P_s[j] index_k[j] - teacher_index_keys[t, r])` and
    `d index_k[j] = c * (sum_((t, r): j in J) M P_s[t, r, j] index_q[t, r] - teacher_index_queries[j])`.
    """
    problem = _Problem(None, None, index_q, index_k, block_indices, documents, block_size, None, index_softmax_scale)
    num_queries, num_index_heads, index_dim = index_q.shape
    d_index_q = torch.zeros(index_q.shape, dtype=problem.dtype, device=index_q.device)
    d_index_k = torch.zeros((problem.num_keys, index_dim), dtype=problem.dtype, device=index_q.device)
    if num_queries > 0 and problem.num_keys > 0:
        coefficient = grad_loss.to(problem.dtype) * (index_softmax_scale / (num_queries * num_index_heads))
        for start, end in problem.chunks():
            student_lse = _finite_or_zero(index_lse[start:end].to(problem.dtype).transpose(0, 1))[..., None]
            mass = teacher_mass[start:end].to(problem.dtype).transpose(0, 1)[..., None]
            index_queries = problem.index_queries(start, end)  # [Hi, C, Di]
            for span in problem.spans(start, end):
                index_keys = problem.index_keys_of(span)
                logits = problem.student_logits(index_queries, index_keys, span)
                student = mass * (logits - student_lse).exp()
                d_index_q[start:end] += problem.weighted_sums(student, index_queries, index_keys, span, d_index_k)
        d_index_q = (d_index_q - teacher_index_keys.to(problem.dtype)) * coefficient
        d_index_k = (d_index_k - teacher_index_queries.view(problem.num_keys, index_dim).to(problem.dtype)) * coefficient
    return d_index_q.to(index_q.dtype), d_index_k.view(index_k.shape).to(index_k.dtype)


def teacher_probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor | None,
    block_indices: torch.Tensor,
    documents: Documents,
    block_size: int,
    softmax_scale: float,
) -> torch.Tensor:
    """`P_t` of the sparse loss per selected slot, `[Tq, Hkv, topk, block_size]` fp32 (fp64 for
    fp64 q), 0 outside the support: the input of `index_loss_from_teacher`. `lse` as in `indexer_kl`."""
    problem = _Problem(q, k, None, None, block_indices, documents, block_size, softmax_scale, None)
    num_kv_heads, num_queries, topk = block_indices.shape
    teacher = torch.zeros((num_queries, num_kv_heads, topk, block_size), dtype=problem.dtype, device=q.device)
    if num_queries > 0 and problem.num_keys > 0:
        for start, end in problem.chunks():
            chunk_lse = _chunk_teacher_lse(problem, lse, start, end)
            span = _sparse_span(block_indices, problem.docs, start, end, num_kv_heads, block_size)
            probs = torch.where(span.valid, problem.teacher_probs(problem.teacher_scores(start, end, span), chunk_lse), 0)
            teacher[start:end] = probs.view(num_kv_heads, end - start, topk, block_size).transpose(0, 1)
    return teacher


def index_loss_from_teacher(
    teacher: torch.Tensor,
    grad_loss: torch.Tensor | None,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    block_indices: torch.Tensor,
    documents: Documents,
    block_size: int,
    index_softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The sparse loss and its gradients from a given teacher: q, k and lse are not read.

    Args:
        teacher: `[Tq, Hi, topk, block_size]`, any float dtype, as `teacher_probabilities` lays it
            out; slots outside the support are never read (NaN there adds nothing).
        grad_loss: the loss's incoming gradient (0-D), or None for the loss alone.
        index_q: `[Tq, Hi, Di]`; index_k: `[Tk, 1, Di]`; block_indices: int32 `[Hi, Tq, topk]`.

    Returns:
        `(loss, d_index_q, d_index_k)`, as `indexer_kl` then `indexer_kl_backward` give them;
        the gradients are None when `grad_loss` is None.
    """
    problem = _Problem(None, None, index_q, index_k, block_indices, documents, block_size, None, index_softmax_scale)
    num_queries, num_index_heads, index_dim = index_q.shape
    divergence = torch.zeros((num_queries, num_index_heads), dtype=problem.dtype, device=index_q.device)
    d_index_q = torch.zeros(index_q.shape, dtype=problem.dtype, device=index_q.device)
    d_index_k = torch.zeros((problem.num_keys, index_dim), dtype=problem.dtype, device=index_q.device)
    if num_queries > 0 and problem.num_keys > 0:
        for start, end in problem.chunks():
            # The sparse support is one span per chunk: the student's lse is final at once.
            span = _sparse_span(block_indices, problem.docs, start, end, num_index_heads, block_size)
            index_queries = problem.index_queries(start, end)
            index_keys = problem.index_keys_of(span)
            logits = problem.student_logits(index_queries, index_keys, span)
            probs = problem.given_teacher(teacher, start, end, span)
            student_lse = torch.logsumexp(logits, -1)
            weighted, mass = _teacher_terms(probs, logits)
            divergence[start:end] = _divergence(weighted, mass, student_lse).transpose(0, 1)
            if grad_loss is not None:
                student = mass[..., None] * (logits - _finite_or_zero(student_lse)[..., None]).exp()
                d_index_q[start:end] += problem.weighted_sums(student - probs, index_queries, index_keys, span,
                                                              d_index_k)
    loss = (divergence.sum() / max(1, num_queries * num_index_heads)).to(loss_dtype(index_q.dtype))
    if grad_loss is None:
        return loss, None, None
    coefficient = grad_loss.to(problem.dtype) * (index_softmax_scale / max(1, num_queries * num_index_heads))
    return (loss, (d_index_q * coefficient).to(index_q.dtype),
            (d_index_k * coefficient).view(index_k.shape).to(index_k.dtype))
