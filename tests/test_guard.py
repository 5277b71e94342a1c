"The guard against known-bad stock channels-last kernels (clfast.bad_kernels, clfast.routes, clfast.guard) and the numerics self-check (clfast.check), against fp64"
import copy, json, os, pickle, subprocess, sys, textwrap, warnings
from unittest import mock
import pytest, torch, torch.nn.functional as F
import torch.autograd.forward_ad as fwAD
from torch import nn
from hypothesis import given, settings, example, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode
from fastai.vision.all import ConvLayer, Flatten, Learner, CrossEntropyLossFlat, Adam, Callback, NormType
import clfast.callback  # noqa: F401  (patches Learner)
from clfast import bad_kernels, guard, routes, check, timing
from clfast.machine import onednn_isa, isa_env, MachineCache
from clfast.bad_kernels import KNOWN_BAD_KERNELS, GuardPlan, route, bad_kernels_for
from clfast.routes import (GuardedConv2d, may_meet_short_input, short_input_plan, SHORT_INPUT_WGRAD, short_input_slower,
                           weight_grad_in_nchw, may_meet_slow_backward, slow_backward_conv, SLOW_BF16_BACKWARD,
                           reduced_backward_slower, NARROW_WEIGHT_GRAD_WRONG, GROUPED_NARROW_FORWARD_WRONG,
                           may_meet_narrow_map, narrow_map_plan, _poison_freed_memory, GuardedInstanceNorm2d,
                           WRONG_ONE_SAMPLE_INSTANCE_NORM)
from clfast.guard import guard_model, unguard_model, guard_report, IMPRECISE_CL_BATCH_NORM, CHECK_CACHE
from clfast.bn import PreciseBatchNorm2d
from clfast.fuse import fusion_report, unfuse_conv_bn
from clfast.fused import FusedConvBN2d
from clfast.audit import audit
from helpers import image_dls
import preloaded

pytestmark = pytest.mark.usefixtures('fused_way')   # the guard's routes inside fused layers are clfast's op's ('timed' could run them the stock way)

X86 = onednn_isa() is not None
needs_avx2 = pytest.mark.skipif(not X86 or 'avx2' not in open('/proc/cpuinfo').read() if os.path.exists('/proc/cpuinfo') else True,
                                reason="needs an x86 CPU with AVX2 (oneDNN capped to it with ONEDNN_MAX_CPU_ISA=AVX2)")
CHILD_TIMEOUT = 300

def run_child(code:str, env:dict|None=None) -> subprocess.CompletedProcess:
    "Run `code` in a fresh Python (oneDNN reads its ISA cap once per process), bounded in time"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, 'PYTHONPATH': root, **(env or {})}
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=CHILD_TIMEOUT, cwd=root)

# the thin 1x1 stride-2 conv of oneDNN issue 6035, weight gradient against fp64, 8 seeds; prints the worst relative error
WGRAD_VS_FP64 = '''
import torch, torch.nn.functional as F, sys
from clfast.bad_kernels import GuardPlan, route
guarded = sys.argv[1] == 'guarded'
worst = 0.
for seed in range(8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 8, 8, generator=g); w = torch.randn(4, 3, 1, 1, generator=g); dy = torch.randn(2, 4, 4, 4, generator=g)
    w64 = w.double().requires_grad_(); F.conv2d(x.double(), w64, None, 2).backward(dy.double())
    wc = w.to(memory_format=torch.channels_last).requires_grad_()
    plan = GuardPlan('subsample', True, 'test') if guarded else None
    r = route(plan, x.to(memory_format=torch.channels_last), wc, (2, 2))
    y = r.restore(F.conv2d(r.x, r.weight, None, r.stride))
    y.backward(dy.contiguous(memory_format=torch.channels_last))
    worst = max(worst, ((wc.grad.double() - w64.grad).abs().max() / w64.grad.abs().max()).item())
print('WORST', worst)
'''

@needs_avx2
def test_avx2_kernel_is_routed_by_the_table_and_equals_fp64():
    """With oneDNN capped at AVX2 (any x86 CI machine), where `KNOWN_BAD_KERNELS` names its channels-last 1x1 stride-2
    weight gradient (oneDNN 6035: the kernel overruns its workspace), the guard routes such a conv and its gradient
    equals fp64. Nothing is asserted of the stock kernel's result: it reads memory it does not own (undefined
    behaviour; one process once got every seed right), so only clfast's result, given the table, is tested"""
    env = {'ONEDNN_MAX_CPU_ISA': 'AVX2'}
    table = run_child("import torch.nn as nn; from clfast.bad_kernels import bad_kernels_for\n"
                      "print('ROUTED', bool(bad_kernels_for(nn.Conv2d(3, 4, 1, stride=2))))", env)
    assert 'ROUTED True' in table.stdout, table.stdout + table.stderr
    ok = run_child(WGRAD_VS_FP64.replace('sys.argv[1]', "'guarded'"), env)
    assert ok.returncode == 0, ok.stderr
    assert float(ok.stdout.split('WORST')[1]) < 1e-5

def test_table_rows_are_complete():
    for row in KNOWN_BAD_KERNELS:
        assert row.op and row.reference and row.workaround in ('subsample', 'contiguous') and row.channel_block

def test_isa_cap(monkeypatch):
    "clfast reads the caps once per process (`isa_env`): this test, which changes them in its own, has them read again"
    if not X86: pytest.skip("oneDNN ISAs are x86's")
    try:
        monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'SSE41'); isa_env.cache_clear()
        assert onednn_isa() == 'sse41' and bad_kernels_for(nn.Conv2d(3, 8, 1, stride=2)) == []
        monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX2'); isa_env.cache_clear()
        assert onednn_isa() in ('avx2', 'avx', 'sse41')
    finally: monkeypatch.undo(); isa_env.cache_clear()

conv_cases = st.fixed_dictionaries(dict(
    n=st.sampled_from([1, 2]), cin=st.sampled_from([1, 2, 3, 4, 5, 8]), cout=st.sampled_from([1, 4, 17]),
    hw=st.sampled_from([(1, 1), (5, 7), (8, 8), (9, 4)]), stride=st.sampled_from([(2, 2), (3, 1), (1, 2)]),
    groups=st.sampled_from([1, 'depthwise']), bias=st.booleans(), cl=st.booleans(),
    how=st.sampled_from(['subsample', 'contiguous'])))

