"""`torch.export` and AOTInductor with the msa ops, with a dynamic token dimension."""

import functools
import operator
import tempfile
import time
import typing
from pathlib import Path

import expecttest
import pytest
import torch
import torch.utils._pytree as pytree

import torch_msa

TOPK, BLOCK_SIZE = 2, 64


class Attention(torch.nn.Module):
    def forward(self, q, k, v, index_q, index_k):
        return torch_msa.msa_attention(q, k, v, index_q, index_k, topk=TOPK, block_size=BLOCK_SIZE)


class AttentionWithIndexLoss(torch.nn.Module):
    """The training-time graph: attention, then the index branch's KL loss on its selection."""

    def forward(self, q, k, v, index_q, index_k):
        attn = torch_msa.msa_attention(q, k, v, index_q, index_k, topk=TOPK, block_size=BLOCK_SIZE, return_lse=True,
                                       return_block_indices=True)
        loss = torch_msa.indexer_kl_loss(q, k, attn.lse, index_q, index_k, attn.block_indices, block_size=BLOCK_SIZE)
        return attn.out, loss


class AttentionReturningTheNamedTuple(torch.nn.Module):
    def forward(self, q, k, v, index_q, index_k):
        return torch_msa.msa_attention(q, k, v, index_q, index_k, topk=TOPK, block_size=BLOCK_SIZE, return_lse=True,
                                       index_loss=True)


def _inputs(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(tokens, 4, 64), (tokens, 2, 64), (tokens, 2, 64), (tokens, 2, 32), (tokens, 1, 32)]
    return tuple(torch.randn(s, generator=g) for s in shapes)


@functools.cache
def _exported() -> torch.export.ExportedProgram:
    tokens = torch.export.Dim("tokens", min=130, max=1000)
    # One dimension shared by q, k, v, index_q and index_k: one document, Tq == Tk.
    return torch.export.export(Attention(), _inputs(300), dynamic_shapes=tuple({0: tokens} for _ in range(5)))


def _ops(*names):
    """The OpOverloads among `names` that this torch version has."""
    found = set()
    for name in names:
        packet, overload = name.rsplit(".", 1)
        found.add(getattr(getattr(torch.ops.aten, packet, None), overload, None))
    return found - {None}


# Nodes whose presence or spelling varies across torch versions and says nothing about the msa ops.
_SKIPPED = _ops("sym_size.int", "_assert_scalar.default", "_assert_tensor_metadata.default",
                "sym_constrain_range_for_size.default")
_ALIASES = _ops("detach.default", "alias.default")


def _render(graph: torch.fx.Graph) -> str:
    """One line per call: `vN = target(args)`, with version-dependent names normalised.

    Placeholders keep their argument names, other nodes are numbered in order; every symbolic
    size reads `T` (all inputs share the one token dimension, and which input export reads it
    from is an implementation detail); detach/alias nodes are looked through and unused
    getitems dropped; kwargs (dtype, device, pin_memory of factory calls) are left out.
    """
    names, lines = {}, []

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return names[a]
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(arg(x) for x in a) + "]"
        return repr(a)

    for node in graph.nodes:
        if node.op == "placeholder":
            names[node] = node.name
        elif node.op == "output":
            lines.append(f"return {arg(node.args[0])}")
        elif node.target in _SKIPPED:
            names[node] = "T"
        elif node.target in _ALIASES:
            names[node] = names[node.args[0]]
        elif node.target is operator.getitem and not node.users:
            continue  # the unused lse: kept by some versions, dead-code-eliminated by others
        else:
            names[node] = f"v{len(lines)}"
            target = "getitem" if node.target is operator.getitem else str(node.target)
            lines.append(f"{names[node]} = {target}({', '.join(arg(a) for a in node.args)})")
    return "\n".join(lines)


