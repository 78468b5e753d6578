"""torch_msa in HF transformers' MiniMax-M3: the same logits and gradients as HF's eager path.

HF's model (written independently of torch_msa) is the oracle: a tiny random
`MiniMaxM3VLForCausalLM` with one sparse and one full-attention layer, in fp32.
"""

import copy
import json
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

from torch_msa.integrations.transformers import ATTENTION_NAME, PendingSelection, TorchMSAIndexer, use_torch_msa

SEQLEN, BLOCK, TOPK, VOCAB = 256, 64, 2, 64  # 4 blocks per row, 2 kept: the selection matters.


def _config(**overrides):
    settings = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, layer_types=["minimax_m3_sparse", "full_attention"], mlp_layer_types=["dense", "dense"],
        dense_intermediate_size=64,
        index_n_heads=2, index_head_dim=32, index_block_size=BLOCK, index_topk_blocks=TOPK,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        attn_implementation="eager", bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    settings.update(overrides)
    return MiniMaxM3VLTextConfig(**settings)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = MiniMaxM3VLForCausalLM(_config())
    with torch.no_grad():  # HF initialises the norms at zero (weight + 1): make them matter
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.3)
    return model


def _torch_msa_model(hf_model, indexer):
    model = copy.deepcopy(hf_model)
    if indexer == "torch_msa":
        use_torch_msa(model)
    else:  # HF's indexer, torch_msa's attention function
        model.set_attn_implementation(ATTENTION_NAME)
    return model


def _batch(lengths, left=False):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (len(lengths), SEQLEN), generator=generator)
    mask = torch.zeros(len(lengths), SEQLEN, dtype=torch.long)
    for row, length in enumerate(lengths):
        if left:
            mask[row, SEQLEN - length:] = 1
        else:
            mask[row, :length] = 1
    return ids * mask, mask


def _weights(shape):
    return torch.randn(*shape, VOCAB, generator=torch.Generator().manual_seed(2))


def _run(model, ids, real, **kwargs):
    """Logits at the real tokens and the gradients of a weighted sum of them."""
    model.zero_grad(set_to_none=True)
    logits = model(ids, **kwargs).logits
    (logits * _weights(ids.shape) * real[..., None]).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits[real.bool()].detach(), grads


def _assert_close(name, ours, theirs):
    # fp32 with a different summation order: errors relative to the tensor's own scale.
    scale = theirs.abs().max().item()
    error = (ours - theirs).abs().max().item()
    assert error <= 1e-5 * scale, f"{name}: max error {error:.3g} against a max of {scale:.3g}"


def _assert_same(ours, theirs):
    _assert_close("logits", ours[0], theirs[0])
    assert ours[1].keys() == theirs[1].keys()
    for name in theirs[1]:
        _assert_close(name, ours[1][name], theirs[1][name])


@pytest.mark.parametrize("indexer", ["hf", "torch_msa"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "right-padded"])
def test_same_logits_and_gradients_as_hf_eager(hf_model, indexer, padded):
    ids, mask = _batch([SEQLEN, 150] if padded else [SEQLEN, SEQLEN])
    kwargs = {"attention_mask": mask} if padded else {}
    theirs = _run(hf_model, ids, mask, **kwargs)
    ours = _run(_torch_msa_model(hf_model, indexer), ids, mask, **kwargs)
    assert any("indexer" not in name and "layers.0.self_attn" in name for name in theirs[1])
    _assert_same(ours, theirs)


def test_left_padding_equals_hf_on_each_sequence_alone(hf_model):
    lengths = [200, 131]
    ids, mask = _batch(lengths, left=True)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    ours = _run(_torch_msa_model(hf_model, "torch_msa"), ids, mask, attention_mask=mask, position_ids=position_ids)

    hf_model.zero_grad(set_to_none=True)
    logits = []
    for row, length in enumerate(lengths):
        alone = ids[row:row + 1, SEQLEN - length:]
        out = hf_model(alone).logits
        (out * _weights(ids.shape)[row:row + 1, SEQLEN - length:]).sum().backward()
        logits.append(out[0].detach())
    theirs = (torch.cat(logits),
              {name: p.grad.clone() for name, p in hf_model.named_parameters() if p.grad is not None})
    _assert_same(ours, theirs)