@settings(deadline=None)
@given(c=conv_cases)
@example(c=dict(n=2, cin=3, cout=1, hw=(8, 8), stride=(2, 2), groups=1, bias=False, cl=True, how='subsample'))
@example(c=dict(n=1, cin=1, cout=4, hw=(5, 7), stride=(2, 2), groups=1, bias=False, cl=True, how='subsample'))
@example(c=dict(n=2, cin=1, cout=1, hw=(8, 8), stride=(2, 2), groups=1, bias=False, cl=True, how='contiguous'))
def test_workarounds_equal_fp64(c):
    "Both workarounds give the conv's output and gradients within fp32 rounding of fp64 (any layout, ambiguous ones too)"
    torch.manual_seed(0)
    groups = c['cin'] if c['groups'] == 'depthwise' else 1
    cout = c['cin'] if groups > 1 else c['cout']
    m = nn.Conv2d(c['cin'], cout, 1, c['stride'], groups=groups, bias=c['bias'])
    m64 = copy.deepcopy(m).double()
    fmt = torch.channels_last if c['cl'] else torch.contiguous_format
    m = m.to(memory_format=fmt); guard_model(m)
    m.__class__ = GuardedConv2d
    m._cl_guard = GuardPlan(c['how'], True, 'test')   # whatever this CPU is
    x = torch.randn(c['n'], c['cin'], *c['hw'])
    x64, x32 = x.double().requires_grad_(), x.to(memory_format=fmt).requires_grad_()
    y, y64 = m(x32), m64(x64)
    with torch.no_grad(): y_stock = nn.Conv2d._conv_forward(m, x32, m.weight, m.bias)   # no gradient: a right kernel
    assert y.shape == y64.shape   # and the guard keeps the stock output layout (strides of size-1 dims mean nothing)
    assert [st for st, n in zip(y.stride(), y.shape) if n > 1] == [st for st, n in zip(y_stock.stride(), y.shape) if n > 1]
    dy = torch.randn(y64.shape, dtype=torch.float64)
    y.backward(dy.float()); y64.backward(dy)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y.double(), y64.detach(), **tol)
    torch.testing.assert_close(x32.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(m.weight.grad.double(), m64.weight.grad, **tol)
    if c['bias']: torch.testing.assert_close(m.bias.grad.double(), m64.bias.grad, **tol)

def thin_stem_learner(cin=3, size=16):
    "A fastai Learner whose first layer is the conv of oneDNN issue 6035: 1x1, stride 2, on a thin input"
    net = nn.Sequential(ConvLayer(cin, 8, ks=1, stride=2), ConvLayer(8, 16, stride=2), nn.AdaptiveAvgPool2d(1),
                        Flatten(), nn.Linear(16, 2))
    return Learner(image_dls(c=cin, size=size), net, loss_func=CrossEntropyLossFlat(), opt_func=Adam)

def _affected_here(): return bool(bad_kernels_for(nn.Conv2d(3, 8, 1, stride=2)))

@pytest.mark.parametrize('fuse', [False, 'speed', 'memory'])
@pytest.mark.parametrize('cin', [1, 3])
def test_learner_gradients_equal_fp64(fuse, cin):
    "to_channelslast (no fusion and both fuse modes): every gradient of a thin 1x1 stride-2 stem learner equals fp64"
    learn = thin_stem_learner(cin)
    ref = copy.deepcopy(learn.model).double()
    keys = list(learn.model.state_dict())
    learn.to_channelslast(use_amp=False, fuse=fuse)
    assert list(learn.model.state_dict()) == keys
    stem = learn.model[0][0]
    if _affected_here():
        assert stem._cl_guard is not None and stem._cl_guard.workaround == 'subsample'
        assert type(stem) is (GuardedConv2d if not fuse else FusedConvBN2d)
        assert [n for n, *_ in guard_report(learn.model)] == ['0.0']
    xb, yb = learn.dls.one_batch()
    learn.model.train(); ref.train()
    xcl = xb.as_subclass(torch.Tensor).to(memory_format=torch.channels_last)
    learn.loss_func(learn.model(xcl), yb).backward()
    learn.loss_func(ref(xb.as_subclass(torch.Tensor).double()), yb).backward()
    for (n, p), p64 in zip(learn.model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double(), p64.grad, rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")

def test_guard_survives_fit_export_and_undo(tmp_path):
    "A guarded learner fits; pickled (as export does) it is all stock modules; to_contiguous and unfuse_conv_bn remove the guard"
    learn = thin_stem_learner(3)
    learn.to_channelslast(use_amp=False, fuse='speed')
    learn.fit(1)
    if _affected_here():
        assert 'guarded 0.0: subsample' in repr(fusion_report(learn.model))
        xb = torch.randn(4, 3, 16, 16).to(memory_format=torch.channels_last)
        assert 'guarded 0.0: subsample' in str(audit(learn.model, xb))
    torch.save(learn.model, tmp_path/'m.pt')   # what export pickles (export itself: tests/test_integration.py)
    loaded = torch.load(tmp_path/'m.pt', weights_only=False)
    assert not [type(m) for m in loaded.modules() if type(m).__module__.startswith('clfast')]
    assert not any('_cl_guard' in vars(m) for m in loaded.modules())   # pickled as stock: no plan
    learn.to_channelslast(use_amp=False)          # unfused, guarded as a GuardedConv2d
    if _affected_here(): assert type(learn.model[0][0]) is GuardedConv2d
    learn.to_contiguous()
    assert guard_report(learn.model) == [] and type(learn.model[0][0]) is nn.Conv2d
    learn.to_channelslast(use_amp=False, fuse='memory'); unfuse_conv_bn(learn.model)
    assert type(learn.model[0][0]) is nn.Conv2d and '_cl_guard' not in vars(learn.model[0][0])

def test_no_cost_where_no_conv_is_affected():
    "A model without affected convs keeps everything but the class of convs that may meet a slow path routed per call: no plan stored"
    from helpers import conv_net
    net = conv_net(3)
    precise_bn = IMPRECISE_CL_BATCH_NORM.present()
    routed = lambda m: may_meet_short_input(m) or may_meet_slow_backward(m) or may_meet_narrow_map(m)
    before = [(GuardedConv2d if type(m) is nn.Conv2d and routed(m) else
               PreciseBatchNorm2d if type(m) is nn.BatchNorm2d and precise_bn else type(m), dict(m.__dict__))
              for m in net.modules()]
    assert guard_model(net) == [] and guard_report(net) == []
    assert [(type(m), dict(m.__dict__)) for m in net.modules()] == before

# --- the short-input route (SHORT_INPUT_WGRAD): right but slow stock kernels ------------------------------------------

CL = torch.channels_last

def _weight_copies(conv, x) -> int:
    "How many weight-shaped copies one forward + backward of `conv` on `x` makes"
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p: conv(x).sum().backward()
    shape = list(conv.weight.shape)
    return sum(1 for e in p.events() if e.name == 'aten::copy_' and e.input_shapes and list(e.input_shapes[0]) == shape)

def test_short_input_premise_is_measured_and_the_route_follows_it(tmp_path, monkeypatch):
    "The route's premise is measured here (stock channels-last against the weight gradient in nchw, paired), cached per "
    "machine; a 3x3 conv that may meet a 2-row input is routed exactly where it held"
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {})   # measured afresh here; this process's answers back after the test
    here = SHORT_INPUT_WGRAD.present()
    assert timing.timings()[f'premise:{SHORT_INPUT_WGRAD.name}'].chosen == here
    conv = nn.Conv2d(512, 512, 3, padding=1, bias=False)
    x = torch.randn(4, 512, 2, 2).to(memory_format=CL).requires_grad_()
    for held in (here, True, False):   # what was measured, and clfast's behaviour given either answer
        timing._here[f'premise:{SHORT_INPUT_WGRAD.name}'] = held
        timing._here.update({f'premise:{k.name}': False for k in (SLOW_BF16_BACKWARD, routes.SLOW_FP16_BACKWARD)})   # this route alone
        m = copy.deepcopy(conv).to(memory_format=CL); guard_model(m)
        assert (type(m) is GuardedConv2d) == held and (short_input_plan(m, x, m.weight) is not None) == held

def _saved_mib(model, x) -> float:
    total = 0
    def pack(t):
        nonlocal total
        total += t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t): model(x)
    return total / 2**20

def test_short_input_route_equals_fp64_and_costs_no_memory(monkeypatch):
    "resnet18 at 64 px in training, as where the slow path measured: exactly layer4's 3x3 convs on 2x2 inputs are "
    "routed; each gives fp64's output and gradients; the audit lists them as guarded, not the route's own copies; the "
    "model keeps <= 1.05x the saved activations of stock channels-last"
    import torchvision
    monkeypatch.setitem(timing._here, f'premise:{SHORT_INPUT_WGRAD.name}', True)
    torch.manual_seed(0)
    stock = torchvision.models.resnet18(num_classes=10).to(memory_format=CL)
    m = copy.deepcopy(stock)
    guard_model(m)
    seen = {}
    hooks = [c.register_forward_pre_hook(lambda c, a, n=n: seen.update({n: a[0].detach()}) if short_input_plan(c, a[0], c.weight) else None)
             for n, c in m.named_modules() if isinstance(c, nn.Conv2d)]
    x = torch.randn(4, 3, 64, 64).to(memory_format=CL)
    m(x).sum().backward()
    for h in hooks: h.remove()
    assert list(seen) == ['layer4.0.conv2', 'layer4.1.conv1', 'layer4.1.conv2']
    r = audit(m, x)
    assert r.ok, r
    assert [n for n, *_ in r.guarded] == list(seen) and 'shorter than the dilated kernel' in str(r)
    assert audit(m, x, backward=False).ok
    for name, xi in seen.items():
        conv = m.get_submodule(name); conv.weight.grad = None
        xi = xi.requires_grad_()
        out = conv(xi)
        dy = torch.randn(out.shape, dtype=torch.float64)
        out.backward(dy.float())
        x64, w64 = xi.detach().double().requires_grad_(), conv.weight.detach().double().requires_grad_()
        out64 = torch.nn.functional.conv2d(x64, w64, None, conv.stride, conv.padding)
        out64.backward(dy)
        for a, b in ((out, out64), (xi.grad, x64.grad), (conv.weight.grad, w64.grad)):
            assert ((a.double() - b).abs().max() / b.abs().max()).item() < 1e-5, name
        assert conv.weight.grad.is_contiguous(memory_format=CL)
        # forward-mode AD through the route (its jvp): the tangent along x and the weight
        vx, vw = torch.randn_like(xi), torch.randn_like(conv.weight)
        with fwAD.dual_level():
            dx, dw = fwAD.make_dual(xi.detach(), vx), fwAD.make_dual(conv.weight.detach().requires_grad_(), vw)
            assert short_input_plan(conv, dx, dw) is not None
            t = fwAD.unpack_dual(torch.func.functional_call(conv, {'weight': dw}, (dx,))).tangent
        conv64 = lambda a, w: torch.nn.functional.conv2d(a, w, None, conv.stride, conv.padding)
        t64 = conv64(vx.double(), w64.detach()) + conv64(x64.detach(), vw.double())
        assert ((t.double() - t64).abs().max() / t64.abs().max()).item() < 1e-5, name
    xb = torch.randn(32, 3, 64, 64).to(memory_format=CL)
    routed, plain = _saved_mib(m, xb), _saved_mib(stock, xb)
    assert routed <= 1.05 * plain, (routed, plain)

def test_unguardable_conv_warns():
    "An affected conv that is not a stock nn.Conv2d (nor fused) cannot be guarded: the warning says what to do"
    class MyConv(nn.Conv2d): pass
    net = nn.Sequential(MyConv(3, 8, 1, stride=2))
    if not _affected_here(): pytest.skip("no known-bad kernel on this CPU")
    with pytest.warns(UserWarning, match='to_contiguous'): guard_model(net)

# --- the slow bf16 / fp16 backward (SLOW_BF16_BACKWARD): right but slow stock kernels, timed per shape -----------------

def test_slow_backward_premise_is_measured_and_cached(tmp_path, monkeypatch):
    "The premise is the probe's measurement on this machine (stock bf16 against fp32 on widened copies), cached per machine"
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {})
    calls = []
    probe = lambda: calls.append(1) or reduced_backward_slower(torch.bfloat16)
    held = routes.premise('test_slow_bf16', probe)
    assert routes.premise('test_slow_bf16', probe) == held and len(calls) == 1
    conv = nn.Conv2d(8, 8, 3, padding=1)
    monkeypatch.setattr(timing, '_here', {f'premise:{SLOW_BF16_BACKWARD.name}': held, f'premise:{routes.SLOW_FP16_BACKWARD.name}': False})
    assert may_meet_slow_backward(conv) == held and not may_meet_slow_backward(nn.Conv2d(8, 8, 3, padding='same'))