class TestExport(expecttest.TestCase):
    def test_graph(self):
        graph = _exported().graph
        targets = {node.target for node in graph.nodes if node.op == "call_function"}
        self.assertIn(torch.ops.msa.select_blocks.default, targets)
        self.assertIn(torch.ops.msa.plan.default, targets)
        self.assertIn(torch.ops.msa.forward.default, targets)
        self.assertExpectedInline(_render(graph), """\
v0 = aten.arange.default(2)
v1 = aten.mul.Tensor(v0, T)
v2 = aten.mul.Tensor(v0, T)
v3 = msa.select_blocks.default(index_q, index_k, v1, v2, T, T, 2, 64)
v4 = msa.plan.default(v3, v1, v2, T, T, T, 64, 1024)
v5 = msa.forward.default(q, k, v, v3, v1, v2, T, T, 64, 0.125, v4)
v6 = getitem(v5, 0)
return [v6]""")

    def test_save_load_roundtrip(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "msa.pt2"
            torch.export.save(_exported(), path)
            loaded = torch.export.load(path).module()
        for tokens in (300, 700):
            x = _inputs(tokens, seed=tokens)
            torch.testing.assert_close(loaded(*x), Attention()(*x))

    @pytest.mark.slow
    def test_aoti_package_roundtrip(self):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            path = torch._inductor.aoti_compile_and_package(_exported(), package_path=str(Path(tmp) / "msa_aoti.pt2"))
            compiled = time.perf_counter() - start
            runner = torch._inductor.aoti_load_package(path)
            for tokens in (300, 700):
                x = _inputs(tokens, seed=tokens)
                torch.testing.assert_close(runner(*x), Attention()(*x))
        print(f"AOTInductor compile and package: {compiled:.1f} s")

    def test_index_loss_exports_and_roundtrips(self):
        tokens = torch.export.Dim("tokens", min=130, max=1000)
        exported = torch.export.export(AttentionWithIndexLoss(), _inputs(300),
                                       dynamic_shapes=tuple({0: tokens} for _ in range(5)))
        targets = {node.target for node in exported.graph.nodes if node.op == "call_function"}
        self.assertIn(torch.ops.msa.indexer_kl.default, targets)
        (loss_node,) = (node for node in exported.graph.nodes if node.target is torch.ops.msa.indexer_kl.default)
        # loss, teacher lse, index lse, teacher mass, and the teacher's index reductions [Tq, Hi, Di], [Tk, 1, Di]
        tokens_symbol = str(next(iter(exported.graph.find_nodes(op="placeholder"))).meta["val"].shape[0])
        shapes = [[str(size).replace(tokens_symbol, "tokens") for size in val.shape] for val in loss_node.meta["val"]]
        self.assertEqual(shapes, [[], ["tokens", "4"], ["tokens", "2"], ["tokens", "2"], ["tokens", "2", "32"],
                                  ["tokens", "1", "32"]])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "msa_kl.pt2"
            torch.export.save(exported, path)
            loaded = torch.export.load(path).module()
        x = _inputs(400, seed=4)
        for got, want in zip(loaded(*x), AttentionWithIndexLoss()(*x)):
            torch.testing.assert_close(got, want)

    def test_a_program_returning_the_named_tuple_saves_and_loads(self):
        """The output structure serialises (torch_msa registers the named tuples' names)."""
        exported = torch.export.export(AttentionReturningTheNamedTuple(), _inputs(300))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "msa_named.pt2"
            torch.export.save(exported, path)
            loaded = torch.export.load(path).module()
        x = _inputs(300, seed=3)
        got, want = loaded(*x), AttentionReturningTheNamedTuple()(*x)
        self.assertIs(type(got), torch_msa.MSALseIndexLossOutput)
        out, lse, kl, kl_value = got
        for field, value in zip(("out", "lse", "kl", "kl_value"), (out, lse, kl, kl_value), strict=True):
            torch.testing.assert_close(value, getattr(want, field), rtol=0, atol=0)

    def test_every_result_type_serialises(self):
        """Each of msa_attention's result types has a registered name, so an exported program
        returning any of them saves and loads as that type."""
        for result_type in typing.get_args(torch_msa.MSAResult):
            fields = [torch.zeros(1)] * len(result_type._fields)
            spec = pytree.tree_structure(result_type(*fields))
            loaded = pytree.treespec_loads(pytree.treespec_dumps(spec))
            self.assertEqual(loaded, spec)
            self.assertIs(type(pytree.tree_unflatten(fields, loaded)), result_type)
