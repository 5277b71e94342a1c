"The host cost of a fused layer step against the stock one: the kernel count from the code (issue 34, item 2)"
import pytest, torch
from torch.profiler import profile, ProfilerActivity
from clfast import host_cost

def test_the_counter_counts_kernels_not_views_or_free_copies():
    "On the CPU, where every ATen op runs: computing ops count, allocations, views and copies that copy nothing do not"
    x = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        x.mul_(2); x.select(0, 1); x.to(torch.float32); x.to(torch.bfloat16); x.contiguous(memory_format=torch.channels_last)
        x.contiguous(); torch.empty(3); x.permute(0, 2, 3, 1)
    assert host_cost.kernel_ops(p) == ['mul_', 'to', 'contiguous']

def test_launches_are_the_codes():
    "What a fused step launches: the Triton kernels of `triton_kernels` and the C++ node's ATen ops, convs left out"
    l = host_cost.launches(torch.float32, 'relu', False, 'speed')
    assert l['triton'] == ['_stats_partial', '_stats_final', '_params', '_fwd', '_bwd_partial', '_bwd_final', '_bwd_dx']
    assert 'batch_norm' in l['stock'] and 'native_batch_norm_backward' in l['stock']
    assert not {'convolution', 'convolution_backward'} & set(l['aten'] + l['stock'])

@pytest.mark.xfail(strict=True, reason="issue 34 item 2, open: a fused conv-BN-ReLU step launches 11 kernels besides the "
                   "convs (7 Triton; 4 ATen for the unbiased variance and the running statistics), stock 5")
@pytest.mark.parametrize('dtype,act,residual', [(torch.float32, 'relu', False), (torch.bfloat16, 'silu', True)])
def test_a_fused_step_launches_no_more_kernels_than_stock(dtype, act, residual):
    "The goal of fusing: no more launches than stock cuDNN BN + act (+ add), per layer step, forward and backward"
    l = host_cost.launches(dtype, act, residual, 'speed')
    assert len(l['triton']) + len(l['aten']) <= len(l['stock']), l
