"FusedConvBN2d against the stock Conv2d -> BatchNorm2d (-> + residual) (-> activation) in fp64 (the oracle): outputs, gradients, running stats"
import contextlib, copy, io, pickle, sys, warnings
from unittest import mock
import pytest, torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from hypothesis import given, settings, example, strategies as st, HealthCheck
from clfast import timing
from clfast.act import ACTS
from clfast.fused import FusedConvBN2d, conv_bn_act
from clfast.guard import guard_model
from clfast.fuse import fuse_conv_bn
from clfast import cpu_kernels, ops
from clfast import fused as fused_mod
from clfast.machine import MachineCache
import preloaded

pytestmark = pytest.mark.usefixtures('fused_way')   # these tests are of clfast's op: 'timed' could run a layer the stock way

PATHS = ['kernel', 'ref']

def cpu_path(path):
    "'kernel': the device's kernels (the C++ ones on the CPU, where they build); 'ref': the pure-PyTorch ones"
    return contextlib.nullcontext() if path == 'kernel' else ops.kernels_from('ref')

ACT_NAMES = list(ACTS)
def act_param(act): return {'leaky_relu': 0.1}.get(act, 0.)

needs_cxx = pytest.mark.skipif(bool(cpu_kernels.missing_toolchain()), reason=str(cpu_kernels.missing_toolchain()))

def pair(cin, cout, k=3, stride=1, padding=1, dilation=1, groups=1, bias=False, act='relu', mode='speed',
         momentum=0.1, affine=True, track=True, device='cpu', dtype=torch.float32):
    "A standalone FusedConvBN2d and a stock (conv, bn) with identical, non-trivial parameters"
    act = {True: 'relu', False: 'none'}.get(act, act)
    f = FusedConvBN2d(cin, cout, k, stride, padding, dilation, groups, bias, momentum=momentum, affine=affine,
                      track_running_stats=track, act=act, act_param=act_param(act), mode=mode, device=device, dtype=dtype)
    with torch.no_grad():
        if affine: f.bn.weight.uniform_(0.5, 1.5); f.bn.bias.uniform_(-0.5, 0.5)
        if track: f.bn.running_mean.uniform_(-0.2, 0.2); f.bn.running_var.uniform_(0.5, 2.0)
    conv = nn.Conv2d(cin, cout, k, stride, padding, dilation, groups, bias, device=device, dtype=dtype)
    conv.load_state_dict({k: v for k, v in f.state_dict().items() if not k.startswith('bn.')})
    bn = copy.deepcopy(f.bn)
    return f, conv, bn

def stock(conv, bn, x, residual=None, act='relu', dy_scale=None):
    y = conv(x)
    if dy_scale is not None and y.requires_grad:  # the scale of the conv-output gradient, for a sum that cancels
        y.register_hook(lambda g: dy_scale.append(g.abs().sum().item()))
    y = bn(y)
    if residual is not None: y = y + residual
    act = {True: 'relu', False: 'none'}.get(act, act)
    return ACTS[act](y, act_param(act))

def close(a, b, rtol=1e-4, atol=1e-5, what=''):
    assert a is not None and b is not None, what
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")

def stock_bumps(like:torch.Tensor) -> int:
    """How far stock BN's training update moves its running statistics' version counters on a conv output like `like`:
    1, but 0 where cuDNN's BN runs (its op does not declare the statistics written)"""
    rm, rv = torch.zeros(like.shape[1], device=like.device), torch.ones(like.shape[1], device=like.device)
    nn.functional.batch_norm(like, rm, rv, training=True)
    return rm._version

def compare(f, conv, bn, x, residual, act, tol=(1e-4, 1e-5), gtol=(1e-3, 1e-4), stats_bumps=None):
    """Forward + backward of the fused layer and of the stock modules in fp64 contiguous (the oracle, converted in
    place); within fp32 rounding. `stats_bumps()`, read after the forward: how far the running mean's and variance's
    version counters move in a training call (1 unless said: a layer that may run its stock way says stock's)"""
    conv.double(); bn.double()
    xs = [x.detach().clone().requires_grad_(), x.detach().double().contiguous().requires_grad_()]
    rs = [None if residual is None else r for r in
          (residual.detach().clone().requires_grad_(), residual.detach().double().contiguous().requires_grad_())] \
         if residual is not None else [None, None]
    dy_scale = []
    versions = lambda b: [t._version for t in (b.running_mean, b.running_var, b.num_batches_tracked) if t is not None]
    before = versions(f.bn)
    of = f(xs[0], rs[0]); os_ = stock(conv, bn, xs[1], rs[1], act, dy_scale)
    # the running statistics are updated in place once per training call, visibly to autograd's version check (a write
    # through a pointer does not bump the counters by itself); in eval, not at all
    want = [int(f.bn.training)] * len(before)
    if stats_bumps is not None and f.bn.training and f.bn.running_mean is not None: want[:2] = [stats_bumps()] * 2
    assert [a - b for a, b in zip(versions(f.bn), before)] == want
    close(of, os_, *tol, what='output')
    g = torch.randn_like(of)
    of.backward(g); os_.backward(g.double())
    close(xs[0].grad, xs[1].grad, *gtol, what='dx')
    close(f.weight.grad, conv.weight.grad, *gtol, what='dweight')
    if conv.bias is not None:  # with batch statistics this is a sum that cancels to ~0: compare to its scale
        close(f.bias.grad, conv.bias.grad, gtol[0], gtol[1] + 1e-4 * dy_scale[0], what='dbias')
    if bn.affine:
        close(f.bn.weight.grad, bn.weight.grad, *gtol, what='bn dweight')
        close(f.bn.bias.grad, bn.bias.grad, *gtol, what='bn dbias')
    if residual is not None: close(rs[0].grad, rs[1].grad, *gtol, what='dresidual')
    if bn.track_running_stats:
        close(f.bn.running_mean, bn.running_mean, 1e-5, 1e-6, what='running_mean')
        close(f.bn.running_var, bn.running_var, 1e-5, 1e-6, what='running_var')
        assert f.bn.num_batches_tracked == bn.num_batches_tracked