def test_4d_padding_mask(hf_model):
    ids, mask = _batch([SEQLEN, 170])
    causal = torch.ones(SEQLEN, SEQLEN, dtype=torch.bool).tril()
    mask_4d = (causal[None] & mask.bool()[:, None, :])[:, None]
    theirs = _run(hf_model, ids, mask, attention_mask=mask)
    _assert_same(_run(_torch_msa_model(hf_model, "torch_msa"), ids, mask, attention_mask=mask_4d), theirs)


LEFT_PADDED_BY_HF = ("attention_mask: row 1 is left-padded .* HF's indexer under attn_implementation='torch_msa' kept "
                     "blocks .* no union of whole blocks of the row's tokens.*use_torch_msa")


@pytest.mark.parametrize("slots, lengths", [(SEQLEN, [SEQLEN, 192]), (2 * BLOCK, [2 * BLOCK, 70])],
                         ids=["padding of one block", "every block kept"])
def test_hf_indexer_serves_left_padding_where_its_blocks_map(hf_model, slots, lengths):
    """HF's block ids count from the row's first slot, padding included; where the real keys they
    keep are whole blocks of the row's tokens (a padding of whole blocks, or rows of `TOPK` blocks,
    where HF keeps every block), torch_msa attends to exactly those keys: HF's result on the same
    left-padded batch."""
    ids, mask = (tensor[:, SEQLEN - slots:] for tensor in _batch(lengths, left=True))
    theirs = _run(hf_model, ids, mask, attention_mask=mask)
    _assert_same(_run(_torch_msa_model(hf_model, "hf"), ids, mask, attention_mask=mask), theirs)


def test_hf_indexer_refuses_left_padding_its_blocks_do_not_map_eagerly_and_compiled(hf_model):
    """131 real tokens after 125 padding slots: HF keeps blocks of slots that cut the row's blocks."""
    model = _torch_msa_model(hf_model, "hf")
    ids, mask = _batch([SEQLEN, 131], left=True)
    causal = torch.ones(SEQLEN, SEQLEN, dtype=torch.bool).tril()
    mask_4d = (causal[None] & mask.bool()[:, None, :])[:, None]
    for attention_mask in (mask, mask_4d):
        with pytest.raises(ValueError, match=LEFT_PADDED_BY_HF):
            model(ids, attention_mask=attention_mask)
    padded_inside = mask.clone()
    padded_inside[1, :] = 0
    padded_inside[1, 10:200] = 1  # padding at both ends: no document layout of torch_msa's
    with pytest.raises(ValueError, match="attention_mask: row 1 is neither left- nor right-padded"):
        model(ids, attention_mask=padded_inside)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=LEFT_PADDED_BY_HF):
        compiled(ids, attention_mask=mask)
    served_ids, served_mask = _batch([SEQLEN, 192], left=True)  # the same graph serves padding that maps
    with torch.no_grad():
        _assert_close("logits", compiled(served_ids, attention_mask=served_mask).logits[served_mask.bool()],
                      hf_model(served_ids, attention_mask=served_mask).logits[served_mask.bool()])


def _hf_selection(model, ids, **kwargs):
    captured = []
    hook = model.model.layers[0].self_attn.indexer.register_forward_hook(lambda module, args, out: captured.append(out))
    with torch.no_grad():
        model(ids, **kwargs)
    hook.remove()
    return captured[0]


def _ours_selection(model, ids, mask, **kwargs):
    captured = []
    indexer = model.model.layers[0].self_attn.indexer
    hook = indexer.register_forward_hook(lambda module, args, out: captured.append(out))
    with torch.no_grad():
        model(ids, attention_mask=mask, **kwargs)
    hook.remove()
    assert isinstance(captured[0], PendingSelection)
    return captured[0].block_indices(mask)


def _as_sets(block_indices):
    return [[set(row.tolist()) - {-1} for row in head] for head in block_indices]


