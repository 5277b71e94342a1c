"""clfast.bn: BatchNorm as precise channels-last as contiguous on the CPU (fp64 partial sums), against fp64; its premise
measured on the machine; SyncBatchNorm's work on the CPU (two real ranks: test_distributed.py)."""
import copy, pickle
import pytest, torch
from torch import nn
import torch.nn.functional as F
from hypothesis import given, example, strategies as st
from clfast import guard, timing
from clfast.bn import (PreciseBatchNorm2d, PreciseSyncBatchNorm, make_precise, imprecise_cl_batch_norm, _bn_errors,
                       cpu_sync_capable)
from clfast.guard import guard_model, unguard_model, IMPRECISE_CL_BATCH_NORM
from clfast.ops import kernels_ready

CL = torch.channels_last
pytestmark = pytest.mark.skipif(not kernels_ready(), reason="clfast's C++ CPU kernels cannot be built here")

def rel_err(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()

def bn_errors(bn_fn, x64, dy64, dtype, memory_format):
    "Worst relative error against fp64 of (out, dx, dweight, dbias) of `bn_fn()` (a fresh BN) run at `dtype` in `memory_format`"
    ref, bn = bn_fn().double(), bn_fn()
    xr = x64.clone().requires_grad_()
    out64 = ref(xr); out64.backward(dy64)
    x = x64.to(dtype).contiguous(memory_format=memory_format).requires_grad_()
    out = bn(x); out.backward(dy64.to(dtype).contiguous(memory_format=memory_format))
    errs = [rel_err(out, out64), rel_err(x.grad, xr.grad)]
    if ref.affine: errs += [rel_err(bn.weight.grad, ref.weight.grad), rel_err(bn.bias.grad, ref.bias.grad)]
    if ref.track_running_stats and ref.training:
        errs += [rel_err(bn.running_mean, ref.running_mean), rel_err(bn.running_var, ref.running_var)]
    return max(errs), bn, ref

def _batch(shape, seed=0, mean=2., std=3.):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * std + mean,
            torch.randn(shape, generator=g, dtype=torch.float64))

@pytest.mark.parametrize('shape', [(16, 16, 112, 112), (8, 64, 40, 40), (4, 256, 14, 14)])
def test_precise_bn_is_as_precise_as_contiguous(shape):
    "fp32 training forward + backward: within 3x of stock contiguous fp32's error against fp64 (stock channels-last is not, where the premise holds)"
    x64, dy64 = _batch(shape)
    def fresh():
        torch.manual_seed(1)
        bn = nn.BatchNorm2d(shape[1]); nn.init.uniform_(bn.weight, .5, 1.5); nn.init.normal_(bn.bias)
        return bn
    contiguous, *_ = bn_errors(fresh, x64, dy64, torch.float32, torch.contiguous_format)
    precise, bn, _ = bn_errors(lambda: make_precise(fresh()), x64, dy64, torch.float32, CL)
    stock_cl, *_ = bn_errors(fresh, x64, dy64, torch.float32, CL)
    assert type(bn) is PreciseBatchNorm2d
    assert precise <= 3 * contiguous, (precise, contiguous, stock_cl)

@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_precise_bn_half_precision(dtype):
    "A half-precision batch (as under CPU autocast), fp32 parameters: output in the batch's dtype, within stock contiguous's error of fp64 (x3)"
    x64, dy64 = _batch((8, 32, 32, 32))
    x64, dy64 = x64.to(dtype).double(), dy64.to(dtype).double()   # the fp64 reference sees the same rounded inputs
    fresh = lambda: nn.BatchNorm2d(32)
    contiguous, *_ = bn_errors(fresh, x64, dy64, dtype, torch.contiguous_format)
    precise, bn, _ = bn_errors(lambda: make_precise(fresh()), x64, dy64, dtype, CL)
    assert precise <= 3 * contiguous, (precise, contiguous)

@given(n=st.integers(1, 3), c=st.integers(1, 40), h=st.integers(1, 9), w=st.integers(2, 9),
       affine=st.booleans(), track=st.booleans(), momentum=st.sampled_from([0.1, None]), training=st.booleans())
