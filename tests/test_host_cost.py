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
    # forward: statistics with BN's parameters and the running statistics' update, the normalized output; backward: sums, dx
    assert l['triton'] == ['_stats', '_fwd', '_bwd_sums', '_bwd_dx'] and l['aten'] == []
    assert 'batch_norm' in l['stock'] and 'native_batch_norm_backward' in l['stock']
    assert not {'convolution', 'convolution_backward'} & set(l['aten'] + l['stock'])

@pytest.mark.parametrize('mode', ['speed', 'memory'])
@pytest.mark.parametrize('dtype,act,residual', [(torch.float32, 'relu', False), (torch.bfloat16, 'silu', True),
                                                (torch.float16, 'relu', True)])
def test_a_fused_step_launches_no_more_kernels_than_stock(dtype, act, residual, mode):
    "The goal of fusing: no more launches than stock cuDNN BN + act (+ add), per layer step, forward and backward"
    l = host_cost.launches(dtype, act, residual, mode)
    assert len(l['triton']) + len(l['aten']) <= len(l['stock']), l

def test_the_memory_step_is_a_fits():
    """'memory' is counted and timed as a fit runs it: inside `recomputed_outputs()` with the output read by a product,
    the layer without a residual remembers (its output recomputed from the recipe in backward: a second apply pass,
    `_fwd`; no conv), the one with a residual recomputes its conv; the process's recipe way is left as it was"""
    from clfast import fused
    before = fused.set_recipe_way('conv')
    try:
        plain, res = (host_cost.launches(torch.float32, 'relu', r, 'memory') for r in (False, True))
        assert fused._recipe_way == 'conv'
    finally: fused.set_recipe_way(before)
    assert plain['triton'] == ['_stats', '_fwd', '_fwd', '_bwd_sums', '_bwd_dx'], plain
    assert res['triton'] == ['_stats', '_fwd', '_bwd_sums', '_bwd_dx'], res
    assert plain['aten'].count('mul') == plain['stock'].count('mul') > 0   # the product, both ways

@pytest.mark.cuda
@pytest.mark.parametrize('momentum,want', [(0.1, ['_stats', '_fwd', '_bwd_sums', '_bwd_dx']),
                                           (None, ['_stats', '_fwd', '_running', '_bwd_sums', '_bwd_dx'])])
def test_a_gpu_step_launches_what_the_meta_count_says(momentum, want):
    "On CUDA, launched for real: the step's Triton kernels are those `launches` counts on shape-only tensors (a momentum: four)"
    from clfast import gpu_report, ops
    from clfast.reference import ConvGeometry
    mk = lambda *s, **kw: torch.randn(*s, device='cuda', **kw)
    x = mk(2, 64, 5, 5, dtype=torch.bfloat16).to(memory_format=torch.channels_last).requires_grad_()
    w = mk(64, 64, 3, 3, dtype=torch.bfloat16).to(memory_format=torch.channels_last).requires_grad_()
    bw, bb, rm, rv = mk(64).requires_grad_(), mk(64).requires_grad_(), mk(64), mk(64).abs()
    nbt = torch.zeros((), dtype=torch.long, device='cuda')
    with gpu_report.recording() as launched:
        out = ops.fused_conv_bn(x, w, None, bw, bb, rm, rv, nbt, True, momentum, 1e-5, ConvGeometry(padding=(1, 1)), act='relu')
        out.float().sum().backward()
    assert [l.name for l in launched] == want and nbt.item() == 1
    if momentum is not None: assert want == host_cost.launches(torch.bfloat16, 'relu')['triton']   # (counted with one)

