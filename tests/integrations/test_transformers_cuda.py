"""HF MiniMax-M3 with torch_msa at M3 attention shapes (64/4/128, index 4 x 128, block 128, top-16) in bf16.

The oracle is HF's own sdpa path in fp32; torch_msa in bf16 must be as close to it as HF's
sdpa path in bf16 is. Needs a CUDA device (skipped without one).
"""

import copy

import pytest
import torch

pytestmark = pytest.mark.cuda

SEQLEN, VOCAB = 4096, 512


def _model():
    from transformers import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    config = MiniMaxM3VLTextConfig(
        vocab_size=VOCAB, hidden_size=512, num_hidden_layers=2, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, layer_types=["minimax_m3_sparse", "full_attention"], mlp_layer_types=["dense", "dense"],
        dense_intermediate_size=1024, index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
        attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = MiniMaxM3VLForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.3)
    return model.cuda()


def _run(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask).logits
    weights = torch.randn(logits.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    (logits.float() * weights * mask[..., None]).sum().backward()
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
             "model.embed_tokens.weight"]
    grads = {name: parameter.grad.float() for name, parameter in model.named_parameters() if name in names}
    return logits[mask.bool()].float().detach(), grads


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_m3_attention_shapes_bf16_against_hf_fp32():
    from torch_msa.integrations.transformers import use_torch_msa

    reference = _model()
    hf_bf16 = copy.deepcopy(reference).to(torch.bfloat16)
    ours = use_torch_msa(copy.deepcopy(reference).to(torch.bfloat16))
    ids = torch.randint(1, VOCAB, (2, SEQLEN), device="cuda")
    mask = torch.ones(2, SEQLEN, dtype=torch.long, device="cuda")
    mask[1, 3000:] = 0
    ids = ids * mask

    expected = _run(reference, ids, mask)
    theirs = _run(hf_bf16, ids, mask)
    got = _run(ours, ids, mask)
    assert torch.isfinite(got[0]).all()
    hf_error, our_error = _relative(theirs[0], expected[0]), _relative(got[0], expected[0])
    assert our_error <= 1.5 * hf_error + 1e-3, (our_error, hf_error)
    for name in expected[1]:
        hf_error, our_error = _relative(theirs[1][name], expected[1][name]), _relative(got[1][name], expected[1][name])
        assert our_error <= 1.5 * hf_error + 1e-3, (name, our_error, hf_error)


def test_m3_selection_bf16_matches_hf_as_sets():
    from torch_msa.integrations.transformers import use_torch_msa

    hf_bf16 = _model().to(torch.bfloat16)
    ours = use_torch_msa(copy.deepcopy(hf_bf16))
    ids = torch.randint(1, VOCAB, (1, SEQLEN), device="cuda")
    captured = []
    for model in (hf_bf16, ours):
        hook = model.model.layers[0].self_attn.indexer.register_forward_hook(lambda m, a, out: captured.append(out))
        with torch.no_grad():
            model(ids)
        hook.remove()
    theirs, ours_blocks = captured[0], captured[1].block_indices(None)
    theirs_sorted = theirs.masked_fill(theirs < 0, 1 << 40).sort(-1).values
    ours_kept = ours_blocks[..., : theirs.shape[-1]]
    ours_sorted = ours_kept.masked_fill(ours_kept < 0, 1 << 40).sort(-1).values
    same = (theirs_sorted == ours_sorted).all(-1).float().mean().item()
    # Both score in fp32 from the same bf16 index inputs; only near-ties may order differently.
    assert same >= 0.999, same


@pytest.mark.parametrize("support", ["sparse", "dense"])
def test_m3_index_losses_bf16_against_fp32(support):
    """`use_torch_msa(model, index_loss=...)` on the GPU kernels: the bf16 model's KL is the fp32
    model's within bf16 rounding (the sparse one on a selection that may differ at near-ties), and
    only the indexer gets its gradients. In training the sparse KL is computed by the attention's
    backward (`msa::backward_with_index_loss`, fused on Hopper): its value is read after it."""
    from torch_msa.integrations.transformers import index_loss_values, index_losses, use_torch_msa

    reference = _model()
    bf16 = use_torch_msa(copy.deepcopy(reference).to(torch.bfloat16), index_loss=support)
    fp32 = use_torch_msa(reference, index_loss=support)
    ids = torch.randint(1, VOCAB, (2, SEQLEN), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    mask = torch.ones(2, SEQLEN, dtype=torch.long, device="cuda")
    mask[1, 3000:] = 0
    kls = {}
    for name, model in (("fp32", fp32), ("bf16", bf16)):
        model(ids * mask, attention_mask=mask)
        (kl,) = index_losses(model)
        assert kl.dtype == torch.float32 and kl.requires_grad, (name, kl)
        kl.backward()
        (value,) = index_loss_values(model)
        assert value.dtype == torch.float32 and torch.isfinite(value) and value.item() > 0, (name, value)
        kls[name] = value.item()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads and all(".indexer." in n for n in grads), sorted(grads)
        assert all(torch.isfinite(g).all() and g.any() for g in grads.values())
    assert abs(kls["bf16"] - kls["fp32"]) <= 0.05 * kls["fp32"], kls