@example(n=1, c=3, h=1, w=2, affine=False, track=True, momentum=None, training=True)
def test_precise_bn_semantics_equal_fp64(n, c, h, w, affine, track, momentum, training):
    "BatchNorm2d's semantics (affine, running statistics, momentum None, eval) in channels-last, against fp64 stock"
    x64, dy64 = _batch((n, c, h, w), seed=c + 7 * h)
    def fresh():
        torch.manual_seed(2)
        bn = nn.BatchNorm2d(c, affine=affine, track_running_stats=track, momentum=momentum)
        if track: bn.running_mean.normal_(); bn.running_var.uniform_(.5, 2)
        return bn.train(training)
    # a gradient that cancels to nearly zero (two values per channel) is judged as stock contiguous fp32 does on it
    contiguous, *_ = bn_errors(fresh, x64, dy64, torch.float32, torch.contiguous_format)
    err, bn, ref = bn_errors(lambda: make_precise(fresh()), x64, dy64, torch.float32, CL)
    assert err <= 3 * contiguous + 1e-6, (err, contiguous)
    if track: assert bn.num_batches_tracked.item() == ref.num_batches_tracked.item()

def test_premise_measured_and_guard_follows_it(tmp_path, monkeypatch):
    "guard_model makes BNs precise exactly where this machine's stock channels-last BN measured imprecise; cached per machine"
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {})   # measured afresh here; this process's answers back after the test
    here = imprecise_cl_batch_norm()
    assert here == (_bn_errors(CL) > 3 * _bn_errors(torch.contiguous_format))
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.BatchNorm2d(8))
    guard_model(net)
    assert type(net[2]) is (PreciseBatchNorm2d if here else nn.BatchNorm2d)
    assert timing.timings()[f'premise:{IMPRECISE_CL_BATCH_NORM.name}'] == here   # a numerics premise: its bool
    for held in (True, False):   # clfast's behaviour given either answer
        timing._here[f'premise:{IMPRECISE_CL_BATCH_NORM.name}'] = held
        guard_model(net)
        assert type(net[2]) is (PreciseBatchNorm2d if held else nn.BatchNorm2d)
    unguard_model(net)
    assert type(net[2]) is nn.BatchNorm2d

def test_precise_bn_pickles_as_stock_and_falls_back():
    "Pickles as BatchNorm2d / SyncBatchNorm; nchw, fp64 and inference calls run the stock forward"
    bn = make_precise(nn.BatchNorm2d(4))
    assert type(pickle.loads(pickle.dumps(bn))) is nn.BatchNorm2d and type(copy.deepcopy(bn)) is PreciseBatchNorm2d
    sync = make_precise(nn.BatchNorm2d(4), sync=True)
    assert type(sync) is PreciseSyncBatchNorm and isinstance(sync, nn.BatchNorm2d) and not isinstance(sync, nn.SyncBatchNorm)
    loaded = pickle.loads(pickle.dumps(sync))
    assert type(loaded) is nn.SyncBatchNorm and loaded.process_group is None
    assert cpu_sync_capable(nn.BatchNorm2d(3)) and cpu_sync_capable(nn.BatchNorm1d(3)) and not cpu_sync_capable(nn.BatchNorm3d(3))
    with pytest.raises(TypeError, match='BatchNorm2d'): make_precise(nn.BatchNorm1d(3))
    x = torch.randn(2, 4, 5, 5)
    for t in (x, x.double(), x.to(memory_format=CL)):
        ref = nn.BatchNorm2d(4).to(t.dtype)
        bn = make_precise(copy.deepcopy(ref)).eval(); ref.eval()
        with torch.no_grad(): torch.testing.assert_close(bn(t), ref(t))

