"""Training MiniMax-M3's indexer through `use_torch_msa(model, index_loss=...)` and `index_losses`.

A tiny random model with two sparse layers and one full-attention layer, in fp32. The KL itself is
checked against its definition in tests/core/test_reference_index_loss.py; here: one KL per sparse layer,
its gradients reach the indexers only (the trunk with `detach_index_inputs=False`), the task
loss's gradients do not change, the dense warm-up attends densely, and the per-forward reset.
"""

import copy
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch
from transformers import MiniMaxM3VLForCausalLM

from tests.integrations.test_transformers import SEQLEN, _batch, _config, _enable_checkpointing, _packed_batch
from torch_msa.diagnostics import TorchMSAWarning
from torch_msa.integrations.transformers import ATTENTION_NAME, index_loss_values, index_losses, use_torch_msa

SPARSE_LAYERS = ["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"]


def _three_layer_config(**overrides):
    return _config(num_hidden_layers=3, layer_types=SPARSE_LAYERS, mlp_layer_types=["dense"] * 3, **overrides)


@pytest.fixture(scope="module")
def base_model():
    torch.manual_seed(0)
    model = MiniMaxM3VLForCausalLM(_three_layer_config())
    with torch.no_grad():  # HF initialises the norms at zero (weight + 1): make them matter
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.3)
    return model


def _switched(base_model, **kwargs):
    return use_torch_msa(copy.deepcopy(base_model), **kwargs)


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _is_index_parameter(name):
    return ".indexer." in name


def _inputs(layout):
    """`(batch, labels)`: the model's inputs and next-token labels on the real tokens."""
    if layout == "packed":
        batch, _ = _packed_batch(True)
        return batch, batch["input_ids"]
    ids, mask = _batch([SEQLEN, 150])
    return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("layout", ["right-padded", "packed"])
@pytest.mark.parametrize("support", ["sparse", "dense"])
def test_one_kl_per_sparse_layer_that_trains_the_indexers_only(base_model, support, layout):
    model = _switched(base_model, index_loss=support)
    batch, _ = _inputs(layout)
    model(**batch)
    kls = index_losses(model)
    assert len(kls) == 2 and all(kl.dim() == 0 and kl.requires_grad for kl in kls)
    if support == "sparse":  # in training the backward computes the KL: placeholders until then
        assert all(kl.item() == 0 for kl in kls) and all(v.item() == 0 for v in index_loss_values(model))

    sum(kls).backward()
    values = index_loss_values(model)
    assert len(values) == 2 and all(v.dim() == 0 and torch.isfinite(v) and v.item() > 0 for v in values)
    assert not any(v.requires_grad for v in values)
    grads = _grads(model)
    index_names = {name for name, _ in model.named_parameters() if _is_index_parameter(name)}
    assert {name for name, grad in grads.items() if grad.abs().sum() > 0} == index_names
    assert grads.keys() == index_names  # the trunk (attention, MLPs, embeddings, norms) gets None


