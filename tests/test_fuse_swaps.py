"""A fused model's modules swapped after fusing, synchronized by a converter bound before fusing, or hooked: each computes
as the stock model does, checked against the stock model in float64"""
import copy, subprocess, sys, warnings
import pytest, torch, torchvision
from torch import nn
from timm.layers import freeze_batch_norm_2d
from fastai.callback.hook import ActivationStats
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from clfast.core import ClfastWarning
from clfast.fuse import fuse_conv_bn, unfuse_conv_bn, fusion_report
import clfast.callback   # noqa: F401 (Learner.to_channelslast)

def _max_diff(model, stock, x, train=True):
    "The largest difference of `model(x)` from the float64 `stock(x)`, in training or eval mode"
    model.train(train); stock.train(train)
    with torch.no_grad(): return (model(x).double() - stock.double()(x.double())).abs().max().item()

def _busy_stats(m):
    "Running statistics far from a fresh BN's, so that eval mode shows a BN applied twice or not at all"
    with torch.no_grad():
        for b in m.modules():
            if isinstance(b, nn.BatchNorm2d): b.running_mean.uniform_(-1, 1); b.running_var.uniform_(0.5, 2)
    return m

def _chain():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

X = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))

@pytest.mark.parametrize('model', ['resnet18', 'chain'])
def test_bn_frozen_after_fusing(model):
    "timm's freeze_batch_norm_2d after fusing: each fused layer runs its conv, then the FrozenBatchNorm2d (once, not twice)"
    torch.manual_seed(0)
    m = _busy_stats(torchvision.models.resnet18(num_classes=10) if model == 'resnet18' else _chain())
    stock = freeze_batch_norm_2d(copy.deepcopy(m))
    fuse_conv_bn(m)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        m = freeze_batch_norm_2d(m)
    assert len([w for w in said if w.category is ClfastWarning and 'FrozenBatchNorm2d' in str(w.message)]) <= 1
    for train in (True, False): assert _max_diff(m, stock, X, train) < 1e-4

def test_activation_and_conv_swapped_after_fusing():
    torch.manual_seed(0)
    m = fuse_conv_bn(_busy_stats(_chain()))
    with pytest.warns(ClfastWarning, match=r"a SiLU was put in place of Sequential\.2.*now runs unfused"):
        m[2] = nn.SiLU()
    m[3] = nn.Conv2d(8, 8, 1)
    stock = unfuse_conv_bn(copy.deepcopy(m))
    assert [type(a) for a in stock] == [nn.Conv2d, nn.BatchNorm2d, nn.SiLU, nn.Conv2d, nn.BatchNorm2d, nn.ReLU]
    for train in (True, False): assert _max_diff(m, stock, X, train) < 1e-4

def test_weight_norm_added_after_fusing():
    """A parametrization added to a fused conv (`parametrizations.weight_norm`): the model computes as the stock one so
    parametrized, unfuses into torch's parametrized Conv2d over the same parameters (an optimizer's keep their state),
    and refuses to pickle as the stock one does, saying why (the unfuse raised and left a Conv2d without a weight)"""
    import pickle
    from torch.nn.utils import parametrizations
    torch.manual_seed(0)
    stock = _busy_stats(_chain())
    m = fuse_conv_bn(copy.deepcopy(stock))
    for model in (m, stock): parametrizations.weight_norm(model[0])
    for train in (True, False): assert _max_diff(m, stock, X, train) < 1e-4
    params = list(m.parameters())
    for model in (m, stock):
        with pytest.raises(RuntimeError, match="Serialization of parametrized modules is only supported through state_dict"):
            pickle.dumps(model)
    unfuse_conv_bn(m)
    assert type(m[0]).__name__ == 'ParametrizedConv2d' and type(m[0]).__bases__ == (nn.Conv2d,)
    after = list(m.parameters())
    assert len(after) == len(params) and all(a is b for a, b in zip(after, params))
    for train in (True, False): assert _max_diff(m, stock, X, train) < 1e-4

def test_block_activation_swapped_after_fusing():
    "A fused block never calls its activation module: one put in its place makes it run its stock forward"
    torch.manual_seed(0)
    m = fuse_conv_bn(_busy_stats(torchvision.models.resnet18(num_classes=10)))
    m.layer1[0].relu = nn.SiLU()
    assert m.layer1[0].opened and m.layer1[1].opened is None
    assert fusion_report(m).opened == [('layer1.0', "SiLU put in place of its ReLU ('relu')")]
    stock = unfuse_conv_bn(copy.deepcopy(m))
    for train in (True, False): assert _max_diff(m, stock, X, train) < 1e-4