def test_selections_equal_hf_as_sets(hf_model):
    ids, mask = _batch([SEQLEN, 150])
    theirs = _hf_selection(hf_model, ids, attention_mask=mask)
    ours = _ours_selection(_torch_msa_model(hf_model, "torch_msa"), ids, mask)
    assert ours.shape == (2, 2, SEQLEN, TOPK) and ours.dtype == torch.int64
    assert _as_sets(ours[0]) == _as_sets(theirs[0])
    assert _as_sets(ours[1, :, :150]) == _as_sets(theirs[1, :, :150])
    assert any(len(s) == TOPK for head in _as_sets(theirs[0]) for s in head[-64:])


def test_left_padded_selections_equal_hf_on_each_sequence_alone(hf_model):
    lengths = [256, 131]
    ids, mask = _batch(lengths, left=True)
    ours = _ours_selection(_torch_msa_model(hf_model, "torch_msa"), ids, mask)
    for row, length in enumerate(lengths):
        theirs = _hf_selection(hf_model, ids[row:row + 1, SEQLEN - length:])
        assert _as_sets(ours[row, :, SEQLEN - length:]) == _as_sets(theirs[0])


def _without_zero_indexer_grads(grads, expected):
    """AOTAutograd may hand the selection's non-differentiable inputs a zero gradient instead of None."""
    for name in grads.keys() - expected.keys():
        assert "indexer" in name and not grads.pop(name).any(), name
    return grads


@pytest.mark.parametrize("indexer", ["torch_msa", "hf"])
def test_compiled_forward_and_backward_have_no_graph_break(hf_model, indexer):
    """Right-padded, with torch_msa's indexer or HF's (whose mask check is an op of its own)."""
    model = _torch_msa_model(hf_model, indexer)
    ids, mask = _batch([SEQLEN, 150])
    expected = _run(model, ids, mask, attention_mask=mask)

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    logits = torch.compile(model, backend="aot_eager", fullgraph=True)(ids, attention_mask=mask).logits
    (logits * _weights(ids.shape) * mask[..., None]).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    _assert_same((logits[mask.bool()].detach(), _without_zero_indexer_grads(grads, expected[1])), expected)


def test_use_torch_msa_keeps_the_parameters(hf_model):
    model = _torch_msa_model(hf_model, "torch_msa")
    assert model.config._attn_implementation == ATTENTION_NAME
    assert isinstance(model.model.layers[0].self_attn.indexer, TorchMSAIndexer)
    assert model.state_dict().keys() == hf_model.state_dict().keys()


@pytest.mark.parametrize("overrides,message", [
    (dict(index_local_blocks=2), "index_local_blocks: .*expected 1, got 2"),
    (dict(head_dim=32), r"head_dim: torch_msa's sparse attention serves head dims \(64, 128\); got 32"),
    (dict(index_block_size=8), r"index_block_size: torch_msa serves blocks of \(64, 128\) keys; got 8"),
    (dict(layer_types=["full_attention"] * 2), "model: expected a MiniMax-M3 model with sparse layers"),
])
def test_use_torch_msa_rejects_configs_it_cannot_serve_up_front(overrides, message):
    model = MiniMaxM3VLForCausalLM(_config(**overrides))
    with pytest.raises(ValueError, match=message):
        use_torch_msa(model)
    assert model.config._attn_implementation == "eager"  # nothing was changed
    assert not any(isinstance(m, TorchMSAIndexer) for m in model.modules())


def test_switching_back_restores_hf_and_switching_again_torch_msa(hf_model):
    """set_attn_implementation undoes use_torch_msa: the patched indexer is HF's again."""
    model = _torch_msa_model(hf_model, "torch_msa")
    ids, mask = _batch([SEQLEN, 150])
    model.set_attn_implementation("eager")
    _assert_same(_run(model, ids, mask, attention_mask=mask), _run(hf_model, ids, mask, attention_mask=mask))
    model.set_attn_implementation(ATTENTION_NAME)
    _assert_same(_run(model, ids, mask, attention_mask=mask),
                 _run(_torch_msa_model(hf_model, "torch_msa"), ids, mask, attention_mask=mask))


def _enable_checkpointing(model):
    # activation_checkpointing_enable is the current name (transformers 5.24 deprecates the other).
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