def _guarded(f):
    "The fused layer as clfast runs it: guarded against known-bad stock kernels on this CPU"
    guard_model(f)
    return f

@pytest.mark.parametrize('mode', ['speed', 'memory'])
@pytest.mark.parametrize('train', [True, False])
@pytest.mark.parametrize('act,res', [('relu', True), ('silu', True), ('leaky_relu', False)])
def test_gradcheck(mode, train, act, res, path='kernel'):
    "fp64 gradcheck of the module's function (the op itself is gradchecked per backend and activation in test_ops)"
    f = FusedConvBN2d(3, 4, 3, stride=2, padding=1, bias=True, act=act, act_param=act_param(act), mode=mode,
                      dtype=torch.float64)
    with torch.no_grad(): f.bn.weight.uniform_(0.5, 1.5); f.bn.bias.uniform_(-0.5, 0.5); f.bn.running_var.fill_(1.5)
    f.train(train)
    f.bn.momentum = 0.  # running stats frozen so that repeated evaluations see the same module
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 4, 3, 3, dtype=torch.float64, requires_grad=True) if res else None
    fn = lambda x, w, b, bw, bb, *r: conv_bn_act(x, f, f.bn, r[0] if r else None, act, act_param(act), mode)
    inputs = (x, f.weight, f.bias, f.bn.weight, f.bn.bias) + ((r,) if res else ())
    with cpu_path(path): assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5)

shapes = st.fixed_dictionaries(dict(
    n=st.sampled_from([1, 2, 3]), hw=st.sampled_from([1, 2, 5, 8]), cin=st.sampled_from([1, 3, 4]),
    cout=st.sampled_from([1, 3, 17]), k=st.sampled_from([1, 3]), stride=st.sampled_from([1, 2]),
    dilation=st.sampled_from([1, 2]), grouping=st.sampled_from(['none', 'groups', 'depthwise']), bias=st.booleans(),
    cl=st.booleans(), act=st.sampled_from(ACT_NAMES), res=st.booleans(), mode=st.sampled_from(['speed', 'memory']),
    momentum=st.sampled_from([0.1, None]), affine=st.booleans(), track=st.booleans(), train=st.booleans()))

def _build(s, device='cpu'):
    cin, cout, groups = s['cin'], s['cout'], 1
    if s['grouping'] == 'depthwise': cout, groups = cin, cin
    elif s['grouping'] == 'groups' and cin % 2 == 0 and cout % 2 == 0: groups = 2
    pad = s['dilation'] * (s['k'] - 1) // 2
    f, conv, bn = pair(cin, cout, s['k'], s['stride'], pad, s['dilation'], groups, s['bias'], s['act'], s['mode'],
                       s['momentum'], s['affine'], s['track'], device=device)
    _guarded(f)
    for m in (f, conv, bn): m.train(s['train'])
    x = torch.randn(s['n'], cin, s['hw'], s['hw'], device=device)
    if s['cl']: x = x.to(memory_format=torch.channels_last)
    with torch.no_grad(): out_shape = conv(x).shape
    r = torch.randn(out_shape, device=device) if s['res'] else None
    if r is not None and s['cl']: r = r.to(memory_format=torch.channels_last)
    return f, conv, bn, x, r, out_shape

def _check_case(s, device='cpu'):
    torch.manual_seed(0)  # hypothesis runs many examples per test: each one reproducible on its own
    f, conv, bn, x, r, out_shape = _build(s, device)
    batch_stats = s['train'] or not s['track']
    if batch_stats and out_shape[0] * out_shape[2] * out_shape[3] == 1:
        with pytest.raises(ValueError) as stock_err: stock(conv, bn, x, r, s['act'])
        with pytest.raises(ValueError, match='more than 1 value per channel') as fused_err: f(x, r)
        assert str(fused_err.value) == str(stock_err.value)
        return
    compare(f, conv, bn, x, r, s['act'])

# found on an AMD EPYC with AVX2 only: oneDNN's 1x1 stride-2 backward-weights kernel on an nhwc input with IC < 8
# (oneDNN issue 6035) gave dweight 10.35 for -1.88 in the stock fp32 oracle; the guarded layer equals fp64
AVX2_1X1_S2 = dict(n=2, hw=8, cin=3, cout=1, k=1, stride=2, dilation=1, grouping='none', bias=False, cl=True,
                   act='relu', res=False, mode='speed', momentum=0.1, affine=True, track=False, train=False)

@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=shapes)
@example(s=AVX2_1X1_S2)
@example(s={**AVX2_1X1_S2, 'cin': 1, 'cout': 17, 'train': True, 'track': True, 'res': True, 'mode': 'memory'})
# the GEMM way's im2col (clfast/csrc/conv_bn_act.cpp) once sliced past the output where a tap reads only padding
@example(s=dict(n=2, hw=1, cin=1, cout=1, k=3, stride=1, dilation=2, grouping='none', bias=False, cl=False, act='none',
                res=False, mode='speed', momentum=0.1, affine=False, track=False, train=False))
@pytest.mark.parametrize('path', PATHS)
def test_matches_stock(path, s):
    with cpu_path(path): _check_case(s)