def test_timm_bn_act_swapped_after_fusing():
    "timm's BatchNormAct2d carries its activation: one swapped inside the fused BN opens its chain"
    timm = pytest.importorskip('timm')
    torch.manual_seed(0)
    m = fuse_conv_bn(_busy_stats(timm.create_model('efficientnet_b0', num_classes=10)))
    m.bn1.act = nn.ReLU()
    m.blocks[1][0].bn1.act = nn.Tanh()   # inside a fused InvertedResidual block
    stock = unfuse_conv_bn(copy.deepcopy(m))
    # training: the stock model in fp32 is itself 1e-3 from fp64 here (deep; the last maps 1x1, 4 values per channel)
    for train, tol in ((True, 5e-3), (False, 1e-4)): assert _max_diff(m, stock, X, train) < tol

def test_hooks_see_the_stock_modules_work():
    """A forward hook on a fused BN sees the BN's own output (not the fused layer's, after the activation); the hooked
    chain runs unfused while the hook is there, fused again once it is removed"""
    torch.manual_seed(0)
    m = _busy_stats(torchvision.models.resnet18(num_classes=10))
    stock = copy.deepcopy(m).double()
    fuse_conv_bn(m)
    seen = {}
    def keep(name): return lambda mod, args, out: seen.__setitem__(name, out.detach().clone())
    hooks = [m.layer2[0].bn1.register_forward_hook(keep('block')), m.bn1.register_forward_hook(keep('stem')),
             stock.layer2[0].bn1.register_forward_hook(keep('block64')), stock.bn1.register_forward_hook(keep('stem64'))]
    stock.relu.inplace = False   # (torchvision's in-place ReLU would change the hooked tensor after the hook)
    for train in (True, False): assert _max_diff(m, stock, X, train) < 1e-4
    for k in ('block', 'stem'):
        assert seen[k].min() < 0   # before the ReLU
        assert (seen[k].double() - seen[k + '64']).abs().max() < 1e-4
    r = fusion_report(m)   # the pass fused them; the report says they run unfused while hooked
    assert 'conv1' in dict(r.fused) and r.hooked == ['conv1', 'layer2.0', 'layer2.0.conv1'], r.hooked
    assert 'hooked  layer2.0: runs as its stock modules' in repr(r)
    for h in hooks: h.remove()
    assert not m.conv1.runs_unfused() and not m.layer2[0].runs_unfused()
    assert fusion_report(m).hooked == []
    with torch.no_grad():   # a pass-through again: its chain's own output passes; any other tensor it normalizes (eval)
        y = m.conv1(X.to(memory_format=torch.channels_last))
        assert m.bn1(y) is y
        t, bn = torch.randn(2, 64, 4, 4), m.bn1
        want = torch.nn.functional.batch_norm(t, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0., bn.eps)
        assert torch.allclose(bn(t), want, atol=1e-6)

def test_global_hooks_see_the_stock_modules_work():
    """A hook every module runs (`register_module_forward_hook` / `register_module_full_backward_hook`) saw a fused
    conv's output normalized and activated, and its gradient as the fused output's: while one is registered, every
    chain runs as its stock modules (against fp64's conv output and gradient), fused again once it is removed"""
    torch.manual_seed(0)
    m = _busy_stats(nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3), nn.BatchNorm2d(8),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)))
    # (not torchvision's resnets: they add in place, which a full backward hook refuses, stock too)
    stock = copy.deepcopy(m).double()
    fuse_conv_bn(m)
    assert 'Fused' in type(m[0]).__name__
    seen = {}
    def keep(mod, args, out):
        if mod is m[0] or mod is stock[0]: seen[mod is m[0]] = out.detach().clone()
    def keep_grad(mod, grad_in, grad_out):
        if mod is m[0] or mod is stock[0]: seen[('grad', mod is m[0])] = grad_out[0].detach().clone()
    hooks = [torch.nn.modules.module.register_module_forward_hook(keep),
             torch.nn.modules.module.register_module_full_backward_hook(keep_grad)]
    try:
        for model in (m, stock):
            x = X.clone().to(next(model.parameters()).dtype).requires_grad_()
            model.train()(x).square().mean().backward()
    finally:
        for h in hooks: h.remove()
    scale = seen[False].abs().max()
    assert (seen[True].double() - seen[False]).abs().max() < 1e-5 * scale
    gscale = seen[('grad', False)].abs().max()
    assert (seen[('grad', True)].double() - seen[('grad', False)]).abs().max() < 1e-3 * gscale
    assert not m[0].runs_unfused()