@pytest.mark.parametrize('autocast', [True, False], ids=['autocast', 'bf16_model'])
def test_slow_backward_route_equals_fp64_and_learns_the_way(monkeypatch, autocast):
    "Where the premise holds, a bf16 depthwise conv's gradients come from the timed backward: fp64's at bf16 precision, in stock's dtypes and layouts; a shape that chose ATen's way takes the stock call after"
    if not SLOW_BF16_BACKWARD.present(): pytest.skip("bf16 conv backward measured no slower than fp32 here")
    from clfast.ops import kernels_ready
    if not kernels_ready(): pytest.skip("no C++ library")
    monkeypatch.setattr(routes, '_BACKWARD_WAYS', {})   # what this process learnt so far (the C++ keeps its own choices)
    torch.manual_seed(0)
    conv = nn.Conv2d(40, 40, 3, stride=2, padding=1, groups=40).to(memory_format=CL)
    if not autocast: conv = conv.bfloat16()
    x = torch.randn(3, 40, 14, 10).to(memory_format=CL).to(conv.weight.dtype).requires_grad_()
    guard_model(conv)
    assert type(conv) is GuardedConv2d and guard_report(conv) == []
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        assert slow_backward_conv(conv, x, conv.weight, conv.bias) is not None   # this call is routed
        y = conv(x)
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=CL)
    dy = torch.randn(y.shape).to(memory_format=CL).bfloat16()
    y.backward(dy)
    x64, w64, b64 = (t.detach().bfloat16().double().requires_grad_() for t in (x, conv.weight, conv.bias))
    F.conv2d(x64, w64, b64, 2, 1, 1, 40).backward(dy.double())
    for name, got, want, like in (('dx', x.grad, x64.grad, x), ('dweight', conv.weight.grad, w64.grad, conv.weight),
                                  ('dbias', conv.bias.grad, b64.grad, conv.bias)):
        assert got.dtype == like.dtype and got.stride() == like.stride(), name
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"{name}: {err:.3g}"
    ways = dict(routes._BACKWARD_WAYS)
    key = next(k for k in ways if tuple(k[0]) == (3, 40, 14, 10) and k[5] == torch.bfloat16)
    assert ways[key] in ('conv', 'fp32') and key[-1] is True   # learnt for a dense x (a channel slice's is apart)
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        routed = slow_backward_conv(conv, x, conv.weight, conv.bias) is not None
    assert routed == (ways[key] != 'conv')
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):   # inference: stock
        assert slow_backward_conv(conv, x, conv.weight, conv.bias) is None
    assert slow_backward_conv(conv, x.detach().float(), conv.weight.float(), None) is None   # fp32: stock
    # a second derivative (create_graph=True) through the routed conv: ATen's backward, differentiable again
    torch.manual_seed(1)
    conv2 = nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=6).to(memory_format=CL).bfloat16()
    guard_model(conv2)
    x2 = torch.randn(2, 6, 9, 9).to(memory_format=CL).bfloat16().requires_grad_()
    assert slow_backward_conv(conv2, x2, conv2.weight, conv2.bias) is not None   # a shape not met yet: routed
    (gx,) = torch.autograd.grad(conv2(x2).float().square().sum(), x2, create_graph=True)
    (ggw,) = torch.autograd.grad(gx.float().square().sum(), conv2.weight)
    w64, xx = conv2.weight.detach().double().requires_grad_(), x2.detach().double().requires_grad_()
    (gx64,) = torch.autograd.grad(F.conv2d(xx, w64, conv2.bias.double(), 2, 1, 1, 6).square().sum(), xx, create_graph=True)
    (ggw64,) = torch.autograd.grad(gx64.square().sum(), w64)
    assert ((ggw.double() - ggw64).norm() / ggw64.norm()).item() < 5e-2

# --- half-precision kernels wrong on narrow maps (NARROW_WEIGHT_GRAD_WRONG, GROUPED_NARROW_FORWARD_WRONG) -------------

BF16 = torch.bfloat16
# (the conv, its input's shape): a 3x3 stride-2 conv on 1-wide maps (the weight gradient's class), and a grouped conv
# with one input and two output channels a group, stride (1, 2), on an output 1 wide (the grouped forward's, and the
# weight gradient's too: zero-padded along the width, its input narrower than its stride)
NARROW_CASES = {'weight_grad': (lambda: nn.Conv2d(16, 32, 3, stride=2, padding=1), (4, 16, 6, 1)),
                'grouped_forward': (lambda: nn.Conv2d(8, 16, (1, 2), stride=(1, 2), padding=(0, 1), groups=8), (4, 8, 5, 1)),
                'grouped_forward_unpadded': (lambda: nn.Conv2d(4, 8, (1, 2), stride=(1, 2), groups=4), (2, 4, 5, 2))}

def _strides(t) -> list: return [st for st, n in zip(t.stride(), t.shape) if n > 1]

def test_narrow_map_premises_are_measured_and_cached(tmp_path, monkeypatch):
    "Each premise is its probe's answer on this machine (bf16 and fp16 apart), measured once and cached per machine; a conv may meet a route exactly where its class's premise held"
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {})
    kernels = (*NARROW_WEIGHT_GRAD_WRONG.values(), *GROUPED_NARROW_FORWARD_WRONG.values())
    held = {k.name: k.present() for k in kernels}
    assert {k.name: timing.timings()[f'premise:{k.name}'] for k in kernels} == held
    calls = []
    monkeypatch.setattr(timing, '_here', {})   # the cache alone answers now: no probe runs
    with mock.patch.object(routes, 'half_conv_wrong', lambda *a: calls.append(a)):
        assert {k.name: k.present() for k in kernels} == held and calls == []
    weight_grad, grouped = (any(held[k.name] for k in d.values()) for d in (NARROW_WEIGHT_GRAD_WRONG, GROUPED_NARROW_FORWARD_WRONG))
    assert may_meet_narrow_map(NARROW_CASES['weight_grad'][0]()) == weight_grad
    assert may_meet_narrow_map(NARROW_CASES['grouped_forward_unpadded'][0]()) == grouped
    for never in (nn.Conv2d(16, 32, 3, padding=1), nn.Conv2d(16, 32, (3, 1), stride=2, padding=1),   # stride 1; 1 wide
                  nn.Conv2d(16, 32, 3, stride=2), nn.Conv2d(16, 32, 3, stride=2, padding=1, padding_mode='reflect')):   # unpadded
        assert not may_meet_narrow_map(never), never

@pytest.mark.parametrize('case', list(NARROW_CASES))
@pytest.mark.parametrize('autocast', [True, False], ids=['autocast', 'bf16_model'])
def test_narrow_map_calls_equal_fp64(case, autocast, monkeypatch):
    """A bf16 training step of a conv in a narrow-map class, guarded as `to_channelslast()` guards it: its output and
    gradients are fp64's (of the same bf16 inputs) at bf16's precision, in the stock conv's dtypes and layouts, after a
    freed buffer of huge values before forward and backward (as in training, where the stock kernels read them: off by
    1 to 1e35 of fp64's largest value, or inf or NaN, on an AVX-512 EPYC). The route is taken where the premise holds here, and gives fp64's either way"""
    make, shape = NARROW_CASES[case]
    for held in (None, True):   # this machine's answer, then the route forced (right on any machine)
        if held: monkeypatch.setattr(timing, '_here', {**timing._here, **{f'premise:{k.name}': True for k in
                                     (*NARROW_WEIGHT_GRAD_WRONG.values(), *GROUPED_NARROW_FORWARD_WRONG.values())}})
        torch.manual_seed(0)
        net = nn.Sequential(make()).to(memory_format=CL)
        if not autocast: net = net.bfloat16()
        guard_model(net)
        conv = net[0]
        x = torch.randn(shape).to(conv.weight.dtype).to(memory_format=CL).requires_grad_()
        with torch.autocast('cpu', dtype=BF16, enabled=autocast):
            plan = narrow_map_plan(conv, x, conv.weight)
            if held or plan is not None: assert type(conv) is GuardedConv2d and plan.workaround == 'fp32'
            _poison_freed_memory()
            y = conv(x)
        assert y.dtype == BF16 and y.is_contiguous(memory_format=CL)
        dy = torch.randn(y.shape).bfloat16().to(memory_format=CL)
        _poison_freed_memory()
        y.backward(dy)
        x64, w64, b64 = (t.detach().bfloat16().double().requires_grad_() for t in (x, conv.weight, conv.bias))
        y64 = F.conv2d(x64, w64, b64, conv.stride, conv.padding, conv.dilation, conv.groups)
        y64.backward(dy.double())
        for name, got, want, like in (('out', y, y64, None), ('dx', x.grad, x64.grad, x),
                                      ('dweight', conv.weight.grad, w64.grad, conv.weight), ('dbias', conv.bias.grad, b64.grad, conv.bias)):
            if like is not None:   # (a stride of a size-1 dimension means nothing, and autograd keeps either)
                assert got.dtype == like.dtype and _strides(got) == _strides(like), name
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < 2**-6, f"{case}, premise {held}: {name} off fp64 by {err:.3g}"
        if plan is not None and not autocast:   # the audit names the route, and the route's copies are not thrashing
            r = audit(net, x.detach())
            assert r.ok and [(n, how) for n, how, _ in r.guarded] == [('0', 'fp32')], r

