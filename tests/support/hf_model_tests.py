"""pytest plugin: HF's own MiniMax-M3-VL model tests with HF's attention or torch_msa's.

Run by hand from a transformers checkout at the installed version (docs/testing.md, "HF's own
model tests"); the suite never loads it:

    HF_MSA_ATTN=torch_msa PYTHONPATH=<torch_msa checkout>:<torch_msa checkout>/tests/support \\
        python -m pytest -p hf_model_tests tests/models/minimax_m3_vl/test_modeling_minimax_m3_vl.py

`HF_MSA_ATTN=hf` (the default): HF's own implementations, sdpa by default and eager where a test
asks for it: the baseline. `HF_MSA_ATTN=torch_msa`: every MiniMax-M3 text model that would get
"sdpa" (asked for, or by default) gets `attn_implementation="torch_msa"` (HF's indexer, torch_msa's
attention); the vision tower keeps sdpa. Both modes give the tester's text config `head_dim` and
`index_block_size` 64 (torch_msa serves 64 and 128; HF's tester uses 32 and 8), so that both run
the same models.
"""

import os

HF_MSA_ATTN = os.environ.get("HF_MSA_ATTN", "hf")
TEXT_CONFIG_OVERRIDES = {"head_dim": 64, "index_block_size": 64}
TESTER = "MiniMaxM3VLVisionText2TextModelTester"

if HF_MSA_ATTN == "torch_msa":
    from transformers import PreTrainedModel

    import torch_msa  # noqa: F401  (registers "torch_msa" with HF)

    _hf_choice = PreTrainedModel.get_correct_attn_implementation

    def _torch_msa_for_minimax_m3_text(self, requested_attention, is_init_check=False):
        chosen = _hf_choice(self, requested_attention, is_init_check)
        if chosen == "sdpa" and getattr(self.config, "model_type", None) == "minimax_m3_vl_text":
            return "torch_msa"
        return chosen

    PreTrainedModel.get_correct_attn_implementation = _torch_msa_for_minimax_m3_text
elif HF_MSA_ATTN != "hf":
    raise ValueError(f"HF_MSA_ATTN: expected 'hf' or 'torch_msa', got {HF_MSA_ATTN!r}")


def pytest_collection_modifyitems(items):
    for tester in {getattr(item.module, TESTER, None) for item in items} - {None}:
        init = tester.__init__

        def __init__(self, *args, _init=init, **kwargs):
            _init(self, *args, **kwargs)
            self.text_config = {**self.text_config, **TEXT_CONFIG_OVERRIDES}

        tester.__init__ = __init__


def pytest_report_header(config):
    return f"HF_MSA_ATTN={HF_MSA_ATTN}: attention of the MiniMax-M3 text model; text config {TEXT_CONFIG_OVERRIDES}"