def _learner(model, n=8):
    "A Learner over one batch of `n` images and labels (train and valid), recording fastai's ActivationStats"
    g = torch.Generator().manual_seed(1)
    ds = list(zip(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)))
    return Learner(DataLoaders.from_dsets(ds, ds, bs=n, device='cpu'), model, loss_func=nn.CrossEntropyLoss(),
                   cbs=ActivationStats())

def test_activation_stats_of_a_fused_learner():
    """fastai's ActivationStats on a learner fused by `to_channelslast(fuse=...)` records the stock modules'
    activations: those of the stock model's convs, BNs and linear layer (fastai's `has_params` modules) in float64"""
    torch.manual_seed(0)
    m = torchvision.models.resnet18(num_classes=10)
    stock, want = copy.deepcopy(m).double().train(), []
    layers = [l for l in stock.modules() if not list(l.children()) and list(l.parameters())]
    for l in layers: l.register_forward_hook(lambda mod, args, o: want.append((o.mean().item(), o.std().item())))
    learn = _learner(m).to_channelslast(use_amp=False, fuse='speed')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', ClfastWarning)
        learn.fit(1, lr=0.)
    assert fusion_report(learn.model).fused
    stock(learn.dls.train.one_batch()[0].double())
    got = learn.activation_stats.stats[0]
    assert len(got) == len(want) == 41   # 20 convs, 20 BNs, the head's linear layer
    for g, (mean, std) in zip(got, want):
        assert abs(g['mean'] - mean) < 1e-4 * (1 + abs(mean)) and abs(g['std'] - std) < 1e-4 * (1 + std)

ONE_LINER = r"""
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group('gloo', init_method='file://{init}', rank=0, world_size=1)
from clfast.fuse import fuse_conv_bn
torch.manual_seed(0)
m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
with torch.no_grad(): m[1].running_var.fill_(4.); m[4].running_mean.fill_(1.)
stock = [__import__('copy').deepcopy(m).double()]
m = nn.SyncBatchNorm.convert_sync_batchnorm(fuse_conv_bn(m))   # PyTorch's converter, taken before fuse_conv_bn installs clfast's
x = torch.randn(4, 3, 8, 8)
for train in (True, False):
    m.train(train); stock[0].train(train)
    with torch.no_grad(): print(float((m(x).double() - stock[0](x.double())).abs().max()))
assert all(any(c._fused_bn is b for b in m.modules()) for c in m.modules() if '_fused_bn' in c.__dict__)
dist.destroy_process_group()
"""