# 30 shapes on a GPU, not the profile's 80: each new shape compiles Triton specializations, and a lease's test step
# has about two minutes (the kernels' numerics in every dtype and activation are `test_ops.py`'s CUDA tests)
@pytest.mark.cuda
@settings(deadline=None, max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(s=shapes)
def test_matches_stock_cuda(s): _check_case(s, 'cuda')

@pytest.mark.parametrize('mode', ['speed', 'memory'])
def test_two_steps_then_eval(mode):
    "Running stats accumulate over steps (momentum None = cumulative average), then eval uses them"
    f, conv, bn = pair(4, 6, momentum=None, mode=mode)
    for _ in range(3): compare(f, conv, bn, torch.randn(3, 4, 6, 6), None, True)
    f.eval(); conv.eval(); bn.eval()
    f.zero_grad(); conv.zero_grad(); bn.zero_grad()
    compare(f, conv, bn, torch.randn(3, 4, 6, 6), torch.randn(3, 6, 6, 6), True)

def rel_err(got, exp) -> float:
    "Relative L2 error of `got` against `exp` (one ReLU mask flipped by rounding moves it a little, not to O(1))"
    return ((got.double() - exp.double()).norm() / exp.double().norm().clamp_min(1e-30)).item()

def within_precision(errs_fused:dict, errs_stock:dict, dtype, factor=2.):
    """Each of the fused layer's errors against fp64 at most `factor` times the stock modules' in the same precision,
    plus 4 ulps of `dtype` (where the stock is exact by luck): the results change no more than the precision explains"""
    floor = 4 * torch.finfo(dtype).eps
    bad = {k: (e, errs_stock[k]) for k, e in errs_fused.items() if not e <= factor * errs_stock[k] + floor}
    assert not bad, f"errors against fp64 (fused, stock) beyond the precision's: {bad}"

@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('mode', ['speed', 'memory'])
def test_autocast(device, dtype, mode):
    """Under autocast: output in the autocast dtype, fp32 weight grads and stats; every value as close to fp64 as the
    stock modules' under the same autocast"""
    f, conv, bn = pair(8, 16, mode=mode, device=device)
    conv64, bn64 = copy.deepcopy(conv).double(), copy.deepcopy(bn).double()
    x = torch.randn(4, 8, 10, 10, device=device).to(memory_format=torch.channels_last).requires_grad_()
    r = torch.randn(4, 16, 10, 10, device=device).to(dtype).requires_grad_()
    (xs, rs), (x64, r64) = [(x.detach().to(dt).requires_grad_(), r.detach().to(rdt).requires_grad_())
                            for dt, rdt in ((x.dtype, dtype), (torch.float64, torch.float64))]
    with torch.autocast(device, dtype=dtype):
        of, os_ = f(x, r), stock(conv, bn, xs, rs)
    o64 = stock(conv64, bn64, x64, r64)
    assert of.dtype == os_.dtype == dtype
    g = torch.randn_like(of)
    for o in (of, os_, o64): o.backward(g.to(o.dtype))
    assert f.weight.grad.dtype == f.bn.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert r.grad.dtype == dtype
    def errs(out, x_, r_, c, b):
        pairs = dict(out=(out, o64), dx=(x_.grad, x64.grad), dres=(r_.grad, r64.grad), dweight=(c.weight.grad, conv64.weight.grad),
                     dbn_weight=(b.weight.grad, bn64.weight.grad), dbn_bias=(b.bias.grad, bn64.bias.grad),
                     running_mean=(b.running_mean, bn64.running_mean), running_var=(b.running_var, bn64.running_var))
        return {k: rel_err(a, e) for k, (a, e) in pairs.items()}
    within_precision(errs(of, x, r, f, f.bn), errs(os_, xs, rs, conv, bn), dtype)

def test_memory_mode_saves_less():
    "'memory' keeps the conv input (already held by the graph) and per-channel stats instead of the conv output"
    def saved(mode):
        f = FusedConvBN2d(16, 16, 3, padding=1, mode=mode)
        x = torch.randn(2, 16, 16, 16, requires_grad=True)
        store = {}
        def pack(t): store[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes(); return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t): f(x)
        return sum(store.values())
    act = 2 * 16 * 16 * 16 * 4
    assert saved('speed') >= 2 * act and saved('memory') < act + 16 * 16 * 9 * 4 + 1024

def test_errors():
    with pytest.raises(ValueError, match="'speed' or 'memory'"): FusedConvBN2d(3, 4, 1, mode='fast')
    with pytest.raises(ValueError, match='expected 4D input'): FusedConvBN2d(3, 4, 1)(torch.randn(3, 5, 5))
    with pytest.raises(ValueError, match="padding='same'"): FusedConvBN2d(3, 4, 2, padding='same')

def test_same_and_valid_padding():
    for pad in ('same', 'valid'):
        f, conv, bn = pair(3, 5, k=3, padding=pad)
        compare(f, conv, bn, torch.randn(2, 3, 7, 7), None, True)

def test_standalone_pickle_and_deepcopy():
    f = FusedConvBN2d(3, 4, 3, padding=1, act='silu', mode='memory')
    buf = io.BytesIO(); torch.save(f, buf); buf.seek(0)
    g = torch.load(buf, weights_only=False)
    h = copy.deepcopy(f)
    x = torch.randn(2, 3, 5, 5)
    for m in (g, h):
        assert type(m) is FusedConvBN2d and m.mode == 'memory' and m.act == 'silu' and m.fused_bn is m.bn
        m.eval()
    f.eval()
    torch.testing.assert_close(f(x), g(x)); torch.testing.assert_close(f(x), h(x))

def test_to_stock_shares_parameters():
    f = FusedConvBN2d(3, 4, 3, padding=1, bias=True)
    s = f.to_stock()
    assert s[0].weight is f.weight and s[0].bias is f.bias and s[1] is f.bn and isinstance(s[2], nn.ReLU)
    f.eval(); s.eval()
    x = torch.randn(2, 3, 5, 5)
    torch.testing.assert_close(f(x), s(x))

@pytest.mark.parametrize('mode', ['speed', 'memory'])
def test_torch_compile_fullgraph(mode):
    "Under torch.compile the op goes through the clfast custom ops (fake impls): one graph, same numbers as eager"
    torch._dynamo.reset()
    f = FusedConvBN2d(4, 8, 3, padding=1, mode=mode); g = copy.deepcopy(f)
    x = torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last)
    r = torch.randn(2, 8, 8, 8, requires_grad=True); r2 = r.detach().clone().requires_grad_()
    o = torch.compile(f, fullgraph=True)(x, r); o.square().sum().backward()
    o2 = g(x, r2); o2.square().sum().backward()
    torch.testing.assert_close(o, o2)
    torch.testing.assert_close(f.weight.grad, g.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(r.grad, r2.grad)
    torch.testing.assert_close(f.bn.running_var, g.bn.running_var)
    assert f.bn.num_batches_tracked == g.bn.num_batches_tracked == 1

@pytest.mark.parametrize('train', [True, False])
def test_a_compiled_fused_layer_records_clfast_op(train):
    """torch.compile's graph of a fused layer calls clfast's op (not the stock modules, as `torch.jit.trace` and
    `torch.export` record): torch 2.11's dynamo answers `torch.compiler.is_exporting()` True in any compile, and the
    compiled layer ran its stock modules there"""
    torch._dynamo.reset()
    seen = []
    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == 'call_function')
        return gm.forward
    f = FusedConvBN2d(4, 8, 3, padding=1, act='relu').train(train)
    torch.compile(f, backend=backend, fullgraph=True)(torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last))
    assert any('clfast' in t for t in seen) and not any('batch_norm' in t for t in seen), seen