@pytest.mark.isa_neutral   # an import and a function's attributes
def test_a_premise_is_marked_constant_without_importing_dynamo():
    """`premise` (and whether the CPU's kernels are ready, whose first answer loads the C++ library) carries what
    `torch.compiler.assume_constant_result` sets on a function, and nothing else, without the decorator's import of
    torch._dynamo: clfast's modules import none (1.1 s of each import, in each child process)"""
    from clfast import machine, ops
    marked, ours = torch.compiler.assume_constant_result(lambda: 0), machine._constant_under_compile(lambda: 0)
    assert vars(ours) == vars(marked) and vars(marked)
    assert all(getattr(f, k) == v for f in (routes.premise, ops._cpu_ready) for k, v in vars(marked).items())
    r = subprocess.run([sys.executable, '-c', "import sys, clfast.all, clfast.fused, clfast.guard, clfast.host_cost; "
                        "print('dynamo imported', 'torch._dynamo' in sys.modules)"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and 'dynamo imported False' in r.stdout, r.stdout + r.stderr[-2000:]

# (about tracing: the route's numerics at each instruction-set level are the eager tests' above, and this one's first
# compile takes 16 s, at each level of the matrix too)
@pytest.mark.isa_neutral
@pytest.mark.parametrize('case', ['weight_grad', 'grouped_forward'])
def test_a_compiled_narrow_map_conv_is_routed_silently(case, tmp_path, monkeypatch):
    """Under torch.compile, in a process that finds this machine's premises in its cache, a guarded conv's route is
    traced with its premise read as a constant (dynamo traced the cache's reads and warned about each of four cached
    functions): one graph, no warning, and a bf16 training step at fp64's precision"""
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {})
    for k in (*NARROW_WEIGHT_GRAD_WRONG.values(), *GROUPED_NARROW_FORWARD_WRONG.values()): k.present()   # measured, cached
    monkeypatch.setattr(timing, '_here', {})   # a new process: the cache's answers
    make, shape = NARROW_CASES[case]
    torch.manual_seed(0)
    net = nn.Sequential(make()).to(memory_format=CL)
    guard_model(net)
    conv = net[0]
    x = torch.randn(shape).to(memory_format=CL).requires_grad_()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter('error')   # any warning fails the test, but torch's own deprecations: torch 2.11's
        # compiler, imported by the first compile in a process (clfast's modules import none of it), says one of its own
        warnings.filterwarnings('ignore', category=DeprecationWarning, module='torch')
        # and dynamo's about the interpreter: on Python 3.13.0 (a CPython bug, fixed in 3.13.1) any guard on an
        # object's attributes warns that guards run slower
        warnings.filterwarnings('ignore', 'Guards may run slower on Python 3.13.0', RuntimeWarning)
        with torch.autocast('cpu', dtype=BF16):
            explained = torch._dynamo.explain(net)(x)
            y = torch.compile(net)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    dy = torch.randn(y.shape).bfloat16()
    y.backward(dy)
    x64, w64, b64 = (t.detach().bfloat16().double().requires_grad_() for t in (x, conv.weight, conv.bias))
    y64 = F.conv2d(x64, w64, b64, conv.stride, conv.padding, conv.dilation, conv.groups)
    y64.backward(dy.double())
    for name, got, want in (('out', y, y64), ('dx', x.grad, x64.grad), ('dweight', conv.weight.grad, w64.grad)):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < 2**-6, f"{name} off fp64 by {err:.3g}"

DILATED_SIZE_ONE = """
import torch, torch.nn.functional as F
from torch import nn
from clfast import timing
from clfast.guard import guard_model, MEASURED_KERNELS
timing._here.update({f'premise:{k.name}': False for k in MEASURED_KERNELS})   # this route alone
torch.manual_seed(0)
for kernel, dilation, stride, padding, groups, shape, bias in (((1, 1), (1, 3), 3, 1, 1, (3, 13, 8, 2), True),
                                                               ((3, 1), (1, 2), (1, 2), (2, 1), 3, (1, 3, 8, 1), True)):
    for dtype in (torch.float32, torch.bfloat16):
        cin = shape[1]
        net = nn.Sequential(nn.Conv2d(cin, 19 * groups, kernel, stride, padding, dilation, groups, bias)).to(memory_format=torch.channels_last)
        guard_model(net)
        conv = net[0]
        x = torch.randn(shape).to(memory_format=torch.channels_last).requires_grad_()
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = conv(x)
        y.float().square().sum().backward()
        # the same conv without the dilation, in fp64
        x64, w64 = x.detach().to(y.dtype).double().requires_grad_(), conv.weight.detach().to(y.dtype).double().requires_grad_()
        b64 = None if conv.bias is None else conv.bias.detach().to(y.dtype).double()
        y64 = F.conv2d(x64, w64, b64, stride, padding, 1, groups)
        y64.square().sum().backward()
        # (these convs read only padding along the width: where fp64's gradient is 0, the error is the value itself)
        errs = [((a.double() - b).abs().max() / (b.abs().max() if b.any() else 1)).item()
                for a, b in ((y, y64), (x.grad, x64.grad), (conv.weight.grad, w64.grad))]
        print(type(conv).__name__, str(dtype), max(errs))
"""

def test_a_conv_dilated_along_a_size_one_kernel_dim_runs_undilated():
    "Stock convs of these geometries (a dilated size-1 kernel dimension, on inputs so narrow that the conv reads only padding along it) crashed the process (segfault) in channels-last; guarded, each runs as the same conv undilated, at fp64's values (in a child process: a crash would end the test run)"
    r = run_child(DILATED_SIZE_ONE)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [l.split() for l in r.stdout.splitlines()]
    assert len(rows) == 4 and all(name == 'GuardedConv2d' for name, *_ in rows), r.stdout
    for name, dtype, err in rows: assert float(err) < (1e-5 if dtype == 'torch.float32' else 2**-6), (dtype, err)

def narrow_map_learner():
    "A fastai Learner on 8x1 images whose convs are in both narrow-map classes: a 3x3 stride-2 ConvLayer, then a grouped conv"
    net = nn.Sequential(ConvLayer(3, 8, ks=3, stride=2), nn.Conv2d(8, 16, (1, 2), stride=(1, 2), padding=(0, 1), groups=8),
                        nn.AdaptiveAvgPool2d(1), Flatten(), nn.Linear(16, 2))
    return Learner(image_dls(48, size=(8, 1), n_train=32), net, loss_func=CrossEntropyLossFlat(), opt_func=Adam)

class _FirstGrads(Callback):
    "Keeps the first batch and the model's gradients on it"
    order = 100
    def before_fit(self): self.grads = None
    def after_backward(self):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in self.learn.model.named_parameters()}
            self.batch = tuple(b[0].as_subclass(torch.Tensor).detach().clone() for b in (self.learn.xb, self.learn.yb))

@pytest.mark.parametrize('fuse', [False, 'speed', 'memory'])
def test_narrow_map_learner_trains_as_fp64(fuse):
    "`to_channelslast(amp_mode='bf16')` and a fit: the first step's gradients are fp64's of the same batch at bf16's precision, fused or not (the stock model's were off by 1e16-1e33 here)"
    learn = narrow_map_learner()
    ref = copy.deepcopy(learn.model).double()
    learn.to_channelslast(amp_mode='bf16', fuse=fuse)
    if not fuse and NARROW_WEIGHT_GRAD_WRONG[BF16].present(): assert type(learn.model[0][0]) is GuardedConv2d
    cb = _FirstGrads()
    learn.fit(1, lr=1e-3, cbs=cb)
    xb, yb = cb.batch
    assert xb.is_contiguous(memory_format=CL) and xb.shape[-1] == 1
    ref.train()
    learn.loss_func(ref(xb.double()), yb).backward()
    for (n, p64) in ref.named_parameters():
        got = cb.grads[n].double()
        err = ((got - p64.grad).norm() / p64.grad.norm()).item()
        assert err < 5e-2, f"{n}: {err:.3g}"

# --- instance norm of one sample (WRONG_ONE_SAMPLE_INSTANCE_NORM) ---------------------------------------------------

def test_one_sample_instance_norm_premise_and_guard(tmp_path, monkeypatch):
    "The premise is its probe's answer here, cached per machine; `guard_model` makes each stock InstanceNorm2d a GuardedInstanceNorm2d exactly where it held, over the same state, pickling as the stock class; `unguard_model` undoes it"
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {})
    held = WRONG_ONE_SAMPLE_INSTANCE_NORM.present()
    assert timing.timings()[f'premise:{WRONG_ONE_SAMPLE_INSTANCE_NORM.name}'] == held == routes.one_sample_instance_norm_wrong()
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8, affine=True), nn.Conv2d(8, 8, 3), nn.InstanceNorm2d(8))
    params, keys = list(net.parameters()), list(net.state_dict())
    guard_model(net)
    assert [type(m) for m in net[1::2]] == [GuardedInstanceNorm2d if held else nn.InstanceNorm2d] * 2
    assert list(net.parameters()) == params and list(net.state_dict()) == keys
    assert all(type(m) is nn.InstanceNorm2d for m in pickle.loads(pickle.dumps(net))[1::2])
    unguard_model(net)
    assert [type(m) for m in net[1::2]] == [nn.InstanceNorm2d] * 2 and list(net.parameters()) == params
    assert guard_model(nn.Sequential(nn.InstanceNorm2d(8)), device='meta') == []   # (not a CPU model: left stock)

@pytest.mark.cuda
def test_one_sample_instance_norm_on_cuda_is_right():
    "CUDA's stock instance norm of one sample, from a channels-last upstream gradient, against fp64 math: clfast guards CPU models only (`guard_model`), so it must be right there (it was on an H200, torch 2.11)"
    assert not routes.one_sample_instance_norm_wrong('cuda')

def instance_norm_learner():
    "A fastai Learner at batch size 1 on a generator's pattern: InstanceNorm2d layers whose outputs go to a conv and to a residual sum (their gradients come back channels-last)"
    class Residual(nn.Module):
        def __init__(self): super().__init__(); self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True))
        def forward(self, x): return x + self.body(x)
    net = nn.Sequential(ConvLayer(3, 8, norm_type=NormType.Instance), nn.Conv2d(8, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True),
                        Residual(), nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), Flatten(), nn.Linear(8, 2))
    return Learner(image_dls(6, size=8, bs=1, n_train=4), net, loss_func=CrossEntropyLossFlat(), opt_func=Adam)

@pytest.mark.parametrize('use_amp', [True, False], ids=['default', 'fp32'])
def test_one_sample_instance_norm_learner_trains_as_fp64(use_amp):
    "`to_channelslast()` and a fit at batch size 1: the first step's gradients are fp64's of the same batch at the precision's error, with the default mixed precision and in fp32 (stock's were off by 100% or more here, in fp64 too)"
    learn = instance_norm_learner()
    ref = copy.deepcopy(learn.model).double()
    learn.to_channelslast(use_amp=use_amp)
    if WRONG_ONE_SAMPLE_INSTANCE_NORM.present(): assert type(learn.model[2]) is GuardedInstanceNorm2d
    cb = _FirstGrads()
    learn.fit(1, lr=1e-3, cbs=cb)
    xb, yb = cb.batch
    assert xb.is_contiguous(memory_format=CL) and xb.shape[0] == 1
    ref.train()
    learn.loss_func(ref(xb.double().contiguous()), yb).backward()   # (contiguous: a channels-last fp64 one is wrong too)
    for (n, p64) in ref.named_parameters():
        if p64.grad.norm() < 1e-10: continue   # (a conv bias before an instance norm: no gradient in exact math)
        err = ((cb.grads[n].double() - p64.grad).norm() / p64.grad.norm()).item()
        assert err < (5e-2 if use_amp else 1e-4), f"{n}: {err:.3g}"

# --- the numerics self-check -----------------------------------------------------------------------------------------

@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    return tmp_path

def test_check_finds_the_avx2_bug_and_guards_it(cache_dir, monkeypatch, request):
    "With oneDNN capped at AVX2 in the child, the check flags the thin 1x1 stride-2 stem (wrong or crashed); one warning names it"
    if not X86: pytest.skip("needs x86")
    from clfast.machine import isa_env
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX2')
    isa_env.cache_clear()   # as a process started with it: the child runs at this cap, which the cache key names
    request.addfinalizer(isa_env.cache_clear)   # (read again once the environment is put back)
    monkeypatch.setattr(bad_kernels, 'KNOWN_BAD_KERNELS', ())   # as if the table did not know this bug
    learn = thin_stem_learner(2, size=8)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        table = learn.check_channelslast(timeout=30)
    assert len(table) == 2
    stem = table[table.layers == '0.0'].iloc[0]
    other = table[table.layers == '1.0'].iloc[0]
    assert other.status == 'ok' and other.error < 1e-4
    if 'avx2' in open('/proc/cpuinfo').read():
        assert stem.status in ('wrong', 'crashed', 'timeout'), stem   # the broken kernel may also hang
        msgs = [str(x.message) for x in w if 'check_channelslast' in str(x.message)]
        assert len(msgs) == 1 and '0.0' in msgs[0]
        assert guard_report(learn.model)[0][0] == '0.0' and type(learn.model[0][0]) is GuardedConv2d
        # cached: the second check runs no child process, and a fresh model is guarded from the cache
        with mock.patch.object(check.subprocess, 'Popen', side_effect=AssertionError("no child expected")):
            again = learn.check_channelslast(timeout=30)
        assert again.cached.all() and list(again.status) == list(table.status)
        fresh = thin_stem_learner(2, size=8).model
        assert [n for n, *_ in guard_model(fresh)] == ['0.0']