def test_pytorchs_converter_bound_before_fusing(tmp_path):
    """`nn.SyncBatchNorm.convert_sync_batchnorm(fuse_conv_bn(m))` takes PyTorch's own converter (installed before
    clfast's): the root's children still convert by clfast's, and each fused conv runs the synchronized BN, so eval
    mode reaches it. In a fresh process: in this one clfast's converter is installed by earlier tests"""
    r = subprocess.run([sys.executable, '-c', ONE_LINER.format(init=tmp_path/'init')], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    diffs = [float(l) for l in r.stdout.split()]
    assert len(diffs) == 2 and max(diffs) < 1e-5, diffs

def _timm_net():
    import timm.layers
    return nn.Sequential(timm.layers.ConvNormAct(3, 8, 3, act_layer=nn.SiLU),
                         timm.layers.MixedConv2d(8, 12, [3, 5], padding=''), nn.BatchNorm2d(12), nn.ReLU())

@pytest.mark.parametrize('model', ['resnet18', 'timm'])
def test_dataparallel_copies_compute_as_the_stock_model(model, monkeypatch):
    """`nn.DataParallel` (fastai's `learn.to_parallel()`) copies a fused model onto each GPU at every step with torch's
    `replicate`: each copy computes as the stock model with that copy's parameters and statistics (before: a copy's
    fused convs read the original's BNs, max error 0.85-22), said once, and the original stays fused (before: filling
    the copies' children opened every original chain for good). No two GPUs here: torch's `replicate` runs as it is,
    save for its CUDA broadcast of the tensors, which here hands copy j the tensors scaled by 1 + j/4 (so that a read of
    the original's shows)"""
    import clfast.fused, sys
    replicate = sys.modules['torch.nn.parallel.replicate']
    monkeypatch.setattr(replicate, '_broadcast_coalesced_reshape', lambda tensors, devices, detach=False: [
        [(t.detach() * (1 + j / 4)).requires_grad_(t.requires_grad) for t in tensors] for j in range(len(devices))])
    monkeypatch.setattr(clfast.fused, '_replicas_said', False)
    torch.manual_seed(0)
    m = _busy_stats(torchvision.models.resnet18(num_classes=10) if model == 'resnet18' else _timm_net()).double()
    stock = copy.deepcopy(m)
    fuse_conv_bn(m)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        copies = replicate.replicate(m, [0, 1])
        replicate.replicate(m, [0, 1])
    assert [str(w.message).split(':')[1] for w in said] == [" nn.DataParallel (`learn.to_parallel()`) runs each GPU's copy of a fused model unfused, as its stock modules"]
    assert fusion_report(m).opened == [] and not any(c.runs_unfused() for c in m.modules() if hasattr(c, 'runs_unfused'))
    x = X.double()
    for j, c in enumerate(copies):
        want = copy.deepcopy(stock)
        with torch.no_grad():
            for t in [*want.parameters(), *want.buffers()]:
                if t.is_floating_point(): t.mul_(1 + j / 4)
        for train in (True, False): assert _max_diff(c, want, x, train) < 1e-10, (j, train)
    assert _max_diff(m, stock, x, False) < 1e-10   # the original, fused, as it was

def _leaky_block(kind):
    "A small net whose activations are LeakyReLU (or GELU) modules, in each place a fused chain can take its activation from"
    import timm.layers, timm.models.resnet
    from fastai.layers import ResBlock
    stem = [nn.Conv2d(3, 8, 1)]
    if kind == 'pass-through': return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.LeakyReLU(0.01))
    if kind == 'gelu': return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.GELU())
    if kind == 'timm bn act': return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), timm.layers.BatchNormAct2d(8, act_layer=nn.LeakyReLU))
    if kind == 'timm mixed':
        return nn.Sequential(*stem, timm.layers.MixedConv2d(8, 12, [3, 5], padding=''), timm.layers.BatchNormAct2d(12, act_layer=nn.LeakyReLU))
    if kind == 'torchvision block':
        b = torchvision.models.resnet.BasicBlock(8, 8)
        b.relu = nn.LeakyReLU(0.01)
        return nn.Sequential(*stem, b)
    if kind == 'timm block': return nn.Sequential(*stem, timm.models.resnet.BasicBlock(8, 8, act_layer=nn.LeakyReLU))
    if kind == 'fastai block': return nn.Sequential(*stem, ResBlock(1, 8, 8, act_cls=nn.LeakyReLU))

_SETTINGS = {'pass-through': [(lambda m: m[2], 'negative_slope', 0.3), (lambda m: m[2], 'negative_slope', -0.2)],
             'gelu': [(lambda m: m[2], 'approximate', 'tanh')],
             'timm bn act': [(lambda m: m[1].act, 'negative_slope', 0.3)],
             'timm mixed': [(lambda m: m[2].act, 'negative_slope', 0.3)],
             'torchvision block': [(lambda m: m[1].relu, 'negative_slope', 0.3)],
             'timm block': [(lambda m: m[1].act1, 'negative_slope', 0.3), (lambda m: m[1].act2, 'negative_slope', 0.2)],
             'fastai block': [(lambda m: m[1].act, 'negative_slope', 0.3), (lambda m: m[1].convpath[0][2], 'negative_slope', 0.2)]}