@pytest.mark.parametrize('device', [pytest.param('cpu', marks=needs_cxx), pytest.param('cuda', marks=pytest.mark.cuda)])
def test_the_cpu_library_loads_at_the_first_cpu_call_even_a_compiled_one(device):
    """Making fused layers, fusing a model and running the CUDA path's Python on shape-only tensors (as a model bound
    for a GPU does) load no C++ library: a GPU machine needs no compiler, and builds nothing for the CPU. A model
    compiled before its first eager step loads it in its trace on the CPU (dynamo runs the loading as it is, a constant
    of the graph), and on CUDA not at all: one graph that calls clfast's op, trained as fp64's stock modules"""
    code = """if True:
        import sys, torch, torchvision
        from torch import nn
        from clfast import ops
        from clfast.fused import FusedConvBN2d
        from clfast.fuse import fuse_conv_bn
        torch.backends.cudnn.allow_tf32 = False   # (fp32 against fp64, as the suite's conftest sets)
        device = sys.argv[1]
        f = FusedConvBN2d(4, 8, 3, padding=1)
        m = fuse_conv_bn(torchvision.models.resnet18(num_classes=4), 'speed').to('meta').to(memory_format=torch.channels_last)
        m(torch.randn(2, 3, 32, 32, device='meta').to(memory_format=torch.channels_last)).sum().backward()
        print('made and run on meta, loaded:', 'cpu' in ops._loaded)
        seen = []
        def backend(gm, inputs):   # (the graph's and its subgraphs': the layer op's Python twin is one of its own)
            seen.extend(str(n.target) for g in gm.modules() if isinstance(g, torch.fx.GraphModule)
                        for n in g.graph.nodes if n.op == 'call_function')
            return gm.forward
        ref = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()).double().to(device)
        ref.load_state_dict(f.to_stock().state_dict())
        f.to(device)
        x = torch.randn(2, 4, 8, 8, device=device).to(memory_format=torch.channels_last)
        out = torch.compile(f, backend=backend, fullgraph=True)(x)
        want = ref(x.double())
        out.square().sum().backward(); want.square().sum().backward()
        rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
        err = max(rel(out, want), rel(f.weight.grad, ref[0].weight.grad), rel(f.bn.running_var, ref[1].running_var))
        print('compiled, loaded:', ops._loaded.get('cpu', 'no'), 'clfast op:', any('clfast' in t for t in seen), 'err:', err)
    """
    r = preloaded.run([sys.executable, '-c', code, device], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert 'made and run on meta, loaded: False' in lines, r.stdout + r.stderr[-3000:]
    compiled = next(l for l in lines if l.startswith('compiled'))
    assert compiled.startswith(f"compiled, loaded: {'None' if device == 'cpu' else 'no'} clfast op: True err:"), compiled
    assert float(compiled.split()[-1]) < 1e-5, compiled

def test_a_call_that_does_not_take_the_op_loads_no_library():
    """A fused layer recorded by `torch.jit.trace` or `torch.export` (which record the stock modules' ops), a precise
    BN whose call sums nothing (eval, no gradient, an NCHW input) and the GPU report's dry runs on meta tensors neither
    load nor build the C++ library: each asked for it first, which without a compiler warned, and in a fresh cache
    compiled for minutes, for nothing (the test command's report, niced, built it before `clfast build`, which waited). (jit.trace's
    default check runs the layer eagerly after: a CPU call that takes the op, so loads it; left out here)"""
    code = """if True:
        import torch
        from torch import nn
        from clfast import ops
        from clfast.fused import FusedConvBN2d
        from clfast.bn import make_precise
        x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
        for train in (True, False):
            f = FusedConvBN2d(3, 4, 3, padding=1).train(train)
            torch.jit.trace(f, x, check_trace=False); torch.export.export(f, (x,))
        p = make_precise(nn.BatchNorm2d(4)).eval()
        with torch.no_grad(): p(torch.randn(2, 4, 5, 5))
        from clfast import gpu_report   # its dry runs on meta tensors, eager and through the kernel ops
        with gpu_report._triton_on_meta():
            assert gpu_report.layer_step(torch.float16, 'relu') and gpu_report.layer_step(torch.float16, 'relu', traced=True)
        print('loaded:', 'cpu' in ops._loaded)
    """
    r = preloaded.run([sys.executable, '-c', code], timeout=300)
    assert r.returncode == 0 and r.stdout.split()[-1] == 'False', r.stdout + r.stderr[-3000:]

@pytest.mark.isa_neutral   # dynamo's tracing (the op inside compiled graphs runs at each level in test_torch_compile_fullgraph); 8 s a level, inductor compiling afresh
def test_torch_compile_fullgraph_where_autocast_availability_is_untraceable(monkeypatch):
    """torch 2.11's torch.compile cannot trace `torch.amp.is_autocast_available` (2.14's can): each fused layer's graph
    broke there, and the frame it resumed in had lost the conv's geometry (rebuilt as an empty namedtuple: an IndexError
    in dynamo). A question dynamo must not trace stands in for 2.11's here: with autocast off and on, one graph"""
    torch._dynamo.reset()
    monkeypatch.setattr(torch.amp, 'is_autocast_available', torch.compiler.disable(torch.amp.is_autocast_available))
    m = fuse_conv_bn(nn.Sequential(nn.Conv2d(4, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()))
    x = torch.randn(2, 4, 8, 8).to(memory_format=torch.channels_last)
    for amp in (False, True):
        with torch.autocast('cpu', torch.bfloat16, enabled=amp):
            got, want = torch.compile(m, fullgraph=True)(x), m(x)
        assert got.dtype == want.dtype == (torch.bfloat16 if amp else torch.float32)
        torch.testing.assert_close(got, want)

@pytest.mark.parametrize('path', PATHS)
def test_layer_is_one_op(path):
    """Whatever the kernels, a fused layer is one autograd node (C++'s), one call of clfast::conv_bn_act, its backward
    and the running statistics' update, named so in the profiler, each calling its kernel op once; under a dispatch
    mode (what a tracer sees) the kernel ops"""
    class Ops(TorchDispatchMode):   # what a tracer sees: the ops the dispatcher runs
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))
    for mode in (contextlib.nullcontext, Ops):
        seen, f = [], FusedConvBN2d(3, 4, 3, padding=1)
        x = torch.randn(2, 3, 5, 5, requires_grad=True)
        with cpu_path(path), torch.profiler.profile() as prof, mode():
            out = f(x)
            node = out.grad_fn.name()
            assert node == 'torch::autograd::CppNode<clfast::ConvBnAct>', node
            assert {n[0].name() for n in out.grad_fn.next_functions if n[0]} == {'torch::autograd::AccumulateGrad'}
            out.sum().backward()
        # eager: the profiler's events; under the mode: the dispatched ops (the profiler records those twice, outer and inner)
        names = [e.name.replace('::', '.') for e in prof.events()] if mode is contextlib.nullcontext else seen
        ops_seen = ('clfast.conv_bn_act', 'clfast.conv_bn_act_backward') if mode is contextlib.nullcontext else ()
        for op in ops_seen + ('clfast.layer_fwd', 'clfast.layer_bwd', 'clfast.update_running'):
            assert names.count(op) == 1, (mode, op, names)
        assert f.bn.num_batches_tracked == 1 and x.grad is not None