@pytest.mark.parametrize("support", ["sparse", "dense"])
def test_the_task_loss_gradients_do_not_change(base_model, support):
    """(loss + c * sum(kls)).backward(): the trunk's gradients are the task loss's, the indexers' c times the KL's."""
    batch, labels = _inputs("right-padded")
    coefficient = 0.25
    model = _switched(base_model, index_loss=support)
    out = model(**batch, labels=labels)
    (out.loss + coefficient * sum(index_losses(model))).backward()
    combined = _grads(model)

    model.zero_grad(set_to_none=True)
    model(**batch)
    sum(index_losses(model)).backward()
    kl_only = _grads(model)

    # The task loss alone, from a model of the same attention without an index loss (the warm-up's
    # is dense: HF's model with full-attention layers everywhere).
    if support == "dense":
        reference = MiniMaxM3VLForCausalLM(_config(num_hidden_layers=3, layer_types=["full_attention"] * 3,
                                                   mlp_layer_types=["dense"] * 3))
        missing, unexpected = reference.load_state_dict(base_model.state_dict(), strict=False)
        assert not missing and all(_is_index_parameter(name) for name in unexpected)
    else:
        reference = _switched(base_model)
    reference_loss = reference(**batch, labels=labels).loss
    torch.testing.assert_close(out.loss, reference_loss, rtol=1e-5, atol=1e-6)
    reference_loss.backward()
    task_only = _grads(reference)

    assert kl_only.keys() == {name for name in combined if _is_index_parameter(name)}
    for name, grad in combined.items():
        if _is_index_parameter(name):
            torch.testing.assert_close(grad, coefficient * kl_only[name], rtol=1e-5, atol=1e-7)
        else:
            torch.testing.assert_close(grad, task_only[name], rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_detach_index_inputs_false_lets_the_kl_into_the_trunk(base_model):
    model = _switched(base_model, index_loss="sparse", detach_index_inputs=False)
    batch, _ = _inputs("right-padded")
    model(**batch)
    sum(index_losses(model)).backward()
    grads = _grads(model)
    # Through the indexers' inputs: the embeddings, the layer norms before the sparse layers and
    # the layers below the last sparse one. The teacher stays a constant: the sparse layers' own
    # attention projections get nothing from the KL.
    for name in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                 "model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert grads[name].abs().sum() > 0, name
    for name in ("model.layers.2.self_attn.q_proj.weight", "model.layers.2.self_attn.v_proj.weight", "lm_head.weight"):
        assert name not in grads or not grads[name].any(), name


def test_the_sparse_kl_over_every_block_equals_the_dense_kl():
    """With topk covering every block the selected support is the dense one, and so is the KL."""
    torch.manual_seed(0)
    base = MiniMaxM3VLForCausalLM(_three_layer_config(index_topk_blocks=SEQLEN // 64))
    batch, _ = _inputs("packed")
    kls = {}
    for support in ("sparse", "dense"):
        model = _switched(base, index_loss=support)
        model(**batch)
        sum(index_losses(model)).backward()
        kls[support] = index_loss_values(model)
    for sparse, dense in zip(kls["sparse"], kls["dense"], strict=True):
        torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # computed in the forward
        model = _switched(base, index_loss="sparse")
        model(**batch)
        for sparse, dense in zip(index_losses(model), kls["dense"], strict=True):
            torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_kls_and_gradients(base_model):
    batch, labels = _inputs("right-padded")
    results = []
    for checkpointing in (False, True):
        model = _switched(base_model, index_loss="sparse").train()
        if checkpointing:
            _enable_checkpointing(model)
        out = model(**batch, labels=labels)
        (out.loss + sum(index_losses(model))).backward()
        # Under checkpointing the backward recomputes the forward: the values still reach the
        # tensors index_loss_values gives.
        kls = [value.clone() for value in index_loss_values(model)]
        assert all(kl.item() > 0 for kl in kls)
        results.append((kls, _grads(model)))
    (kls, grads), (checkpointed_kls, checkpointed_grads) = results
    for a, b in zip(kls, checkpointed_kls):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert grads.keys() == checkpointed_grads.keys()
    for name in grads:
        torch.testing.assert_close(checkpointed_grads[name], grads[name], rtol=1e-5, atol=1e-7)


def test_reentrant_checkpointing_kls_warn_that_they_train_nothing(base_model):
    """Reentrant checkpointing runs the first forward under no_grad: its KLs could not train the
    indexers, and `index_losses` says so instead of handing back constants silently."""
    batch, labels = _inputs("right-padded")
    model = _switched(base_model, index_loss="sparse").train()
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model(**batch, labels=labels)
    with pytest.warns(TorchMSAWarning, match="use_reentrant=False"):
        kls = index_losses(model)
    assert not any(kl.requires_grad for kl in kls)
    with torch.no_grad(), warnings.catch_warnings():  # reading them for a log, without grad: no warning
        warnings.simplefilter("error")
        assert len(index_losses(model)) == 2


def test_a_model_with_kls_can_be_copied(base_model):
    """The KLs belong to the step's autograd graph: a copy (an EMA model, an eval copy) starts
    without them, and the original keeps its own."""
    model = _switched(base_model, index_loss="sparse")
    batch, _ = _inputs("right-padded")
    model(**batch)
    for backward_done in (False, True):
        twin = copy.deepcopy(model)
        with pytest.raises(ValueError, match="none for layers"):
            index_losses(twin)
        twin(**batch)
        sum(index_losses(twin)).backward()
        if not backward_done:
            sum(index_losses(model)).backward()
        assert all(value.item() > 0 for value in index_loss_values(model))
        for a, b in zip(index_loss_values(twin), index_loss_values(model), strict=True):
            torch.testing.assert_close(a, b)


def test_compiled_forward_and_backward_give_the_same_kls_and_gradients(base_model):
    batch, labels = _inputs("right-padded")
    model = _switched(base_model, index_loss="sparse")
    out = model(**batch, labels=labels)
    (out.loss + sum(index_losses(model))).backward()
    expected_kls = index_loss_values(model)
    expected = _grads(model)

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    out = torch.compile(model, backend="aot_eager", fullgraph=True)(**batch, labels=labels)
    kls = index_losses(model)
    (out.loss + sum(kls)).backward()
    for a, b in zip(index_loss_values(model), expected_kls, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    grads = {name: grad for name, grad in _grads(model).items() if name in expected or grad.any()}
    assert grads.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-5, atol=1e-7)


def test_each_forward_replaces_the_kls_and_switching_stops_them(base_model):
    model = _switched(base_model, index_loss="sparse")
    batch, _ = _inputs("right-padded")
    with pytest.raises(ValueError, match=r"got none for layers \[0, 2\]: run a forward"):
        index_losses(model)
    with torch.no_grad():
        model(**batch)
        first = index_losses(model)
        model(input_ids=batch["input_ids"][:1])
        second = index_losses(model)
    assert all(a is not b and not torch.equal(a, b) for a, b in zip(first, second))

    model.set_attn_implementation("eager")  # HF's indexer and attention again: no KL
    with torch.no_grad():
        model(**batch)
    with pytest.raises(ValueError, match=r"got none for layers \[0, 2\]"):
        index_losses(model)
    model.set_attn_implementation(ATTENTION_NAME)
    with torch.no_grad():
        model(**batch)
    assert len(index_losses(model)) == 2

    use_torch_msa(model)  # again, without an index loss
    with pytest.raises(ValueError, match="model: expected a model switched with use_torch_msa.*without an index loss"):
        index_losses(model)


def test_bad_index_loss_arguments_name_the_argument(base_model):
    model = copy.deepcopy(base_model)
    with pytest.raises(TypeError, match=r"index_loss: expected None or one of \('sparse', 'dense'\), got bool True"):
        use_torch_msa(model, index_loss=True)
    with pytest.raises(ValueError, match=r"index_loss: expected None or one of \('sparse', 'dense'\), got 'selected'"):
        use_torch_msa(model, index_loss="selected")
    with pytest.raises(TypeError, match="detach_index_inputs: expected a bool, got int"):
        use_torch_msa(model, index_loss="sparse", detach_index_inputs=0)
    with pytest.raises(ValueError, match="detach_index_inputs: .*expected True .* with index_loss=None, got False"):
        use_torch_msa(model, detach_index_inputs=False)
    assert model.config._attn_implementation == "eager"  # nothing was changed
    with pytest.raises(ValueError, match="model: expected a model switched with use_torch_msa"):
        index_losses(model)


def test_index_branch_example_runs_and_lowers_the_kl():
    script = pathlib.Path(__file__).parents[2] / "examples" / "train_index_branch.py"
    result = subprocess.run([sys.executable, str(script), "--device", "cpu", "--warmup-steps", "3", "--steps", "3",
                             "--seqlen", "256"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    warmup = [float(x) for x in re.findall(r"stage 1 .* kl (\S+)", result.stdout)]
    sparse = [(float(loss), float(kl)) for loss, kl in re.findall(r"stage 2 .* loss (\S+) +kl (\S+)", result.stdout)]
    assert len(warmup) == 3 and len(sparse) == 3, result.stdout
    assert warmup[-1] < warmup[0], result.stdout
    assert sparse[-1][0] < sparse[0][0], result.stdout
