"""A LoRA run reads its base DiT straight in the compute dtype (half the host memory of the fp32
copy) and gets the same bits as the fp32 read cast after: the frozen base's values, and the
adapters' initialisation, which peft would otherwise round to a half-precision base's dtype."""
from __future__ import annotations

import pytest
import torch

from hpcnft.algo.policy import add_lora, read_dtype
from hpcnft.algo.root_config import load_config
from hpcnft.models.families import family_named

CPU = torch.device("cpu")


@pytest.mark.parametrize("precision,finetune,want", [("bf16", "lora", torch.bfloat16), ("fp16", "lora", torch.float16),
                                                     ("fp32", "lora", torch.float32), ("bf16", "full", torch.float32)])
def test_a_lora_run_reads_its_base_in_the_compute_dtype_a_full_fine_tune_in_fp32(precision, finetune, want):
    cfg = load_config("tiny", [f"train.precision={precision}", f"train.finetune={finetune}"])
    assert read_dtype(cfg) == want


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_the_base_read_in_half_precision_is_the_fp32_read_cast_and_its_adapters_are_the_same(tiny_models, half):
    cfg = load_config("tiny")
    sd3 = family_named("sd3")
    wide = sd3.load(tiny_models[0], torch.float32, CPU).transformer
    narrow = sd3.load(tiny_models[0], torch.float32, CPU, transformer_dtype=half).transformer
    assert narrow.dtype == half
    for (name, a), (_, b) in zip(wide.state_dict().items(), narrow.state_dict().items()):
        assert torch.equal(a.to(half), b), name
    add_lora(wide, cfg)
    add_lora(narrow, cfg)
    trained = {n: p for n, p in narrow.named_parameters() if p.requires_grad}
    reference = {n: p for n, p in wide.named_parameters() if p.requires_grad}
    assert trained.keys() == reference.keys() and len(trained) > 0
    for n, p in trained.items():
        assert p.dtype == torch.float32 and torch.equal(p, reference[n]), n
    assert any(p.abs().sum() > 0 for p in trained.values())  # A drawn, not all zeros
    # and the base layers stay as read
    assert all(p.dtype == half for n, p in narrow.named_parameters() if not p.requires_grad and "norm" not in n)