@pytest.mark.parametrize("layout", ["right-padded", "packed position_ids", "packed cu_seq_lens"])
def test_gradient_checkpointing_gives_the_same_logits_and_gradients(hf_model, layout):
    """The recomputation in the backward selects again (and reads the packed kwargs again)."""
    model = _torch_msa_model(hf_model, "torch_msa").train()
    if layout == "right-padded":
        ids, real = _batch([SEQLEN, 150])
        kwargs = {"attention_mask": real}
    else:
        kwargs, _ = _packed_batch(layout == "packed cu_seq_lens")
        ids = kwargs.pop("input_ids")
        real = torch.ones_like(ids)
    expected = _run(model, ids, real, **kwargs)
    _enable_checkpointing(model)
    calls = []
    hook = model.model.layers[0].self_attn.indexer.register_forward_hook(lambda *args: calls.append(args))
    checkpointed = _run(model, ids, real, **kwargs)
    hook.remove()
    assert len(calls) == 2  # the forward, then its recomputation in the backward
    _assert_same(checkpointed, expected)


@pytest.mark.parametrize("indexer", ["hf", "torch_msa"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "right-padded"])
def test_a_batch_of_two_rows_equals_each_row_alone(hf_model, indexer, padded):
    model = _torch_msa_model(hf_model, indexer).eval()
    lengths = [SEQLEN, 150] if padded else [SEQLEN, SEQLEN]
    ids, mask = _batch(lengths)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask if padded else None).logits
        for row, length in enumerate(lengths):
            alone = model(ids[row:row + 1, :length]).logits[0]
            _assert_close(f"row {row}", batch[row, :length], alone)


def test_save_and_load_keep_the_outputs_and_torch_msa(hf_model, tmp_path):
    """HF does not save the attention implementation: name it when loading, or switch after."""
    model = _torch_msa_model(hf_model, "torch_msa")
    ids, mask = _batch([SEQLEN, 150])
    expected = _run(model, ids, mask, attention_mask=mask)
    model.save_pretrained(tmp_path)
    assert "attn_implementation" not in json.loads((tmp_path / "config.json").read_text())

    loaded = MiniMaxM3VLForCausalLM.from_pretrained(tmp_path, attn_implementation=ATTENTION_NAME)
    assert loaded.config._attn_implementation == ATTENTION_NAME  # HF's indexer, torch_msa's attention
    _assert_same(_run(loaded, ids, mask, attention_mask=mask), expected)
    use_torch_msa(loaded)
    assert isinstance(loaded.model.layers[0].self_attn.indexer, TorchMSAIndexer)
    _assert_same(_run(loaded, ids, mask, attention_mask=mask), expected)

    reloaded = use_torch_msa(MiniMaxM3VLForCausalLM.from_pretrained(tmp_path))
    assert reloaded.config._attn_implementation == ATTENTION_NAME
    _assert_same(_run(reloaded, ids, mask, attention_mask=mask), expected)


REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# Builds the tiny model with attn_implementation="torch_msa" in a fresh process, after `imports`.
_BUILD = """
import json, sys
{imports}
modules = set(sys.modules)
from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig
settings = {{**json.loads({settings!r}), "attn_implementation": "torch_msa"}}
try:
    print(MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**settings)).config._attn_implementation)
except ValueError as error:
    print(error)
print("transformers.modeling_utils" in modules, "torch_msa.integrations.transformers" in modules)
"""


@pytest.mark.parametrize("imports, expected", [
    # HF's modeling code first: `import torch_msa` registers "torch_msa" at once.
    ("from transformers import MiniMaxM3VLForCausalLM\nimport torch_msa", ["torch_msa", "True True"]),
    # transformers' top level first (no modeling code yet): registered when the model's code is imported.
    ("import transformers\nimport torch_msa", ["torch_msa", "False False"]),
    # torch_msa first: likewise, through the import hook; transformers is not imported by torch_msa.
    ("import torch_msa", ["torch_msa", "False False"]),
    # The integration itself, whatever the order.
    ("import torch_msa.integrations.transformers", ["torch_msa", "True True"]),
])
def test_import_torch_msa_registers_with_hf_whatever_the_order(imports, expected):
    code = _BUILD.format(imports=imports, settings=json.dumps(_config().to_dict()))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(expected[0]) and lines[1] == expected[1], result.stdout


