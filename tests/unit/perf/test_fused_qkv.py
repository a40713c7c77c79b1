"""perf.fuse_qkv on the tiny SD3.5 DiT (joint attention, an MMDiT-X attn2, q/k RMS norms): the
fused no-grad forward matches the three-GEMM forward, follows the weights it is entered with,
and leaves nothing behind."""
import contextlib

import pytest
import torch

from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.algo.sampler import velocity
from hpcnft.models.tiny import TINY_TRANSFORMER
from hpcnft.perf import fused_qkv, levers
from lora_tools import move_adapters, tiny_policy


def _inputs():
    c = TINY_TRANSFORMER
    g = torch.Generator().manual_seed(2)
    return (torch.randn(3, c["in_channels"], 8, 8, generator=g), torch.tensor([0.9, 0.5, 0.1]),
            torch.randn(3, 5, c["joint_attention_dim"], generator=g), torch.randn(3, c["pooled_projection_dim"], generator=g))


def _velocity(policy):
    with torch.no_grad():
        return velocity(policy.transformer, *_inputs(), torch.float32)


def test_every_attention_of_the_block_kinds_is_fused():
    policy = tiny_policy(merge_lora_nograd=True, fuse_qkv=True)
    names = {n for n, m in policy.transformer.named_modules() if m in fused_qkv._joint_attentions(policy.transformer)}
    assert names == {"transformer_blocks.0.attn", "transformer_blocks.0.attn2", "transformer_blocks.1.attn"}


def test_fused_forward_matches_merged_three_gemm_forward_and_restores():
    policy = tiny_policy(merge_lora_nograd=True, fuse_qkv=True)
    tr = policy.transformer
    with_lora = _velocity(policy)
    procs = [m.processor for m in fused_qkv._joint_attentions(tr)]
    policy.cfg.perf.fuse_qkv = False
    with levers.nograd_weights(policy):
        merged = _velocity(policy)
    policy.cfg.perf.fuse_qkv = True
    with levers.nograd_weights(policy):
        assert all(isinstance(m.processor, fused_qkv.FusedQKVProcessor) for m in tr.modules() if hasattr(m, "to_q"))
        fused = _velocity(policy)
    torch.testing.assert_close(fused, merged, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused, with_lora, rtol=1e-4, atol=1e-5)
    assert [m.processor for m in fused_qkv._joint_attentions(tr)] == procs  # processors back
    assert torch.equal(_velocity(policy), with_lora)  # and the LoRA forward bit for bit
    assert not any("hpcnft" in k for k in tr.state_dict())  # never checkpointed or exported


def test_fused_weights_follow_the_weights_at_entry():
    policy = tiny_policy(merge_lora_nograd=True, fuse_qkv=True)
    with levers.nograd_weights(policy):
        before = _velocity(policy)
    move_adapters(policy.transformer)
    with levers.nograd_weights(policy):
        after = _velocity(policy)
    policy.cfg.perf.fuse_qkv = False
    with levers.nograd_weights(policy):
        reference = _velocity(policy)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, reference, rtol=1e-5, atol=1e-6)


def test_fuse_qkv_with_lora_needs_merged_weights():
    with pytest.raises(ConfigError, match=r"^perf.fuse_qkv: .*merge_lora_nograd"):
        load_config("tiny", ["perf.fuse_qkv=true"])
    assert load_config("tiny", ["perf.fuse_qkv=true", "train.finetune=\"full\""]).perf.fuse_qkv


def test_deterministic_mode_keeps_fuse_qkv_and_turns_off_timed_choices():
    cfg = load_config("tiny", ["perf.fuse_qkv=true", "perf.merge_lora_nograd=true", "perf.compile_vae=true",
                               "perf.cudnn_benchmark=true", "perf.overlap_reward=true", "determinism.enabled=true"])
    perf = levers.effective(cfg)
    assert perf.fuse_qkv and perf.overlap_reward
    assert not perf.compile_vae and not perf.cudnn_benchmark


def _loss_and_grads(policy):
    tr = policy.transformer
    for p in tr.parameters():
        p.grad = None
    v = velocity(tr, *_inputs(), torch.float32)
    v.square().mean().backward()
    return v.detach(), {n: p.grad.clone() for n, p in tr.named_parameters() if p.requires_grad}


def test_fused_lora_trains_like_peft_layers():
    peft_policy, fused_policy = tiny_policy(), tiny_policy(fused_lora=True)
    assert fused_qkv.install_fused_lora(fused_policy.transformer) == 3
    v_peft, g_peft = _loss_and_grads(peft_policy)
    v_fused, g_fused = _loss_and_grads(fused_policy)
    torch.testing.assert_close(v_fused, v_peft, rtol=1e-5, atol=1e-6)
    assert g_fused.keys() == g_peft.keys() and any("add_q_proj.lora_A" in n for n in g_fused)
    for name in g_peft:
        torch.testing.assert_close(g_fused[name], g_peft[name], rtol=1e-4, atol=1e-7, msg=name)
    assert not any(p.grad is not None for p in fused_policy.transformer.parameters() if not p.requires_grad)


def test_fused_lora_steps_aside_where_the_adapters_are_off():
    peft_policy, fused_policy = tiny_policy(merge_lora_nograd=True), tiny_policy(merge_lora_nograd=True, fused_lora=True)
    fused_qkv.install_fused_lora(fused_policy.transformer)
    for ctx in (lambda p: levers.nograd_weights(p), lambda p: _adapters_off(p.transformer)):
        with ctx(peft_policy):
            want = _velocity(peft_policy)
        with ctx(fused_policy):
            got = _velocity(fused_policy)
        assert torch.equal(got, want)
    with levers.nograd_weights(peft_policy):
        merged = _velocity(peft_policy)
    fused_policy.cfg.perf.fuse_qkv = True  # the no-grad fused path over the fused-LoRA processors
    with levers.nograd_weights(fused_policy):
        torch.testing.assert_close(_velocity(fused_policy), merged, rtol=1e-5, atol=1e-6)
    assert all(isinstance(m.processor, fused_qkv.FusedLoRAProcessor)
               for m in fused_policy.transformer.modules() if hasattr(m, "to_q") and hasattr(m, "processor"))


@contextlib.contextmanager
def _adapters_off(tr):
    tr.disable_adapters()
    try:
        yield
    finally:
        tr.enable_adapters()


def test_fused_lora_needs_lora():
    with pytest.raises(ConfigError, match=r"^perf.fused_lora: "):
        load_config("tiny", ["perf.fused_lora=true", "train.finetune=\"full\""])


def test_refresh_copies_into_the_buffers_it_made():
    policy = tiny_policy(merge_lora_nograd=True, fuse_qkv=True)
    attn = policy.transformer.transformer_blocks[0].attn
    with levers.nograd_weights(policy):
        first = getattr(attn, fused_qkv.WEIGHT)
    with levers.nograd_weights(policy):
        assert getattr(attn, fused_qkv.WEIGHT) is first  # refreshed in place, not reallocated
    assert getattr(policy.transformer.transformer_blocks[0].attn2, fused_qkv.ADDED_WEIGHT) is None  # no text stream