def test_check_no_conv(cache_dir):
    with pytest.warns(UserWarning, match='no nn.Conv2d'):
        assert len(check.check_channelslast(nn.Sequential(nn.Flatten(), nn.Linear(12, 2)), torch.randn(2, 3, 2, 2))) == 0

def test_check_counts_refused_before_a_child_runs(cache_dir):
    "n=0 failed in a reshape; a timeout of 0 or below called every conv hung and guarded the model"
    learn = thin_stem_learner(2, size=8)
    for kw, msg in [(dict(n=0), 'n=0 must be a whole number'), (dict(n=1.5), 'n=1.5 must be'),
                    (dict(timeout=0), 'timeout=0 must be seconds above 0'), (dict(timeout=-1), 'timeout=-1 must be')]:
        with mock.patch.object(check.subprocess, 'Popen', side_effect=AssertionError("no child expected")):
            with pytest.raises(ValueError, match=msg): learn.check_channelslast(**kw)

@pytest.mark.isa_neutral
@pytest.mark.parametrize('failure,status', [('import os; os.abort()', 'crashed'), ('import time; time.sleep(600)', 'timeout')])
def test_check_crash_or_hang_is_a_finding(cache_dir, monkeypatch, failure, status):
    "A child that dies or hangs on a geometry marks that geometry failing (and guarded), within the time bound"
    code = f'''
import json, sys
threads, cases = json.load(sys.stdin)
for key, conv, hw, precision in cases:
    print(json.dumps(dict(key=key, started=True)), flush=True)
    if conv['k'] == [1, 1]: {failure}
    print(json.dumps(dict(key=key, status='ok', error=0.0, worst='out')), flush=True)
'''
    monkeypatch.setattr(check, '_CHILD', [sys.executable, '-c', code])
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1, bias=False))
    with pytest.warns(UserWarning, match=r'layers 1'):
        table = check.check_channelslast(net, torch.randn(2, 3, 8, 8), timeout=3)
    assert list(table.status) == ['ok', status, 'ok']
    assert [n for n, *_ in guard_report(net)] == ['1'] and net[1]._cl_guard.workaround == 'contiguous'
    # the verdict is cached for this machine; a hang only within the time it was given: a longer timeout checks again
    monkeypatch.setattr(check, '_CHILD', [sys.executable, '-c', code.replace(failure, 'pass')])
    again = check.check_channelslast(net, torch.randn(2, 3, 8, 8), timeout=3)
    assert list(again.status) == ['ok', status, 'ok'] and again.cached.all()
    longer = check.check_channelslast(net, torch.randn(2, 3, 8, 8), timeout=5)
    assert list(longer.status) == ['ok', status if status == 'crashed' else 'ok', 'ok']
    assert list(longer.cached) == [True, status == 'crashed', True]

def test_check_a_valid_padded_conv_is_checked_not_an_error(cache_dir):
    "A conv with padding='valid' is checked against fp64 (its padding read as a pair each side: it raised in the check's harness, and was called wrong and guarded for good)"
    from clfast.guard import _conv_params
    assert check.conv_numerics(_conv_params(nn.Conv2d(3, 8, 3, padding='valid')), [8, 8])['status'] == 'ok'

def test_check_only_a_kernels_verdict_guards_and_half_precision_failures_compute_in_fp32(cache_dir, monkeypatch):
    """A row the check could not compute ('error': its own failure) guards nothing; a conv found wrong in bf16 runs in
    fp32 (its contiguous bf16 kernel may be as wrong: a narrow map's was, 1e31 off fp64 in training), at fp64's
    precision for fp32, bf16's in bf16"""
    from clfast.guard import _conv_params, guard_plan
    conv = nn.Conv2d(4, 6, 3, padding=1)
    cache = MachineCache(CHECK_CACHE)
    cache.update({'a': dict(status='error', conv=_conv_params(conv), precision='float32')})
    assert guard_plan(conv) is None
    cache.update({'b': dict(status='wrong', conv=_conv_params(conv), precision='bfloat16')})
    assert guard_plan(conv).workaround == 'fp32'
    net = nn.Sequential(conv).to(memory_format=torch.channels_last)
    guard_model(net)
    x = torch.randn(2, 4, 5, 5).to(memory_format=torch.channels_last)
    ref = torch.nn.functional.conv2d(x.double(), conv.weight.double(), conv.bias.double(), padding=1)
    rel = lambda a: ((a.double() - ref).norm() / ref.norm()).item()
    assert rel(net(x)) < 1e-6
    with torch.autocast('cpu', dtype=torch.bfloat16): out = net(x)
    assert out.dtype == torch.bfloat16 and rel(out) < 2e-2

@pytest.mark.isa_neutral
def test_check_child_runs_at_the_thread_count_and_caps_its_cache_key_names(cache_dir, monkeypatch):
    """The child checks at this process's thread count and instruction-set caps, which its verdicts' cache key names
    (it took torch's default count, and caps set in the environment since, which the key did not say: a kernel that
    corrupts memory on 1 thread passed at 2 and was cached for 1)"""
    from clfast.machine import isa_env
    code = ("import os, torch, clfast.check_child as c; c.conv_numerics = lambda *a: dict(status='ok', error=0.0, "
            "worst=f\"{torch.get_num_threads()} {os.environ.get('ONEDNN_MAX_CPU_ISA')}\"); c.check_worker()")
    monkeypatch.setattr(check, '_CHILD', [sys.executable, '-c', code])
    isa_env()   # read once, as at this process's first kernel
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX2')   # set since: not this process's cap
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try: table = check.check_geometries(check.conv_geometries(nn.Conv2d(3, 4, 3), torch.randn(2, 3, 6, 6)))
    finally: torch.set_num_threads(threads)
    assert list(table.worst) == [f"1 {isa_env().get('ONEDNN_MAX_CPU_ISA')}"]

@pytest.mark.isa_neutral
def test_check_child_imports_torch_alone():
    """The check's child imports clfast's numerics and torch, not fastai, pandas or timm (`clfast.check`'s imports
    doubled the child's start: 8.4 against 4.2 s on a 2-core Zen 3 VM), so the first geometry is checked sooner"""
    heavy = "{'fastai', 'fastcore', 'pandas', 'timm', 'torchvision', 'sklearn'}"
    code = f"import sys; {check._CHILD[2].split(';')[0]}; print(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy}))"
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == '[]', r.stdout + r.stderr[-2000:]

@pytest.mark.isa_neutral
@pytest.mark.parametrize('failure,why', [('import no_such_module', r"died \(exit 1: ModuleNotFoundError"),
                                         ('import time; time.sleep(600)', 'did not start within 2 s')])
def test_check_child_failing_before_any_conv_is_an_error(cache_dir, monkeypatch, failure, why):
    """A child that dies or hangs before its first case (it cannot import clfast, say) found nothing about any conv:
    an error that says so, nothing cached, nothing guarded (it used to mark every geometry 'error', cache that for
    this machine and guard every conv for good); the next check, with a working child, checks them"""
    monkeypatch.setattr(check, '_CHILD', [sys.executable, '-c', failure])
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1))
    x = torch.randn(2, 3, 8, 8)
    # (check_geometries: its start-up allowance shortened, where check_channelslast gives a child 120 s to start)
    with pytest.raises(RuntimeError, match=f"checked, cached and guarded nothing: its child process {why}"):
        check.check_geometries(check.conv_geometries(net, x), timeout=1, startup=1)
    if 'sleep' not in failure:
        with pytest.raises(RuntimeError, match='before the first conv'): check.check_channelslast(net, x)
    assert guard_report(net) == [] and not [k for k in MachineCache(CHECK_CACHE).entries() if not k.startswith('geometries')]
    monkeypatch.undo(); monkeypatch.setenv('CLFAST_CACHE_DIR', str(cache_dir))
    table = check.check_channelslast(net, x)
    assert list(table.status) == ['ok', 'ok'] and not table.cached.any()

@pytest.mark.isa_neutral
@pytest.mark.parametrize('noise', ['oneDNN verbose', 'a library writing to fd 1'])
def test_check_child_output_on_stdout_is_not_its_protocol(cache_dir, monkeypatch, noise):
    """What the child's libraries write to stdout (oneDNN with ONEDNN_VERBOSE=1 in the user's environment, a C library's
    printf) goes to its stderr: the check used to read it as its protocol and raise a JSONDecodeError, its child left
    running; it checks every geometry against fp64 instead"""
    if noise == 'oneDNN verbose': monkeypatch.setenv('ONEDNN_VERBOSE', '1')
    else:
        code = ('import os, clfast.check_child as c; f = c.conv_numerics\n'
                'c.conv_numerics = lambda *a: (os.write(1, b"noise from a library"), f(*a))[1]\nc.check_worker()')
        monkeypatch.setattr(check, '_CHILD', [sys.executable, '-c', code])
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1, stride=2))
    table = check.check_channelslast(net, torch.randn(2, 3, 8, 8), timeout=60)
    assert list(table.status) == ['ok', 'ok'] and (table.error < 1e-5).all() and not table.cached.any()

@pytest.mark.isa_neutral
def test_check_interrupted_leaves_no_child(cache_dir, monkeypatch):
    """A KeyboardInterrupt (Jupyter's interrupt reaches the kernel only) while the child runs a case kills the child: it
    used to go on, hung or computing, after the check had ended"""
    code = 'import json, sys, time\nkey = json.load(sys.stdin)[1][0][0]\nprint(json.dumps(dict(key=key, started=True)), flush=True)\ntime.sleep(600)'
    monkeypatch.setattr(check, '_CHILD', [sys.executable, '-c', code])
    procs, real_popen, real_select = [], check.subprocess.Popen, check.select.select
    def popen(*a, **k):
        procs.append(real_popen(*a, **k)); return procs[-1]
    def select(*a):
        select.calls += 1
        if select.calls == 2: raise KeyboardInterrupt   # the second wait: the child has started its case (and hangs in it)
        return real_select(*a)
    select.calls = 0
    monkeypatch.setattr(check.subprocess, 'Popen', popen)
    monkeypatch.setattr(check.select, 'select', select)
    with pytest.raises(KeyboardInterrupt):
        check.check_channelslast(nn.Sequential(nn.Conv2d(3, 8, 3)), torch.randn(2, 3, 8, 8), timeout=60)
    assert len(procs) == 1 and procs[0].poll() is not None