@pytest.mark.parametrize('mode', ['speed', 'memory'])
@pytest.mark.parametrize('train', [False, True])
def test_a_traced_or_exported_fused_model_holds_stock_ops(mode, train):
    """`torch.jit.trace` and `torch.export` of a fused model record the stock modules' ops: the graph they save runs
    where clfast is not installed (they recorded clfast's op, which failed to load in every new process, with clfast
    imported too: its kernels register at the first fused call); the results are the stock model's, fp64"""
    import torchvision
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                        torchvision.models.resnet.BasicBlock(4, 4)).double().to(memory_format=torch.channels_last)
    for bn in ref.modules():
        if isinstance(bn, nn.BatchNorm2d): nn.init.uniform_(bn.running_mean, -0.5, 0.5); nn.init.uniform_(bn.running_var, 0.5, 2)
    m = copy.deepcopy(ref)
    fuse_conv_bn(m, mode)
    assert sum(isinstance(f, FusedConvBN2d) for f in m.modules()) == 3
    ref.train(train); m.train(train)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64).to(memory_format=torch.channels_last)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)   # torch.jit is deprecated, not gone
        warnings.simplefilter('ignore', torch.jit.TracerWarning)   # (training BN's own checks)
        traced = torch.jit.trace(copy.deepcopy(m), x, check_trace=False)
    kinds = {n.kind() for n in traced.inlined_graph.nodes()}
    assert 'aten::batch_norm' in kinds and not any(k.startswith('clfast') for k in kinds), kinds
    exported = torch.export.export(copy.deepcopy(m), (x,))
    targets = {str(n.target) for n in exported.graph.nodes if n.op == 'call_function'}
    assert not any('clfast' in t for t in targets), targets
    want = ref(x)
    for f in (traced, exported.module(), m):
        torch.testing.assert_close(f(x), want, atol=1e-12, rtol=1e-12)

@pytest.mark.parametrize('path', PATHS)
@pytest.mark.parametrize('mode', ['speed', 'memory'])
def test_double_backward(path, mode):
    """Higher-order gradients through the fused module (a gradient penalty's: the input gradient taken with
    `create_graph=True`, then differentiated) are the stock modules', in fp64 (the op's full matrix: test_ops.py)"""
    f, conv, bn = pair(3, 4, act='silu', mode=mode, dtype=torch.float64)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64).to(memory_format=torch.channels_last)
    def penalty_grads(layer, params):
        xx = x.clone().requires_grad_()
        g, = torch.autograd.grad(layer(xx).square().sum(), xx, create_graph=True)
        return torch.autograd.grad(g.square().sum(), [xx, *params])
    with cpu_path(path): got = penalty_grads(f, [f.weight, f.bn.weight, f.bn.bias])
    want = penalty_grads(lambda t: stock(conv, bn, t, act='silu'), [conv.weight, bn.weight, bn.bias])
    for a, b in zip(got, want): torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)