def test_a_traced_or_exported_eval_model_holds_stock_ops():
    """In eval a precise BN takes clfast's op only for its backward sums (a frozen BN's gradients), and not while
    `torch.jit.trace` or `torch.export` records it: the recorded graph runs where clfast is not installed"""
    m = nn.Sequential(nn.Conv2d(3, 8, 3), make_precise(nn.BatchNorm2d(8))).to(memory_format=CL).eval()
    x = torch.randn(2, 3, 8, 8).to(memory_format=CL)
    out = m(x)
    assert 'clfast' in out.grad_fn.name()   # eagerly, gradients on: clfast's op
    traced = torch.jit.trace(m, x)
    kinds = {n.kind() for n in traced.inlined_graph.nodes()}
    assert 'aten::batch_norm' in kinds and not any(k.startswith('clfast') for k in kinds), kinds
    exported = torch.export.export(m, (x,))
    targets = {str(n.target) for n in exported.graph.nodes if n.op == 'call_function'}
    assert 'aten.batch_norm.default' in targets and not any('clfast' in t for t in targets), targets
    for f in (traced, exported.module()): torch.testing.assert_close(f(x), out)

def _bench_precision():
    import importlib.util, pathlib
    path = pathlib.Path(__file__).parents[1]/'benchmarks'/'bench_precision.py'
    spec = importlib.util.spec_from_file_location('bench_precision', path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

@pytest.mark.parametrize('net', ['conv_bn_relu', 'conv_relu_bn', 'guard_stem1'])
def test_training_step_as_precise_as_contiguous(net):
    "One fastai step's gradients against fp64 (benchmarks/bench_precision.py, smaller): to_channelslast with fuse off, "
    "'speed' and 'memory' within 3x of contiguous fp32's error (one thread: the stock kernels' sums are then reproducible)"
    bench = _bench_precision()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        c, build = bench.NETS[net]
        torch.manual_seed(0)
        model = build()
        size = 96 if net.startswith('guard') else 56
        ratios = {}
        # a conv output within rounding of a ReLU's kink flips its mask in one layout and not the other, and then
        # that batch's gradient is far off fp64 for a reason that is not the sums' precision: the median of three
        # batches is judged (conv_relu_bn's second batch: channels-last convs flip 2 + 2 ReLU masks against fp64,
        # contiguous none; its gradients 6e-3 from fp64 against 8e-6, while its BNs alone are within 3x)
        for seed in range(3):
            ref = bench.fp64_grads(model, c, size, 8, seed)
            err = {how: bench.grad_error(bench.step_grads(copy.deepcopy(model), c, size, 8, how, seed), ref)
                   for how in ('contiguous', 'off', 'speed', 'memory')}
            for how in ('off', 'speed', 'memory'): ratios.setdefault(how, []).append(err[how] / err['contiguous'])
    finally: torch.set_num_threads(threads)
    assert all(sorted(r)[1] <= 3 for r in ratios.values()), ratios

@pytest.mark.parametrize('fused', [False, True], ids=['precise_bn', 'fused_conv_bn'])
def test_trains_inside_a_gradient_checkpoint(fused, tmp_path, monkeypatch):
    """A block checkpointed without reentry (timm's `set_grad_checkpointing`) where a conv's output feeds a precise BN,
    or a fused conv-BN on an input the block computes, on a fresh machine: backward recomputes the block (the C++ layer
    node failed, 'A different number of tensors was saved during the original forward and recomputation': it unpacked
    its saved tensors with autograd's keys excluded, so the recomputed ops recorded no autograd; and so did the fused
    layer's first call, whose timing of its two ways saved tensors as the block's). Every gradient is fp64's at fp32's
    precision, and the running statistics are stock's, which the recomputation updates a second time (the layer op
    updated them after its node had saved, where the recomputation stops: once)"""
    from torch.utils.checkpoint import checkpoint
    from clfast import fused as fused_mod
    from clfast.fuse import fuse_conv_bn
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {}); monkeypatch.setattr(fused_mod, '_ways', {})
    torch.manual_seed(0)
    head = [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()] if fused else []   # the fused layer's input, computed in the block
    net = nn.Sequential(*head, nn.Conv2d(3 + 5 * fused, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)).to(memory_format=CL)
    ref = copy.deepcopy(net).double()
    if fused: fuse_conv_bn(net)
    else: net[1] = make_precise(net[1])
    x = torch.randn(4, 3, 8, 8).to(memory_format=CL)
    dy = torch.randn(4, 16, 8, 8, dtype=torch.float64)
    checkpoint(net, x, use_reentrant=False).backward(dy.float().contiguous(memory_format=CL))
    checkpoint(ref, x.double(), use_reentrant=False).backward(dy)
    for (name, got), want in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5, msg=name)
    bn, bn64 = [[m for m in n.modules() if isinstance(m, nn.BatchNorm2d)][-1] for n in (net, ref)]
    assert bn.num_batches_tracked == bn64.num_batches_tracked == 2
    for name in ('running_mean', 'running_var'):
        torch.testing.assert_close(getattr(bn, name).double(), getattr(bn64, name), rtol=1e-5, atol=1e-6, msg=name)