@pytest.mark.isa_neutral
def test_check_infinite_timeout_is_no_limit(cache_dir):
    "timeout=inf (no limit) used to raise OverflowError from select"
    table = check.check_channelslast(nn.Sequential(nn.Conv2d(3, 8, 3)), torch.randn(2, 3, 8, 8), timeout=float('inf'))
    assert list(table.status) == ['ok'] and table.error[0] < 1e-5

@pytest.mark.parametrize('fuse', [False, 'speed', 'memory'])
def test_guard_under_autocast(fuse):
    "Under CPU autocast (bf16) a guarded stem takes the subsample path too; weight gradients within bf16 rounding of fp64"
    learn = thin_stem_learner(3)
    ref = copy.deepcopy(learn.model).double()
    learn.to_channelslast(use_amp=False, fuse=fuse)
    stem = learn.model[0][0]
    stem._cl_guard = GuardPlan('subsample', True, 'test')   # whatever this CPU is
    if type(stem) is nn.Conv2d: stem.__class__ = GuardedConv2d
    x = torch.randn(4, 3, 16, 16)
    learn.model.train(); ref.train()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = learn.model(x.to(memory_format=torch.channels_last))
    out.float().sum().backward()
    ref(x.double()).sum().backward()
    torch.testing.assert_close(stem.weight.grad.double(), ref[0][0].weight.grad, rtol=5e-2, atol=5e-2)

@pytest.mark.parametrize('how', ['subsample', 'contiguous'])
def test_unbatched_input_under_every_workaround(how):
    "nn.Conv2d takes an unbatched [C, H, W] input: a guarded conv does too, in training, and gives fp64's output and gradients (subsample raised IndexError)"
    from clfast.stock import rebuilt
    torch.manual_seed(0)
    conv = rebuilt(nn.Conv2d(4, 8, 1, stride=2), GuardedConv2d).to(memory_format=CL)
    conv._cl_guard = GuardPlan(how, True, 'test')
    ref = nn.Conv2d(4, 8, 1, stride=2).double(); ref.load_state_dict(conv.state_dict())
    x = torch.randn(4, 7, 7)
    out = conv(x)
    out.pow(2).sum().backward(); ref(x.double()).pow(2).sum().backward()
    assert out.shape == (8, 4, 4)
    for a, b in ((out, ref(x.double())), (conv.weight.grad, ref.weight.grad), (conv.bias.grad, ref.bias.grad)):
        assert ((a.double() - b).abs().max() / b.abs().max()).item() < 1e-6

def test_short_input_route_computes_in_autocasts_dtype(monkeypatch):
    """Under CPU bf16 autocast the short-input route computes and returns bf16, as the stock conv does (it ran, and
    returned, fp32: aten.convolution has no autocast rule); gradients within bf16 rounding of fp64"""
    monkeypatch.setitem(timing._here, f'premise:{SHORT_INPUT_WGRAD.name}', True)
    from clfast.stock import rebuilt
    torch.manual_seed(0)
    conv = rebuilt(nn.Conv2d(512, 512, 3, padding=1), GuardedConv2d).to(memory_format=CL)
    ref = nn.Conv2d(512, 512, 3, padding=1).double(); ref.load_state_dict(conv.state_dict())
    x = torch.randn(2, 512, 2, 4).to(memory_format=CL)
    assert short_input_plan(conv, x, conv.weight) is not None
    with torch.autocast('cpu', dtype=torch.bfloat16): out = conv(x)
    out.float().pow(2).sum().backward(); ref(x.double()).pow(2).sum().backward()
    assert out.dtype == torch.bfloat16 and conv.weight.grad.dtype == torch.float32
    assert ((conv.weight.grad.double() - ref.weight.grad).norm() / ref.weight.grad.norm()).item() < 2e-2

def test_a_lazy_conv_is_guarded_once_it_has_channels():
    "A LazyConv2d not yet run has 0 input channels: no plan and no warning that it cannot be guarded; once run, a stock conv guarded as any"
    m = nn.Sequential(nn.LazyConv2d(8, 1, stride=2))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert guard_model(m) == []
    m(torch.randn(2, 3, 8, 8))
    assert (guard_model(m) != []) == _affected_here()

def test_pointwise_premise_is_measured_and_cached(tmp_path, monkeypatch):
    "The premise is the probe's measurement here (a squeeze-excite pair of convs against the products), cached per machine; only a 1x1 conv of stride 1, unpadded, one group may meet it"
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {})
    calls = []
    probe = lambda: calls.append(1) or routes.pointwise_maps_slower()
    held = routes.premise('test_slow_pointwise', probe)
    assert routes.premise('test_slow_pointwise', probe) == held and len(calls) == 1
    monkeypatch.setattr(timing, '_here', {f'premise:{routes.SLOW_POINTWISE_MAPS.name}': held})
    assert routes.may_meet_slow_pointwise(nn.Conv2d(8, 4, 1)) == held
    for other in (nn.Conv2d(8, 4, 1, stride=2), nn.Conv2d(8, 8, 1, groups=2), nn.Conv2d(8, 4, 3), nn.Conv2d(8, 4, 1, padding=1)):
        assert not routes.may_meet_slow_pointwise(other)

@pytest.mark.parametrize('caller', ['no_grad', 'inference_mode'])
def test_premises_measured_from_inference(tmp_path, monkeypatch, caller):
    """Each premise's probe, measured afresh (a fresh machine) from a caller that computes no gradients: a fastai
    validation or `get_preds` asks first where a guarded conv meets its first short input or 1x1 map, and the probes
    that time a backward failed there ('element 0 of tensors does not require grad')"""
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path)); monkeypatch.setattr(timing, '_here', {})
    with getattr(torch, caller)():
        held = {k.name: k.present() for k in guard.MEASURED_KERNELS}
    assert all(isinstance(h, bool) for h in held.values()) and set(timing.timings('premise:')) == {f'premise:{n}' for n in held}

def test_a_learner_validated_before_it_trains(tmp_path, monkeypatch):
    """`to_channelslast()` then `validate()` on a fresh machine, a squeeze-excite model: the guarded 1x1 convs meet their
    premise first under fastai's no_grad; the loss is fp64's at fp32's precision"""
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path)); monkeypatch.setattr(timing, '_here', {})
    torch.manual_seed(0)
    net = nn.Sequential(ConvLayer(3, 8), nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 4, 1), nn.ReLU(), nn.Conv2d(4, 8, 1),
                        Flatten(), nn.Linear(8, 2))
    ref = copy.deepcopy(net).double().eval()
    dls = image_dls()
    learn = Learner(dls, net, loss_func=CrossEntropyLossFlat()).to_channelslast(use_amp=False)
    loss = learn.validate()[0]
    plain = lambda t: t.as_subclass(torch.Tensor)
    with torch.no_grad():
        want = sum(F.cross_entropy(ref(plain(x).double()), plain(y), reduction='sum') for x, y in dls.valid) / len(dls.valid_ds)
    assert loss == pytest.approx(want.item(), rel=1e-5)
    assert set(timing.timings('premise:')) >= {f'premise:{routes.SLOW_POINTWISE_MAPS.name}'}   # measured, by the guard or the call

def test_flop_count_and_export_on_a_fresh_machine(tmp_path, monkeypatch):
    """A guarded model's first short input and first 1x1 map ask their premises inside the caller's modes: a flop
    counter counts the model's flops only (it counted the probes' 512-channel convs as the model's, and the timings
    its hooks slowed were cached), and `torch.export` traces it (the probes failed on export's fake tensors); the
    exported program computes fp64's output at fp32's precision"""
    def fresh(name):
        monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path/name)); monkeypatch.setattr(timing, '_here', {})
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                        nn.Conv2d(8, 4, 1), nn.ReLU(), nn.Conv2d(4, 8, 3, padding=1), Flatten()).to(memory_format=CL)
    ref = copy.deepcopy(net)
    x = torch.randn(2, 3, 8, 8).to(memory_format=CL)
    with FlopCounterMode(display=False) as stock: ref(x).sum().backward()
    fresh('flops')   # guarded as on a machine where both routes' premises hold, which are then asked again per call
    timing._here.update({f'premise:{k.name}': True for k in (SHORT_INPUT_WGRAD, routes.SLOW_POINTWISE_MAPS)})
    guard_model(net)
    assert type(net[4]) is type(net[6]) is GuardedConv2d   # the 1x1 conv, the 3x3 on 1x1 maps
    fresh('flops again')
    with FlopCounterMode(display=False) as counted: net(x).sum().backward()
    assert counted.get_total_flops() == stock.get_total_flops()
    assert set(timing.timings('premise:')) == {f'premise:{k.name}' for k in (SHORT_INPUT_WGRAD, routes.SLOW_POINTWISE_MAPS)}
    fresh('export')
    program = torch.export.export(net.eval(), (x,), strict=False)
    torch.testing.assert_close(program.module()(x).double(), ref.eval().double()(x.double()), rtol=1e-5, atol=1e-6)

def test_first_question_inside_a_gradient_checkpoint(tmp_path, monkeypatch):
    """A squeeze-excite pair's first 1x1 map inside a checkpointed block (timm's `set_grad_checkpointing`): the probe's
    saved tensors are not the block's (they were, and backward failed with a `CheckpointError`: recomputed values of
    other shapes); the gradients are fp64's at fp32's precision"""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(16, 4, 1), nn.ReLU(), nn.Conv2d(4, 16, 1)).to(memory_format=CL)
    ref = copy.deepcopy(net).double()
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path/'guard')); monkeypatch.setattr(timing, '_here', {})
    timing._here[f'premise:{routes.SLOW_POINTWISE_MAPS.name}'] = True   # guarded as where the premise holds
    guard_model(net)
    assert type(net[0]) is type(net[2]) is GuardedConv2d
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path/'fresh')); monkeypatch.setattr(timing, '_here', {})
    x = torch.randn(6, 16, 1, 1).to(memory_format=CL).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    checkpoint(net, x, use_reentrant=False).sum().backward()
    ref(x64).sum().backward()
    assert f'premise:{routes.SLOW_POINTWISE_MAPS.name}' in timing.timings('premise:')   # asked inside the block
    close = lambda a, b: torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
    close(x.grad, x64.grad)
    for got, want in zip(net.parameters(), ref.parameters()): close(got.grad, want.grad)