@pytest.mark.parametrize('path', PATHS)
@pytest.mark.parametrize('mode', ['speed', 'memory'])
def test_gradient_in_another_layout(path, mode):
    "A contiguous (not channels-last) incoming gradient for a channels-last output gives the stock gradients"
    f, conv, bn = pair(4, 6, mode=mode)
    x = torch.randn(2, 4, 6, 6).to(memory_format=torch.channels_last)
    r = torch.randn(2, 6, 6, 6)
    with cpu_path(path):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        of, os_ = f(xs[0], r), stock(conv, bn, xs[1], r)
        g = torch.randn(of.shape)  # contiguous
        of.backward(g); os_.backward(g)
    close(xs[0].grad, xs[1].grad, 1e-3, 1e-4, what='dx')
    close(f.bn.weight.grad, bn.weight.grad, 1e-3, 1e-4, what='bn dweight')

@pytest.mark.parametrize('path', PATHS)
def test_bf16_module(path):
    """A model converted to bfloat16 (BN parameters and running stats in bf16 too): output, running statistics and
    gradients within one bf16 ulp (at each result's scale) of the same step in fp64 from the same bf16 values. The
    kernels accumulate in fp32, so what is left is bf16's rounding of the conv output and of each result: about half
    an ulp here. (Stock bf16's is up to 0.28: its backward reductions run in bf16)"""
    f, conv, bn = pair(4, 8, dtype=torch.bfloat16)
    conv64, bn64 = conv.double(), bn.double()   # the stock modules, holding the same bf16 values, in fp64
    x = torch.randn(3, 4, 6, 6, dtype=torch.bfloat16)
    x16, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    with cpu_path(path):
        out16 = f(x16)
        out16.double().sum().backward()
    out64 = stock(conv64, bn64, x64)
    out64.sum().backward()
    assert f.bn.running_var.dtype == f.bn.weight.grad.dtype == torch.bfloat16
    def results(o, x, c, b): return dict(out=o, dx=x.grad, dweight=c.weight.grad, bn_dweight=b.weight.grad,
                                         bn_dbias=b.bias.grad, running_mean=b.running_mean, running_var=b.running_var)
    fused, want = results(out16, x16, f, f.bn), results(out64, x64, conv64, bn64)
    for k, w in want.items():
        err = ((fused[k].double() - w).abs().max() / w.abs().max()).item()
        assert err <= torch.finfo(torch.bfloat16).eps, (k, err)

def test_inference_mode():
    f, conv, bn = pair(3, 4)
    for m in (f, conv, bn): m.eval()
    x = torch.randn(2, 3, 5, 5)
    with torch.inference_mode(): torch.testing.assert_close(f(x), torch.relu(bn(conv(x))))

@pytest.mark.parametrize('path', PATHS)
def test_residual_shape_error(path):
    "A residual that does not match the conv output is an error (the stock add would broadcast it silently)"
    f = FusedConvBN2d(3, 4, 3, padding=1)
    with cpu_path(path), pytest.raises(ValueError, match='residual shape'):
        f(torch.randn(2, 3, 5, 5), torch.randn(2, 4, 1, 1))
    assert f.bn.num_batches_tracked == 0 and (f.bn.running_mean == 0).all() and (f.bn.running_var == 1).all()

# --- fused or stock per layer shape (issue 23): `clfast.fused.set_layer_way`; this module runs 'fused' (pytestmark above)

@contextlib.contextmanager
def layer_way(how):
    before = fused_mod.set_layer_way(how)
    try: yield
    finally: fused_mod.set_layer_way(before)

def test_set_layer_way():
    with pytest.raises(ValueError, match="one of \\('fused', 'stock', 'timed'\\)"): fused_mod.set_layer_way('fast')
    with layer_way('stock'): assert fused_mod.set_layer_way('stock') == 'stock'
    assert fused_mod.set_layer_way('fused') == 'fused'   # this module's setting (the fused_way fixture), restored

@pytest.mark.parametrize('act,res', [('relu', True), ('silu', False), ('leaky_relu', True)])
def test_stock_way_is_stock(act, res):
    "The stock way computes the layer as the stock modules (against fp64: outputs, gradients, running statistics)"
    f, conv, bn = pair(5, 6, act=act)
    x = torch.randn(2, 5, 6, 6).to(memory_format=torch.channels_last)
    with layer_way('stock'):
        assert f(x.requires_grad_()).grad_fn.name() != 'torch::autograd::CppNode<clfast::ConvBnAct>'
        f, conv, bn = pair(5, 6, act=act)
        compare(f, conv, bn, x, torch.randn(2, 6, 6, 6) if res else None, act)

@needs_cxx
@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)])
def test_timed_way_once_per_shape(device, tmp_path, monkeypatch):
    """'timed': the first call of a shape times both ways on copies (the module's statistics see one update, its
    gradients one backward), keeps the faster in this process and in the machine's cache; later calls run it. A GPU's
    choices are keyed by its name too"""
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(fused_mod, '_ways', {}); monkeypatch.setattr(timing, '_here', {})
    timed = []
    real = fused_mod._timed_way
    monkeypatch.setattr(fused_mod, '_timed_way', lambda *a: timed.append(1) or real(*a))
    f, conv, bn = pair(5, 6, act='silu', device=device)
    x = torch.randn(2, 5, 6, 6, device=device).to(memory_format=torch.channels_last)
    # one update, one backward: as stock (the choice's counters: stock's way leaves them where stock BN does)
    y_like = torch.randn(2, 6, 6, 6, device=device).to(memory_format=torch.channels_last)   # the conv's output
    bumps = lambda: 1 if set(fused_mod.layer_ways().values()) == {'fused'} else stock_bumps(y_like)
    with layer_way('timed'):
        compare(f, conv, bn, x, None, 'silu', stats_bumps=bumps)
        assert timed == [1]
        ways = fused_mod.layer_ways()
        assert len(ways) == 1 and set(ways.values()) <= {'fused', 'stock'}
        assert (device == 'cuda') == (torch.cuda.is_available() and torch.cuda.get_device_name() in next(iter(ways)))
        assert {k for k in timing._TimingCache(timing.TIMINGS).entries() if k.startswith('layer:')} == {f'layer:{k}' for k in ways}
        for _ in range(2): f(x).sum().backward()
        assert timed == [1]                               # the same shape: not timed again
        f(torch.randn(3, 5, 6, 6, device=device)).sum().backward()
        assert timed == [1, 1]                            # another shape is
        monkeypatch.setattr(fused_mod, '_ways', {}); monkeypatch.setattr(timing, '_here', {})
        f(x).sum().backward()
        assert timed == [1, 1]                            # a new process reads the cache