@pytest.mark.parametrize('outlier', [100., 1e4])
def test_precise_bn_statistics_do_not_hang_on_the_first_value(outlier):
    """The statistics' sums are shifted by a value near each channel's mean, not by the batch's first value: an outlier
    there (sample 0, pixel (0, 0)) cost the fp32 output and gradients 1e-4 of fp64 against stock contiguous's 1e-7"""
    x64, dy64 = _batch((8, 4, 32, 32), mean=0., std=1.)
    x64[0, :, 0, 0] = outlier
    fresh = lambda: nn.BatchNorm2d(4)
    contiguous, *_ = bn_errors(fresh, x64, dy64, torch.float32, torch.contiguous_format)
    precise, *_ = bn_errors(lambda: make_precise(fresh()), x64, dy64, torch.float32, CL)
    assert precise <= 3 * contiguous + 1e-6, (precise, contiguous)

@pytest.mark.parametrize('bad', [float('inf'), -float('inf')])
@pytest.mark.parametrize('where', [(0, 0, 0), (1, 2, 3)], ids=['first', 'inner'])
def test_precise_bn_infinite_value_anywhere(bad, where):
    "An infinity in a channel makes its running mean +-inf (the limit, as stock's), wherever it sits: in the first row too (that was NaN)"
    x = torch.randn(2, 3, 4, 4); x[where[0], 1, where[1], where[2]] = bad
    stock, bn = nn.BatchNorm2d(3), make_precise(nn.BatchNorm2d(3))
    stock(x.contiguous(memory_format=CL)); bn(x.contiguous(memory_format=CL))
    assert bn.running_mean[1].item() == bad and stock.running_mean[1].item() == bad
    assert bn.running_var[1].isnan() and stock.running_var[1].isnan()
    torch.testing.assert_close(bn.running_mean[[0, 2]], stock.running_mean[[0, 2]])

@pytest.mark.parametrize('training', [True, False])
def test_symbolic_trace_of_precise_bns(training):
    """torch.fx's symbolic trace (torchvision's `create_feature_extractor`) of precise BNs, plain and timm's
    BatchNormAct2d, records the stock BN's ops (before: TraceError, the Proxy's `is_cpu` tested); the graph computes
    what the stock model computes in float64: output, gradients, running statistics and their count"""
    from timm.layers import BatchNormAct2d
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3),
                          BatchNormAct2d(8, act_layer=nn.SiLU))
    precise = copy.deepcopy(stock)
    for i in (1, 4): precise[i] = make_precise(precise[i])
    ref = copy.deepcopy(stock).double().train(training)
    traced = torch.fx.symbolic_trace(precise.train(training))
    x = torch.randn(4, 3, 8, 8).to(memory_format=CL)
    xa, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    out, want = traced(xa), ref(x64)
    out.sum().backward(); want.sum().backward()
    # fp32 against fp64: 1e-5 of each tensor's scale (the gradients': the largest one's, as a conv bias before a BN has
    # none but rounding)
    close = lambda a, b, scale=None: torch.testing.assert_close(a.double(), b.double(), rtol=0,
                                                                atol=1e-5 * (scale or max(b.abs().max().item(), 1.)))
    close(out, want); close(xa.grad, x64.grad)
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    for got, p in zip(precise.parameters(), ref.parameters()): close(got.grad, p.grad, scale)
    for got, b in zip(precise.buffers(), ref.buffers()): close(got, b)