@pytest.mark.usefixtures('fused_way')
@pytest.mark.parametrize('mode', ['speed', 'memory'])
@pytest.mark.parametrize('kind', list(_SETTINGS))
def test_activation_setting_changed_after_fusing(kind, mode):
    """A setting assigned to an activation after fusing (a LeakyReLU's `negative_slope`, a GELU's `approximate`) reaches
    the fused layers that compute it, which stay fused: the model computes as the stock model with the changed setting,
    checked in float64 (before: the fused layers kept the setting they were fused with, output 0.3-1.5 off). Each place
    a chain takes its activation from: a pass-through registered after the BN, timm's BN's `act` (a plain and a mixed
    conv), a fused block's activation (torchvision, timm, fastai)"""
    torch.manual_seed(0)
    m = _busy_stats(_leaky_block(kind))
    stock = copy.deepcopy(m).double()
    fuse_conv_bn(m, mode)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    for where, name, value in _SETTINGS[kind]:
        for mod in (m, stock): setattr(where(mod), name, value)
        for train in (True, False):
            m.train(train); stock.train(train)
            xa, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
            out, want = m(xa), stock(x64)
            g = torch.randn_like(want)
            out.backward(g.float()); want.backward(g)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(xa.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
            # gradients relative to their own size, floored at 1e-3 of the largest (a conv bias before a BN has 0 + rounding)
            big = max(p.grad.norm().item() for p in stock.parameters())
            for (n, p), q in zip(stock.named_parameters(), m.parameters()):
                assert (q.grad.double() - p.grad).norm() <= 1e-4 * max(p.grad.norm().item(), 1e-3 * big), (n, train)
                p.grad = q.grad = None
    assert fusion_report(m).opened == [] and not any(c.runs_unfused() for c in m.modules() if hasattr(c, 'runs_unfused'))
    assert pickle_types(m) == [type(c) for c in stock.modules()]   # the watched activations pickle as their stock classes
    unfuse_conv_bn(m)
    assert [type(c) for c in m.modules()] == [type(c) for c in stock.modules()]

def pickle_types(m):
    import pickle
    return [type(c) for c in pickle.loads(pickle.dumps(m)).modules()]

def test_activation_set_to_one_the_fused_op_lacks():
    "An activation set to one the fused op does not compute opens its layer, said once: it then computes as the stock modules (here: GELU's own error)"
    m = fuse_conv_bn(_leaky_block('gelu'))
    with pytest.warns(ClfastWarning, match="a GELU of a layer `fuse_conv_bn` fused was set to an activation the fused op does not compute"):
        m[2].approximate = 'sigmoid'
    assert fusion_report(m).opened == [('0', 'its GELU was set to an activation the fused op does not compute')]
    with pytest.raises(RuntimeError, match='approximate argument must be either none or tanh'): m(torch.randn(2, 3, 8, 8))
    m[2].approximate = 'tanh'   # runs unfused for good: the GELU's own work
    stock = unfuse_conv_bn(copy.deepcopy(m)).double()
    x = torch.randn(2, 3, 8, 8)
    for train in (True, False): assert _max_diff(m, stock, x, train) < 1e-5

_FOLDED_AT = {'timm bn act': lambda m: m[1]}   # folded: the BN's place holds its activation, as a pass-through

@pytest.mark.parametrize('kind', [k for k in _SETTINGS if k != 'gelu'] + ['relu6 max_val'])
def test_activation_setting_changed_after_folding(kind):
    """A setting assigned to an activation after `fold_conv_bn` reaches the folded convs that apply it (their oneDNN
    plans made again), or, one they cannot apply (a ReLU6's `max_val`), is applied by the module itself: the folded
    model computes as the stock model with the changed setting, in float64 (before: the folded convs kept the setting
    they were folded with, 0.99 off)"""
    from clfast.fuse import fold_conv_bn
    torch.manual_seed(0)
    if kind == 'relu6 max_val':
        m, settings = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6()), [(lambda m: m[2], 'max_val', 0.5)]
    else: m, settings = _leaky_block(kind), _SETTINGS[kind]
    m = _busy_stats(m).eval()
    stock, folded = copy.deepcopy(m).double(), fold_conv_bn(m)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    with torch.no_grad(): folded(x)   # oneDNN's plan made with the setting folded
    for where, name, value in settings:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', ClfastWarning)   # (the ReLU6 the folded op cannot apply: said once)
            setattr(_FOLDED_AT.get(kind, where)(folded), name, value)
        setattr(where(stock), name, value)
        with torch.no_grad(): out, want = folded(x), stock(x.double())
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    # it pickles as importable stock classes (fastai alone loads it): the pass-through in the BN's place too
    assert all(getattr(sys.modules[t.__module__], t.__name__, None) is t for t in pickle_types(folded)), pickle_types(folded)