class _AtenOps(TorchDispatchMode):
    "Records the aten ops that run"
    def __init__(self): super().__init__(); self.seen = set()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

@pytest.mark.parametrize('held', [True, False], ids=['slow_here', 'not_slow_here'])
def test_squeeze_excite_convs_as_products_where_measured(monkeypatch, held):
    "The guard runs a 1x1 conv on 1x1 maps as one matrix product where the premise holds, else as the conv: fp64's output and gradients at fp32's precision either way; a larger map always takes the conv; unguarded (and pickled) as nn.Conv2d"
    monkeypatch.setitem(timing._here, f'premise:{routes.SLOW_POINTWISE_MAPS.name}', held)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(16, 4, 1), nn.ReLU(), nn.Conv2d(4, 16, 1), nn.Sigmoid()).to(memory_format=CL)
    ref = copy.deepcopy(net).double()
    guard_model(net)
    if held: assert type(net[0]) is type(net[2]) is GuardedConv2d
    x = torch.randn(6, 16, 1, 1).to(memory_format=CL).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    with _AtenOps() as ops: y = net(x)
    assert ('convolution' in ops.seen) != held and ('addmm' in ops.seen) == held
    y64 = ref(x64)
    dy = torch.randn(y64.shape, dtype=torch.float64)
    y.backward(dy.float()); y64.backward(dy)
    assert y.shape == y64.shape and y.dtype == torch.float32
    close = lambda a, b: torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
    close(y.detach(), y64.detach()); close(x.grad, x64.grad)
    for got, want in zip(net.parameters(), ref.parameters()): close(got.grad, want.grad)
    with _AtenOps() as ops: net(torch.randn(2, 16, 3, 3).to(memory_format=CL))
    assert 'convolution' in ops.seen and 'addmm' not in ops.seen
    assert type(pickle.loads(pickle.dumps(net))[0]) is nn.Conv2d
    unguard_model(net)
    assert type(net[0]) is type(net[2]) is nn.Conv2d

@pytest.mark.parametrize('held', [True, False], ids=['slow_here', 'not_slow_here'])
def test_fused_squeeze_excite_convs_follow_the_premise(monkeypatch, held):
    "A fused model's PointwiseConv2d takes the matrix product by the guard's rule: only where the conv measured slower here"
    from clfast.fuse.pointwise import PointwiseConv2d, to_pointwise
    monkeypatch.setitem(timing._here, f'premise:{routes.SLOW_POINTWISE_MAPS.name}', held)
    net = nn.Sequential(nn.Conv2d(16, 4, 1), nn.ReLU(), nn.Conv2d(4, 16, 1)).to(memory_format=CL)
    to_pointwise(net)
    assert type(net[0]) is type(net[2]) is PointwiseConv2d
    with _AtenOps() as ops: net(torch.randn(6, 16, 1, 1).to(memory_format=CL))
    assert ('convolution' in ops.seen) != held and ('addmm' in ops.seen) == held

def test_guard_is_for_cpu_models_only(monkeypatch):
    """A model on another device (here 'meta': no GPU on this machine) gets no guard, no precise BN and no CPU probe,
    from `guard_model` and from `to_channelslast()` for a learner whose batches go there; back on the CPU it is guarded"""
    probed = []
    monkeypatch.setattr(routes, 'premise', lambda name, probe: probed.append(name) or True)
    learn = Learner(image_dls(), nn.Sequential(ConvLayer(3, 8), ConvLayer(8, 16, stride=2), nn.AdaptiveAvgPool2d(1),
                                               Flatten(), nn.Linear(16, 2)), loss_func=CrossEntropyLossFlat())
    stock = [type(m) for m in learn.model.modules()]
    meta = copy.deepcopy(learn.model).to('meta')
    assert guard.model_device(meta).type == 'meta' and guard_model(meta) == [] and probed == []
    assert [type(m) for m in meta.modules()] == stock
    learn.dls.device = torch.device('meta')          # where fastai's before_fit will move the model
    learn.to_channelslast(amp_mode='bf16')
    assert [type(m) for m in learn.model.modules()] == stock and probed == []
    learn.dls.device = torch.device('cpu')
    learn.to_channelslast(amp_mode='bf16')
    assert probed and any(type(m) is not t for m, t in zip(learn.model.modules(), stock))   # this CPU's premises hold
    learn.model.to('meta')                           # moved: the callback decides again at the next validation
    cb = next(c for c in learn.cbs if type(c).__name__ == 'ChannelsLast')
    cb.before_validate()
    assert [type(m) for m in learn.model.modules()] == stock

def _guarded_stem_net(monkeypatch):
    """`thin_stem_learner`'s model channels-last, guarded here as where the bf16 backward and channels-last BN measured
    slow and imprecise, and with its 3x3 conv found wrong by the numerics check: a plan, routes and precise BNs on every machine"""
    from clfast.bn import PreciseBatchNorm2d
    for k in (IMPRECISE_CL_BATCH_NORM, SLOW_BF16_BACKWARD): monkeypatch.setitem(timing._here, f'premise:{k.name}', True)
    torch.manual_seed(0)
    net = thin_stem_learner(3).model.to(memory_format=CL)
    monkeypatch.setattr(guard, '_checked_failures', lambda: [guard._conv_params(net[1][0])])
    report = guard_model(net)
    assert type(net[1][0]) is GuardedConv2d and type(net[0][1]) is type(net[1][1]) is PreciseBatchNorm2d
    assert '1.0' in [n for n, *_ in report] and guard_report(net) == report
    return net, report

def _ids(net): return [id(m) for m in net.modules()]
def _clfast_types(net): return [type(m) for m in net.modules() if type(m).__module__.startswith('clfast')]

def test_guard_follows_the_device_and_leaves_a_guarded_model_as_it_is(monkeypatch):
    """Guarded on the CPU, then for another device ('meta': no GPU here): every module stock, as `unguard_model` leaves
    it; back on the CPU: guarded as before, computing the same output and gradients; guarded again for the CPU, it
    keeps every module object (each guarded conv and precise BN was unguarded and guarded anew, a new object)"""
    net, report = _guarded_stem_net(monkeypatch)
    types = [type(m) for m in net.modules()]
    x = torch.randn(4, 3, 16, 16).to(memory_format=CL)
    def run():
        net.zero_grad(); xi = x.clone().requires_grad_()
        y = net(xi); y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        return [y.detach(), xi.grad] + [p.grad.clone() for p in net.parameters()]
    before = run()
    assert guard_model(net, 'meta') == [] and guard_report(net) == [] and _clfast_types(net) == []
    stock = _ids(net)
    assert guard_model(net, torch.device('meta')) == [] and _ids(net) == stock
    assert guard_model(net, 'cpu') == report and [type(m) for m in net.modules()] == types
    for got, want in zip(run(), before): torch.testing.assert_close(got, want)
    guarded = _ids(net)
    assert guard_model(net) == report and guard_model(net, 'cpu') == report and _ids(net) == guarded

def test_guard_changes_only_the_modules_whose_state_differs(monkeypatch):
    """Where a premise changes between two guards (the BN one measured or forgotten, the numerics check's findings),
    only the modules it decides change: the BNs turn stock and precise again while every conv stays the same object;
    a conv found wrong later gets its plan in place"""
    from clfast.bn import PreciseBatchNorm2d
    net, report = _guarded_stem_net(monkeypatch)
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    monkeypatch.setitem(timing._here, f'premise:{IMPRECISE_CL_BATCH_NORM.name}', False)
    assert guard_model(net) == report and type(net[0][1]) is type(net[1][1]) is nn.BatchNorm2d
    assert [m for m in net.modules() if isinstance(m, nn.Conv2d)] == convs   # (nn.Module compares by identity)
    monkeypatch.setitem(timing._here, f'premise:{IMPRECISE_CL_BATCH_NORM.name}', True)
    guard_model(net)
    assert type(net[0][1]) is type(net[1][1]) is PreciseBatchNorm2d
    bns = [net[0][1], net[1][1]]
    monkeypatch.setattr(guard, '_checked_failures', lambda: [])   # the check's findings forgotten: the 3x3 conv routed per call only
    assert '1.0' not in [n for n, *_ in guard_model(net)] and net[1][0]._cl_guard is None
    assert [m for m in net.modules() if isinstance(m, nn.Conv2d)] == convs and [net[0][1], net[1][1]] == bns

def test_symbolic_trace_of_guarded_and_pointwise_convs(tmp_path, monkeypatch):
    """torch.fx's symbolic trace (torchvision's `create_feature_extractor`) of a model with guarded convs and a fused
    model's `PointwiseConv2d`: each records the stock conv (a plan and a route are chosen per call from sizes and a
    layout a Proxy does not have), and the graph computes what the model computes, output and gradients against
    float64 (before: TraceError, the route check testing the Proxy's size)"""
    from clfast.fuse.pointwise import PointwiseConv2d, to_pointwise
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path)); monkeypatch.setattr(timing, '_here', {})
    timing._here.update({f'premise:{k.name}': True for k in (SHORT_INPUT_WGRAD, routes.SLOW_POINTWISE_MAPS)})
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 4, 1), nn.ReLU(),
                        nn.Conv2d(4, 8, 3, padding=1), Flatten())
    ref = copy.deepcopy(net).double()
    pointwise = copy.deepcopy(net)
    guard_model(net)
    assert type(net[3]) is type(net[5]) is GuardedConv2d
    assert to_pointwise(pointwise) == ['3'] and type(pointwise[3]) is PointwiseConv2d
    x = torch.randn(2, 3, 8, 8).to(memory_format=CL)
    for m in (net, pointwise):
        traced = torch.fx.symbolic_trace(m)
        xa, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
        out, want = traced(xa), ref(x64)
        out.sum().backward(); want.sum().backward()
        close = lambda a, b: torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
        close(out, want); close(xa.grad, x64.grad)
        for got, p in zip(m.parameters(), ref.parameters()): close(got.grad, p.grad)
        for p in [*m.parameters(), *ref.parameters()]: p.grad = None