def test_output_attentions_warns_once_that_there_are_no_weights(hf_model, monkeypatch):
    from torch_msa.integrations import transformers as integration

    monkeypatch.setattr(integration, "_warned_output_attentions", False)
    model = _torch_msa_model(hf_model, "torch_msa")
    ids = _batch([SEQLEN])[0]
    with pytest.warns(UserWarning, match="'torch_msa' attention does not return attention weights"):
        with torch.no_grad():
            model(ids, output_attentions=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(ids, output_attentions=True)  # once only


DOCS = [200, 131]  # two packed documents: the second starts inside the first's last block


def _packed_batch(flash_kwargs):
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(5)
    documents = [torch.randint(1, VOCAB, (n,), generator=generator) for n in DOCS]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": d.tolist()} for d in documents])
    batch.pop("labels")
    return batch, documents


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_packed_rows_equal_each_document_alone(hf_model, flash_kwargs):
    """HF's padding-free recipe (DataCollatorWithFlattening): every packed document, through the
    sparse and the full-attention layer, gives the logits and gradients of that document alone."""
    batch, documents = _packed_batch(flash_kwargs)
    model = _torch_msa_model(hf_model, "torch_msa")
    weights = _weights((1, sum(DOCS)))
    logits = model(**batch).logits
    (logits * weights).sum().backward()
    ours = (logits[0].detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})

    hf_model.zero_grad(set_to_none=True)
    alone, start = [], 0
    for document in documents:
        out = hf_model(document[None]).logits
        (out * weights[:, start:start + len(document)]).sum().backward()
        alone.append(out[0].detach())
        start += len(document)
    theirs = (torch.cat(alone), {name: p.grad.clone() for name, p in hf_model.named_parameters() if p.grad is not None})
    _assert_same(ours, theirs)


def test_packed_rows_through_hf_indexer_are_refused(hf_model):
    batch, _ = _packed_batch(True)
    with pytest.raises(ValueError, match="cu_seq_lens_q: packed rows .* need torch_msa's indexer.*use_torch_msa"):
        _torch_msa_model(hf_model, "hf")(**batch)


def _row_packed_position_ids(lengths):
    return torch.cat([torch.arange(n) for n in lengths])


@pytest.mark.parametrize("layout", ["[1, S]", "[B, S]"])
def test_packed_position_ids_pack_every_row_of_a_batch(hf_model, layout):
    """HF's usual `[1, S]` position_ids restarting per document pack every row of the batch alike
    (as HF's masks read them); `[B, S]` packs each row its own way. Each document of each row gets
    the logits of that document alone."""
    rows = [DOCS, DOCS] if layout == "[1, S]" else [DOCS, [64, 150, 117]]
    ids = torch.randint(1, VOCAB, (2, sum(DOCS)), generator=torch.Generator().manual_seed(6))
    position_ids = torch.stack([_row_packed_position_ids(lengths) for lengths in rows])
    model = _torch_msa_model(hf_model, "torch_msa").eval()
    with torch.no_grad():
        logits = model(ids, position_ids=position_ids[:1] if layout == "[1, S]" else position_ids).logits
        for row, lengths in enumerate(rows):
            start = 0
            for length in lengths:
                alone = hf_model(ids[row:row + 1, start:start + length]).logits[0]
                _assert_close(f"row {row}, document at {start}", logits[row, start:start + length], alone)
                start += length


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_packed_rows_take_no_cache_and_generate_is_refused(hf_model, flash_kwargs):
    """Generation continues one sequence per row; a packed row holds several, so generate() (which
    passes a cache) is refused before anything is computed, and a forward of packed rows returns
    no cache that a later decode could read across documents."""
    batch, _ = _packed_batch(flash_kwargs)
    model = _torch_msa_model(hf_model, "torch_msa").eval()
    with torch.no_grad():
        assert model(**batch).past_key_values is None
    name = "cu_seq_lens_q" if flash_kwargs else "position_ids"
    calls = []
    hook = model.model.layers[0].self_attn.indexer.register_forward_hook(lambda *args: calls.append(args))
    with pytest.raises(ValueError, match=f"{name}: packed rows .* cannot be decoded from a cache"):
        model.generate(**batch, max_new_tokens=3, do_sample=False)
    hook.remove()
    assert not calls