@needs_cxx
@pytest.mark.parametrize('way', ['fused', 'stock'])
def test_timed_way_runs_the_choice(way, tmp_path, monkeypatch):
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(fused_mod, '_ways', {}); monkeypatch.setattr(timing, '_here', {})
    monkeypatch.setattr(fused_mod, '_timed_way', lambda *a: timing.Timing(0.5 if way == 'stock' else 2., 6, way == 'stock', 1e-3))
    f = FusedConvBN2d(3, 4, 3, padding=1, act='silu')
    with layer_way('timed'):
        node = f(torch.randn(2, 3, 5, 5, requires_grad=True)).grad_fn.name()
    assert (node == 'torch::autograd::CppNode<clfast::ConvBnAct>') == (way == 'fused'), node

@needs_cxx
def test_not_timed_where_a_timing_cannot_decide(tmp_path, monkeypatch):
    "Memory mode, deterministic mode and traced code run fused, untimed"
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(fused_mod, '_timed_way', lambda *a: pytest.fail('timed'))
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    with layer_way('timed'):
        assert FusedConvBN2d(3, 4, 3, padding=1, mode='memory')(x).grad_fn.name().endswith('ConvBnAct>')
        torch.use_deterministic_algorithms(True)
        try: assert FusedConvBN2d(3, 4, 3, padding=1)(x).grad_fn.name().endswith('ConvBnAct>')
        finally: torch.use_deterministic_algorithms(False)
        out = torch.compile(FusedConvBN2d(3, 4, 3, padding=1), fullgraph=True)(x)   # traced: a timing would fail
        assert out.shape == (2, 4, 5, 5)

@needs_cxx
def test_untimeable_layer_runs_fused_and_says_so_once(tmp_path, monkeypatch):
    """A layer 'timed' cannot copy (here a weight that is a view of another tensor, as a tied or parametrized weight
    is: deepcopy refuses non-leaf tensors) runs the fused way, says so once, and trains"""
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(fused_mod, '_ways', {}); monkeypatch.setattr(timing, '_here', {})
    f = FusedConvBN2d(3, 4, 3, padding=1, act='silu')
    shared = nn.Parameter(torch.randn(2, 4, 3, 3, 3))
    del f.weight
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    with layer_way('timed'), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(2):
            f.weight = shared[0]   # a view, recomputed each step as a parametrization would
            assert f(x).grad_fn.name().endswith('ConvBnAct>')
            f(x).sum().backward()
    said = [str(m.message) for m in w if 'could not be timed' in str(m.message)]
    assert len(said) == 1 and 'runs fused' in said[0], said
    assert shared.grad is not None and shared.grad[0].abs().sum() > 0 and not shared.grad[1].any()
    assert timing._TimingCache(timing.TIMINGS).entries() == {}   # nothing measured: nothing for the machine's cache

@needs_cxx
@pytest.mark.parametrize('bad', [float('nan'), float('inf'), -float('inf')])
@pytest.mark.parametrize('act,res', [('relu', True), ('silu', False), ('none', False)])
def test_a_nan_or_inf_batch_is_as_stock(bad, act, res):
    """A batch holding a NaN or an infinity: the fused layer's output, gradients and running statistics are NaN / inf
    exactly where the stock modules' are (no crash, no fix-up: a NaN batch variance once became 0 in the running one)"""
    torch.manual_seed(0)
    f = FusedConvBN2d(3, 4, 3, padding=1, act=act)
    stock = copy.deepcopy(f.to_stock())
    x = torch.randn(2, 3, 6, 6); x[0, 1, 2, 3] = bad
    r = torch.randn(2, 4, 6, 6) if res else None
    xs, xf = x.clone().requires_grad_(), x.clone().contiguous(memory_format=torch.channels_last).requires_grad_()
    z = stock[1](stock[0](xs))
    os_, of = ACTS[act](z if r is None else z + r), f(xf, r)
    os_.sum().backward(); of.sum().backward()
    pattern = lambda t: (t.isnan(), t.isinf())
    for a, b in [(os_, of), (xs.grad, xf.grad), (stock[0].weight.grad, f.weight.grad), (stock[1].weight.grad, f.bn.weight.grad),
                 (stock[1].running_mean, f.bn.running_mean), (stock[1].running_var, f.bn.running_var)]:
        assert all(torch.equal(p, q) for p, q in zip(pattern(a), pattern(b)))

@pytest.mark.cuda
def test_a_capture_takes_the_way_the_eager_steps_took(tmp_path, monkeypatch):
    """Inside a CUDA graph's capture a fused layer runs the way its eager steps took: a way no step ran would compile
    kernels or allocate their constants inside the capture, which fails it (`clfast.graphs`)"""
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(fused_mod, '_ways', {}); monkeypatch.setattr(timing, '_here', {})
    layer = FusedConvBN2d(16, 16, 3, padding=1).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(8, 16, 8, 8, device='cuda').to(memory_format=torch.channels_last).requires_grad_()
    a, bn = fused_mod.get_act(layer.act), layer.fused_bn
    with layer_way('timed'):   # (this module runs 'fused' otherwise)
        layer(x)   # the eager step: times this layer's two ways
        key = fused_mod._layer_key(x, layer, bn, None, a, 0., True)
        assert key in fused_mod._ways
        # 'stock' recorded, whatever this GPU's timing chose: a capture's way for a key nothing recorded is 'fused'
        fused_mod._ways[key] = 'stock'
        s, g = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=s): way = fused_mod._way(x, layer, bn, None, a, 0., True)
        assert way == 'stock'