def test_stubbed_convs_give_cudnns_shapes_and_layouts_and_then_go():
    "Inside the block a conv computes nothing but its result has the real one's size and cuDNN's layout; after it, real convs"
    x = torch.randn(2, 3, 9, 9).to(memory_format=torch.channels_last).requires_grad_()
    conv = torch.nn.Conv2d(3, 5, 3, stride=2, padding=1, bias=True).to(memory_format=torch.channels_last)
    want = conv(x)
    with host_cost.stubbed_convs():
        y = conv(x)
        y.backward(torch.ones_like(y))
        with pytest.raises(NotImplementedError, match='2D convs only'):
            torch.nn.functional.conv_transpose2d(x, torch.randn(3, 5, 3, 3))
    assert y.shape == want.shape and y.is_contiguous(memory_format=torch.channels_last)
    assert x.grad.shape == x.shape and x.grad.is_contiguous(memory_format=torch.channels_last)
    assert conv.weight.grad.shape == conv.weight.shape and conv.bias.grad.shape == conv.bias.shape
    torch.testing.assert_close(conv(x), want)   # the real kernel is back

def test_the_proxy_times_both_steps_and_stubs_convs_on_the_cpu_only():
    "Each way's host time is measured (positive, the ratio theirs), with or without stubbed convs; a GPU's are not stubbed"
    for stub in (False, True):
        t = host_cost.host_times(n=3, stub_convs=stub)
        assert t['fused'] > 0 and t['stock'] > 0
    with pytest.raises(ValueError, match="CPU proxy's"): host_cost.host_times(n=3, device='cuda', stub_convs=True)

def test_a_whole_models_step_is_timed_both_ways_and_the_ways_restored():
    """`model_host_times`: a whole model's step, fused in each mode and stock, on the CPU proxy (real convs or stubbed);
    the process's layer and recipe ways as they were after it; a GPU's convs are not stubbed"""
    from clfast import fused
    before = fused.set_layer_way('stock'), fused.set_recipe_way('conv')
    torch.manual_seed(1)
    want = torch.rand(3)
    torch.manual_seed(1)
    try:
        for mode, stub in (('speed', True), ('memory', False)):
            t = host_cost.model_host_times('resnet18', mode, n=2, stub_convs=stub)
            assert t['fused'] > 0 and t['stock'] > 0
            assert (fused._layer_way, fused._recipe_way) == ('stock', 'conv')
    finally: fused.set_layer_way(before[0]); fused.set_recipe_way(before[1])
    assert torch.equal(torch.rand(3), want)   # the models were seeded apart: the caller's random stream is as it was
    with pytest.raises(ValueError, match="CPU proxy's"): host_cost.model_host_times(device='cuda', stub_convs=True)
    with pytest.raises(ValueError, match="must be 'cpu'"): host_cost.model_table(device='mps')
    with pytest.raises(ValueError, match="'resnet5O' is not a torchvision classification model"): host_cost.model_steps('resnet5O')

@pytest.mark.parametrize('argv,says', [(['--model', 'resnet50', 'resnet5O'], "--model: not torchvision classification models: resnet5O"),
                                       (['--pairs', '0'], "--pairs: must be at least 1, got 0")])
def test_the_command_refuses_bad_options_before_timing(argv, says, capsys):
    "A misspelt model or no pairs: argparse's one-line error (exit 2) before anything is built or timed"
    with pytest.raises(SystemExit) as e: host_cost.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err

def test_a_device_other_than_the_cpu_or_a_gpu_is_refused():
    """'cuda:0' is a GPU (it used to get the CPU proxy's figures, and a table labelled 'cuda:0'); a device neither the
    proxy's nor CUDA's is a clear error, before anything is timed"""
    for bad in ('mps', 'gpu', 'xla'):
        with pytest.raises(ValueError, match=rf"device='{bad}' must be 'cpu' \(the proxy\) or a CUDA device"):
            host_cost.host_times(n=3, device=bad)
    with pytest.raises(ValueError, match="must be 'cpu'"): host_cost.host_cost_table(device='mps', pairs=3)
    assert host_cost.host_times(n=3, device=torch.device('cpu'))['fused'] > 0
    if not torch.cuda.is_available():   # a GPU asked for where there is none: CUDA's error, not the CPU proxy's figures
        with pytest.raises((RuntimeError, AssertionError)): host_cost.host_times(n=3, device='cuda:0')