def test_packed_kwargs_are_checked():
    from torch_msa.integrations.transformers import packed_kwargs_from_position_ids

    assert packed_kwargs_from_position_ids(torch.arange(7)[None]) is None  # one document: nothing to pack
    assert packed_kwargs_from_position_ids(torch.arange(7)[None], batch_size=3) is None  # one per row
    packed = packed_kwargs_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 5, 6]]))
    assert packed["cu_seq_lens_q"].tolist() == [0, 3, 5, 7] and packed["max_length_k"] == 3
    broadcast = packed_kwargs_from_position_ids(torch.tensor([[0, 1, 2, 0, 1]]), batch_size=2)
    assert broadcast["cu_seq_lens_k"].tolist() == [0, 3, 5, 8, 10] and broadcast["max_length_q"] == 3
    rows = packed_kwargs_from_position_ids(torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]]))
    assert rows["cu_seq_lens_q"].tolist() == [0, 4, 6, 8] and rows["max_length_k"] == 4
    with pytest.raises(ValueError, match=r"position_ids: expected \[3, S\] or \[1, S\], got \(2, 4\)"):
        packed_kwargs_from_position_ids(torch.zeros(2, 4, dtype=torch.long), batch_size=3)


def test_packed_rows_take_no_padding_mask(hf_model):
    batch, _ = _packed_batch(True)
    mask = torch.ones_like(batch["input_ids"])
    with pytest.raises(ValueError, match="attention_mask: expected None with packed rows"):
        _torch_msa_model(hf_model, "torch_msa")(**batch, attention_mask=mask)


def test_sparse_attention_dropout_is_refused(hf_model):
    model = _torch_msa_model(hf_model, "torch_msa")
    model.model.layers[0].self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="dropout: .*expected 0.0, got 0.1"):
        model(_batch([SEQLEN])[0])


@pytest.mark.parametrize("layout", [[], ["--packed"]], ids=["padded", "packed"])
def test_training_example_runs_and_learns(layout):
    import pathlib
    import re
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[2] / "examples" / "train_tiny_m3.py"
    result = subprocess.run([sys.executable, str(script), "--device", "cpu", "--steps", "4", "--seqlen", "192", *layout],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    losses = [float(x) for x in re.findall(r"loss (\S+)", result.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], result.stdout


def test_vision_language_model_switches_only_its_text_model():
    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = MiniMaxM3VLConfig(text_config=_config().to_dict(), vision_config=vision, projector_hidden_size=64)
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    reference = MiniMaxM3SparseForConditionalGeneration(config)
    model = use_torch_msa(copy.deepcopy(reference))
    assert model.config.text_config._attn_implementation == ATTENTION_NAME
    assert model.config.vision_config._attn_implementation != ATTENTION_NAME
    ids, mask = _batch([SEQLEN, 150])
    with torch.no_grad():
        theirs = reference(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        ours = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    _assert_close("logits", ours, theirs)


def _decode(model, ids, mask, prefill):
    """Logits of the last token of a prefill of `prefill` tokens, then of each token decoded from the cache."""
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids[:, :prefill], attention_mask=mask[:, :prefill], position_ids=position_ids[:, :prefill],
                    use_cache=True)
        logits, cache = [out.logits[:, -1]], out.past_key_values
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=position_ids[:, t:t + 1],
                        past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


def test_decoding_a_left_padded_batch_equals_hf_on_each_sequence_alone(hf_model):
    lengths, prefill = [SEQLEN, 150], SEQLEN - 6  # 6 tokens decoded from the cache
    ids, mask = _batch(lengths, left=True)
    ours = _decode(_torch_msa_model(hf_model, "torch_msa"), ids, mask, prefill)
    for row, length in enumerate(lengths):
        alone = ids[row:row + 1, SEQLEN - length:]
        theirs = _decode(hf_model, alone, torch.ones_like(alone), prefill - (SEQLEN - length))
        _assert_close(f"row {row}", ours[row], theirs[0])


def test_a_static_cache_is_refused(hf_model):
    from transformers import StaticCache

    model = _torch_msa_model(hf_model, "torch_msa")
    cache = StaticCache(config=model.config, max_cache_len=SEQLEN)
    with pytest.raises(ValueError, match="past_key_values: torch_msa decodes from a DynamicCache; got a static cache"):
        model(_batch([128])[0][:, :128], past_key_values=cache, use_cache=True)