@pytest.mark.cuda
def test_a_graphs_steps_choose_their_layers_by_the_gpus_time(tmp_path, monkeypatch):
    """Inside `steps_for_graphs` (a CUDA graph's warm-up and capture: `clfast.graphs`) a 'timed' layer is timed by the
    GPU's clock (`DeviceClock`), its choice kept apart from the eager steps': a replay issues nothing from the host, so
    the eager choice, the host's time in it, is not the replay's"""
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(fused_mod, '_ways', {}); monkeypatch.setattr(timing, '_here', {})
    layer = FusedConvBN2d(24, 24, 3, padding=1).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(6, 24, 8, 8, device='cuda').to(memory_format=torch.channels_last).requires_grad_()
    a, bn = fused_mod.get_act(layer.act), layer.fused_bn
    eager = fused_mod._layer_key(x, layer, bn, None, a, 0., True)
    with fused_mod.steps_for_graphs(): key = fused_mod._layer_key(x, layer, bn, None, a, 0., True)
    assert key == (eager[0], 'graphed', *eager[1:])
    clocks = []
    def clock(device):
        clocks.append(timing.DeviceClock(device)); return clocks[-1]
    monkeypatch.setattr(fused_mod, 'DeviceClock', clock)   # a spy: the real clock runs
    with layer_way('timed'):
        with fused_mod.steps_for_graphs(): layer(x)
        assert set(fused_mod._ways) == {key} and len(clocks) == 1 and clocks[0].total > 0
        layer(x)   # an eager step: timed again, by the host's and the GPU's time together, under its own key
        assert set(fused_mod._ways) == {key, eager} and len(clocks) == 1
    assert not fused_mod._for_graphs

# found by a seeded fuzz of the layer: torch 2.14's CPU conv of a channels-last input with a bias crashed the process
# (segfault) on a 1x1 kernel dilated (1, 3) at stride 3, padding 1, on 8x2 maps (every output column reads only
# padding: a degenerate conv, but a crash, in the fused op and in its stock way). The dilation changes nothing along a
# size-1 kernel dimension, so clfast runs that conv undilated there. A child process: before the fix the crash took
# the interpreter with it. Each output channel is one value (its bias): a degenerate BN, whose fp32 error is
# stock's own (3x stock contiguous fp32's, absolute)
_DILATED_1X1 = """
import torch, copy
from torch import nn
from clfast.fused import FusedConvBN2d, set_layer_way
set_layer_way({way!r})
torch.manual_seed(0)
f = FusedConvBN2d(13, 5, 1, stride=3, padding=1, dilation=(1, 3), bias=True, act='silu', mode={mode!r})
stock = nn.Sequential(nn.Conv2d(13, 5, 1, 3, 1, (1, 3), bias=True), nn.BatchNorm2d(5), nn.SiLU())
stock[0].load_state_dict({{k: v for k, v in f.state_dict().items() if not k.startswith('bn.')}}); stock[1].load_state_dict(f.bn.state_dict())
ref = copy.deepcopy(stock).double()
x = torch.randn(3, 13, 8, 2, dtype=torch.float64)
def step(m, x, conv, bn):
    x = x.requires_grad_()
    out = m(x); out.sum().backward()
    # (not the conv bias's gradient: over a channel of one value it is 1/sqrt(eps) times y's rounding, and stock
    # channels-last fp32 is further off than the fused layer there: 9e-4 against 1.7e-4)
    return [out, x.grad, conv.weight.grad, bn.running_mean, bn.running_var]
want = step(ref, x.clone(), ref[0], ref[1])
with torch.autocast('cpu', dtype=torch.bfloat16, enabled={bf16!r}):
    got = step(f, x.float().contiguous(memory_format=torch.channels_last), f, f.bn)
    base = step(stock, x.float(), stock[0], stock[1])   # stock contiguous: the precision's error
err = lambda ts: max((a.double() - b).abs().max().item() for a, b in zip(ts, want))
print('ERR', err(got), err(base))
"""

@needs_cxx
# bf16 autocast: the stock way's conv backward timed against ATen's in fp32 (`clfast.routes.slow_backward_conv`, where
# this machine measured the bf16 backward slow) crashed there too
@pytest.mark.parametrize('way,mode,bf16', [('fused', 'speed', False), ('fused', 'memory', False), ('stock', 'speed', False),
                                          ('fused', 'speed', True), ('stock', 'speed', True)])
def test_dilation_on_a_size_one_kernel_dimension(way, mode, bf16, tmp_path):
    import subprocess, sys, os
    p = subprocess.run([sys.executable, '-c', _DILATED_1X1.format(way=way, mode=mode, bf16=bf16)], capture_output=True, text=True,
                       env={**os.environ, 'CLFAST_CACHE_DIR': str(tmp_path)}, timeout=300)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    err, stock_err = map(float, p.stdout.split('ERR')[-1].split())
    # every output reads padding only, so each channel's conv output is its bias, constant: BN's output, 0 in fp64, is
    # the rounding of y - mean times 1/sqrt(eps) (316x), about 1e-5 of a bias of 0.3 in fp32. Stock contiguous computes
    # that mean exactly at ATen's default level (error 0) and does not at AVX-512's (1.1e-6); the fused layer read
    # 1.9e-6 and 2.7e-6 there: the floor is that amplified rounding, not a precision difference
    assert err <= 3 * stock_err + 1e-5, (err, stock_err)

def test_a_fused_layer_of_another_dtype_than_its_input_raises_as_the_stock_conv():
    "A bf16 fused model given fp32 input outside autocast: the stock conv's RuntimeError (the op's ValueError named clfast's internals)"
    f = FusedConvBN2d(3, 4, 3, padding=1).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"Input type \(torch.float32\) and weight type \(torch.bfloat16\) should be the same"):
        f(torch.randn(2, 3, 5, 5))
    with pytest.raises(RuntimeError): nn.Conv2d(3, 4, 3).to(torch.bfloat16)(torch.randn(2, 3, 5, 5))   # stock's type