# --- transposed convs (routes.GuardedConvTranspose2d) ------------------------------------------------------------------

def test_transposed_premise_and_guard(tmp_path, monkeypatch):
    "The half-precision premise is its probe's answer here, cached per machine; `guard_model` makes exactly the transposed convs that can meet a routed class `GuardedConvTranspose2d`s over the same state, pickling as the stock class; `unguard_model` undoes it; a model off the CPU stays stock"
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(timing, '_here', {})
    held = {dt: k.present() for dt, k in routes.TRANSPOSED_HALF_WEIGHT_GRAD_WRONG.items()}
    for dt, k in routes.TRANSPOSED_HALF_WEIGHT_GRAD_WRONG.items():
        assert timing.timings()[f'premise:{k.name}'] == held[dt] == routes.half_conv_wrong(dt, routes.TRANSPOSED_WEIGHT_GRAD_CASES, True, transposed=True)
    block = KNOWN_BAD_KERNELS[0].channel_block.get(onednn_isa())
    net = nn.Sequential(nn.ConvTranspose2d(16, 9, 1, stride=2, output_padding=1),     # the 1x1 class (where oneDNN's ISA has a block)
                        nn.ConvTranspose2d(9, 8, 4, stride=2, padding=1),            # may be narrow: half-precision premise
                        nn.ConvTranspose2d(8, 8, 3, padding=1, dilation=2),          # dilated: the same
                        nn.ConvTranspose2d(8, 16, 1, stride=2, output_padding=1),    # 16 output channels: no block that small
                        nn.ConvTranspose2d(16, 4, 3, padding=1))                     # stride 1, undilated: stock
    params, keys = list(net.parameters()), list(net.state_dict())
    guard_model(net)
    half = any(held.values())
    want = [block is not None and 9 < block, half, half, False, False]
    assert [type(m) is routes.GuardedConvTranspose2d for m in net] == want
    assert all(type(m) in (nn.ConvTranspose2d, routes.GuardedConvTranspose2d) for m in net)
    assert list(net.parameters()) == params and list(net.state_dict()) == keys
    assert all(type(m) is nn.ConvTranspose2d for m in pickle.loads(pickle.dumps(net)))
    unguard_model(net)
    assert all(type(m) is nn.ConvTranspose2d for m in net) and list(net.parameters()) == params
    assert guard_model(nn.Sequential(nn.ConvTranspose2d(16, 9, 1, stride=2)), device='meta') == []

def _transposed_step_error(conv, x, dtype=None, output_size=None):
    "The worst relative error of `guard_model`'s module for `conv` in a channels-last training step (under `dtype`'s CPU autocast) against fp64's on the same rounded inputs, output and every gradient"
    net = nn.Sequential(conv).to(memory_format=torch.channels_last)
    guard_model(net)
    x = (x.to(memory_format=torch.channels_last) if x.dim() == 4 else x).requires_grad_()
    with torch.autocast('cpu', dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        y = net[0](x, output_size)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
    y.backward(dy)
    # (contiguous: the fp64 stock conv of channels-last tensors reaches the same kernels)
    rounded = lambda t: t.detach().to(y.dtype).to(torch.float64, memory_format=torch.contiguous_format).requires_grad_()
    x64, w64, b64 = map(rounded, (x, conv.weight, conv.bias))
    y64 = F.conv_transpose2d(x64, w64, b64, conv.stride, conv.padding, net[0]._output_padding(x, output_size, conv.stride,
                             conv.padding, conv.kernel_size, 2, conv.dilation), conv.groups, conv.dilation)
    y64.backward(dy.double())
    assert y.dtype == (dtype or torch.float32) and (x.dim() == 3 or y.is_contiguous(memory_format=torch.channels_last))
    return max(((a.double() - b).abs().max() / b.abs().max()).item()
               for a, b in ((y, y64), (x.grad, x64.grad), (net[0].weight.grad, w64.grad), (net[0].bias.grad, b64.grad)))

TRANSPOSED_CASES = {   # name: (module, input shape, autocast dtype, output_size)
    '1x1-fp32': (lambda: nn.ConvTranspose2d(16, 9, 1, stride=3, output_padding=2), (3, 16, 8, 8), None, None),
    '1x1-bf16': (lambda: nn.ConvTranspose2d(16, 9, 1, stride=3, output_padding=2), (3, 16, 8, 8), torch.bfloat16, None),
    '1x1-output_size': (lambda: nn.ConvTranspose2d(3, 2, 1, stride=2), (2, 3, 5, 7), None, [10, 14]),
    '1x1-unbatched': (lambda: nn.ConvTranspose2d(16, 7, 1, stride=2), (16, 9, 4), None, [18, 8]),
    '1x1-dilated-bf16': (lambda: nn.ConvTranspose2d(37, 3, 1, stride=(2, 1), output_padding=(1, 0), dilation=2), (2, 37, 12, 5), torch.bfloat16, None),
    'narrow-bf16': (lambda: nn.ConvTranspose2d(16, 16, (2, 4), stride=2, padding=(1, 2), output_padding=(0, 1)), (4, 16, 23, 1), torch.bfloat16, None),
    'dilated-bf16': (lambda: nn.ConvTranspose2d(26, 52, (2, 4), padding=(1, 2), groups=26, dilation=2), (2, 26, 40, 39), torch.bfloat16, None),
}

@pytest.mark.parametrize('case', list(TRANSPOSED_CASES))
def test_transposed_classes_against_fp64(case):
    "Each class the sweep found (the 1x1 class aborted the process or was off 20-40%; the half-precision weight gradient up to inf) in a guarded channels-last training step: output and gradients at the precision's error against fp64"
    make, shape, dtype, output_size = TRANSPOSED_CASES[case]
    torch.manual_seed(0)
    err = _transposed_step_error(make(), torch.randn(shape), dtype, output_size)
    assert err < (2**-6 if dtype else 1e-5), err

def test_a_compiled_guarded_transposed_conv_takes_its_route():
    """torch.compile of a guarded model runs a transposed conv's route, as eager calls do: its trace ran the stock conv,
    and inductor's graph reached the same oneDNN weight-gradient kernel (off fp64 by 40-90% at AVX2, in three steps
    alike; in this class it can also hang or end the process, hence a child process). inductor, the default backend"""
    code = """if True:
        import torch, torch.nn.functional as F
        from torch import nn
        from clfast.guard import guard_model
        torch.manual_seed(0)
        conv = nn.ConvTranspose2d(16, 3, 1, stride=2, output_padding=1)
        net = nn.Sequential(conv).to(memory_format=torch.channels_last)
        guard_model(net)
        compiled = torch.compile(net)
        x = torch.randn(4, 16, 9, 7).to(memory_format=torch.channels_last)
        worst = 0
        for _ in range(2):
            net.zero_grad()
            y = compiled(x); dy = torch.randn_like(y); y.backward(dy)
            w64 = conv.weight.detach().double().requires_grad_()
            F.conv_transpose2d(x.double(), w64, conv.bias.double(), 2, 0, 1).backward(dy.double())
            worst = max(worst, ((conv.weight.grad.double() - w64.grad).norm() / w64.grad.norm()).item())
        print(type(net[0]).__name__, worst)
    """
    r = preloaded.run([sys.executable, '-c', code], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    kind, err = r.stdout.split()[-2:]
    assert kind == ('GuardedConvTranspose2d' if routes.one_by_one_wgrad_class(nn.ConvTranspose2d(16, 3, 1, stride=2))
                    else 'ConvTranspose2d'), kind
    assert float(err) < 1e-5, err

def test_an_unguardable_transposed_conv_warns():
    """A transposed conv of a subclass in a class routed here cannot be guarded: the warning says what to do, as for a
    Conv2d's subclass (it was left to the stock kernel, off fp64 by 90% in the 1x1 class, saying nothing)"""
    class MyUp(nn.ConvTranspose2d): pass
    one_by_one = MyUp(16, 3, 1, stride=2, output_padding=1)
    for conv, routed in ((one_by_one, routes.one_by_one_wgrad_class(one_by_one)), (MyUp(16, 16, 3, padding=1), False)):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            guard_model(nn.Sequential(conv))
        said = [str(x.message) for x in w if 'cannot guard them' in str(x.message)]
        assert len(said) == routed and type(conv) is MyUp, said
        if said: assert '0 (MyUp)' in said[0] and 'to_contiguous' in said[0], said

def test_a_transposed_upsampling_learner_trains_as_fp64():
    """A fastai Learner whose model upsamples with a 1x1 stride-2 transposed conv onto 3 channels (the class that aborted
    the process, in fp32 as in bf16), `to_channelslast` and a fit: the first step's gradients are fp64's of the same
    batch. In fp32, not the default mixed precision: bf16's own error through this model's BNs of 12 samples of 4x4
    maps is 3-11% of a gradient in either layout, routed or stock, which would hide a wrong route; the route's bf16
    numerics are `test_transposed_classes_against_fp64`'s"""
    torch.manual_seed(0)
    net = nn.Sequential(ConvLayer(3, 8, stride=2), nn.ConvTranspose2d(8, 3, 1, stride=2, output_padding=1), nn.ReLU(),
                        ConvLayer(3, 8), nn.AdaptiveAvgPool2d(1), Flatten(), nn.Linear(8, 2))
    learn = Learner(image_dls(size=8), net, loss_func=CrossEntropyLossFlat(), opt_func=Adam)
    ref = copy.deepcopy(learn.model).double()
    learn.to_channelslast(use_amp=False)
    cb = _FirstGrads()
    learn.fit(1, lr=1e-3, cbs=cb)
    assert type(learn.model[1]) is (routes.GuardedConvTranspose2d if routes.one_by_one_wgrad_class(learn.model[1])
                                     or routes.may_meet_transposed_route(learn.model[1]) else nn.ConvTranspose2d)
    xb, yb = cb.batch
    ref.train()
    learn.loss_func(ref(xb.double().contiguous()), yb).backward()
    for n, p64 in ref.named_parameters():
        if p64.grad.norm() < 1e-10: continue
        err = ((cb.grads[n].double() - p64.grad).norm() / p64.grad.norm()).item()
        assert err < 1e-4, f"{n}: {err:.3g}"
