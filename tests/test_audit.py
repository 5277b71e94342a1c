"Tests of the channels-last audit: events found with the right module and phase, no false positives, no leftovers."
import warnings
import matplotlib; matplotlib.use('Agg')
import pytest, torch, timm, torchvision
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from fastai.vision.all import DataLoaders, vision_learner, CrossEntropyLossFlat, resnet18, Callback
from clfast.core import model_to, to_channels_last, is_channels_last
from clfast.audit import audit, ChannelsLastReport, ChannelsLastAudit, ChannelsLastError

COLS = ['module', 'op', 'phase', 'kind', 'shape', 'dtype', 'bytes']

def cl_audit(model, size=16, bs=2, c=3, **kwargs):
    "Audit `model` put in channels-last on a channels-last random batch"
    return audit(model_to(model), to_channels_last(torch.randn(bs, c, size, size)), **kwargs)

def rows(r): return list(r.events[['module', 'op', 'phase', 'kind']].itertuples(index=False, name=None))

class Wrap(nn.Module):
    "A conv then `body` (to check qualified names) and an optional functional `tail`"
    def __init__(self, body, tail=None, c=8):
        super().__init__()
        self.conv, self.body, self.tail = nn.Conv2d(3, c, 3, padding=1), body, tail
    def forward(self, x):
        x = self.body(self.conv(x))
        return self.tail(x) if self.tail else x

# --- culprits found with the right module ---

class ContiguousAfterConv(nn.Module):
    def __init__(self): super().__init__(); self.conv = nn.Conv2d(8, 8, 3, padding=1)
    def forward(self, x): return self.conv(x).contiguous()

@pytest.mark.parametrize('bs', [4, 8])
def test_activation_shaped_as_a_weight(bs):
    "Weights are told by what each op takes, not by shape: at batch 8 the activations are shaped as the conv's weight (8, 8, 3, 3)"
    r = cl_audit(ContiguousAfterConv(), size=3, bs=bs, c=8)
    assert rows(r) == [('', 'aten.clone', 'forward', 'convert')] and r.events['shape'][0] == (bs, 8, 3, 3)

def test_instance_norm():
    r = cl_audit(Wrap(nn.Sequential(nn.ReLU(), nn.InstanceNorm2d(8))))
    assert ('body.1', 'aten.clone', 'forward', 'convert') in rows(r)
    assert set(r.events.module) == {'body.1'}
    assert r.events['shape'][0] == (2, 8, 16, 16) and r.events.bytes[0] == 2*8*16*16*4 and r.events.dtype[0] == 'float32'

def test_grid_sample():
    grid = torch.rand(2, 8, 8, 2) * 2 - 1
    r = cl_audit(Wrap(nn.ReLU(), tail=lambda x: F.grid_sample(x, grid, align_corners=False)))
    assert ('', 'aten.grid_sampler_2d', 'forward', 'lost') in rows(r)   # functional in the root's forward
    assert ('', 'aten.grid_sampler_2d_backward', 'backward', 'lost') in rows(r)

def test_local_response_norm():
    r = cl_audit(Wrap(nn.Sequential(nn.LocalResponseNorm(2), nn.Conv2d(8, 8, 3))))
    assert not r.ok and set(r.events.module) == {'body.0'}

class MixedCat(nn.Module):
    def forward(self, x): return torch.cat([x, x.contiguous() * 2], 1)

def test_mixed_layout_cat():
    r = cl_audit(Wrap(nn.Sequential(nn.ReLU(), MixedCat())))
    assert ('body.1', 'aten.cat', 'forward', 'lost') in rows(r)
    assert ('body.1', 'aten.clone', 'forward', 'convert') in rows(r)   # the explicit .contiguous()

def test_shufflenet_channel_shuffle():
    r = cl_audit(torchvision.models.shufflenet_v2_x0_5(weights=None), size=64)
    first = r.events.iloc[0]
    assert (first.module, first.op, first.kind) == ('stage2.0', 'aten.clone', 'convert')
    assert r.module_types['stage2.0'] == 'InvertedResidual' and len(first['shape']) == 5   # the 5D shuffle view

def test_mobilenet_v2_backward_only():
    r = cl_audit(torchvision.models.mobilenet_v2(weights=None), size=64)
    assert rows(r) == [('features.18.2', 'aten.hardtanh_backward', 'backward', 'lost')]
    assert r.module_types['features.18.2'] == 'ReLU6'

@pytest.mark.slow
def test_efficientnet_backward_only():
    r = cl_audit(torchvision.models.efficientnet_b0(weights=None), size=64)
    assert rows(r) == [('features.8.2', 'aten.silu_backward', 'backward', 'lost')]

@pytest.mark.slow
@pytest.mark.parametrize('arch,size', [('vgg11', 64), ('alexnet', 96)])
def test_classifier_flatten(arch, size):
    r = cl_audit(getattr(torchvision.models, arch)(weights=None), size=size)
    assert rows(r) == [('', 'aten.clone', 'forward', 'convert')]   # torch.flatten in the root's forward
    assert r.events['shape'][0][2:] == ((7, 7) if arch == 'vgg11' else (6, 6))

# --- no false positives ---

@pytest.mark.parametrize('make', [lambda: torchvision.models.resnet18(weights=None),
                                  lambda: torchvision.models.squeezenet1_0(weights=None),
                                  lambda: torchvision.models.mnasnet0_5(weights=None)],
                         ids=['resnet18', 'squeezenet1_0', 'mnasnet0_5'])
def test_no_false_positives(make):
    r = cl_audit(make(), size=64)
    assert r.ok, r

@pytest.mark.slow
@pytest.mark.parametrize('make', [lambda: torchvision.models.resnet50(weights=None),
                                  lambda: timm.create_model('resnet50', pretrained=False),
                                  lambda: torchvision.models.squeezenet1_1(weights=None),
                                  lambda: torchvision.models.mnasnet1_0(weights=None)],
                         ids=['tv_resnet50', 'timm_resnet50', 'squeezenet1_1', 'mnasnet1_0'])
def test_no_false_positives_slow(make):
    r = cl_audit(make(), size=64)
    assert r.ok, r

class Views(nn.Module):
    "Views of a channels-last tensor, and copies that keep its layout"
    def forward(self, x):
        a, b = x.chunk(2, 1)
        return a.narrow(2, 0, 4), b.transpose(2, 3), x.split(3, 1), x[:, :, 1:], x.clone(), x.double(), x.unsqueeze(1)

def test_views_are_not_events():
    r = cl_audit(Wrap(Views()), backward=False)
    assert r.ok, r

class NHWCNorm(nn.Module):
    "convnext's trick: a layer norm over channels on the NHWC permutation, which is free in channels-last"
    def __init__(self): super().__init__(); self.norm = nn.LayerNorm(8)
    def forward(self, x): return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

def test_permuted_round_trip_is_clean_forward_and_backward():
    r = cl_audit(Wrap(nn.Sequential(NHWCNorm(), nn.Conv2d(8, 8, 3))))
    assert r.ok, r

class Ambiguous(nn.Module):
    "Layout copies of tensors whose layout is ambiguous: one channel, or 1x1 spatial"
    def __init__(self): super().__init__(); self.one = nn.Conv2d(8, 1, 1)
    def forward(self, x): return self.one(x).contiguous(), F.adaptive_max_pool2d(x, 1).contiguous(), x[:, :1].contiguous()

def test_ambiguous_never_counts():
    r = cl_audit(Wrap(Ambiguous()), backward=False)
    assert r.ok, r
    r = cl_audit(Wrap(nn.Conv2d(8, 1, 3)), size=16)
    assert r.ok, r

def test_contiguous_model_reports_nothing():
    r = audit(nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8)), torch.randn(2, 3, 16, 16))
    assert r.ok, r

class ToCL(nn.Module):
    def forward(self, x): return x.contiguous(memory_format=torch.channels_last)

def test_conversion_into_channels_last_is_a_convert():
    r = audit(nn.Sequential(nn.Conv2d(3, 8, 3), ToCL()), torch.randn(2, 3, 16, 16), backward=False)
    assert rows(r) == [('1', 'aten.clone', 'forward', 'convert')]

# --- strict, errors, no leftovers ---

def test_strict_raises_with_details():
    with pytest.raises(ChannelsLastError) as e: cl_audit(Wrap(nn.InstanceNorm2d(8)), strict=True)
    msg = str(e.value)
    assert "module 'body' (InstanceNorm2d)" in msg and 'aten.clone' in msg and 'strides' in msg and 'forward' in msg

def test_strict_raises_in_backward():
    m = torchvision.models.mobilenet_v2(weights=None)
    with pytest.raises(ChannelsLastError, match=r"backward at module 'features.18.2' \(ReLU6\)"): cl_audit(m, size=64, strict=True)
    assert _get_current_dispatch_mode() is None

def no_leftovers(m):
    assert _get_current_dispatch_mode() is None
    for mod in m.modules(): assert not mod._forward_hooks and not mod._forward_pre_hooks

class Boom(nn.Module):
    def forward(self, x): raise RuntimeError('boom')

def test_hooks_removed_and_mode_exited_when_forward_raises():
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Sequential(nn.ReLU(), Boom()))
    with pytest.raises(RuntimeError, match='boom'): cl_audit(m)
    no_leftovers(m)
    r = cl_audit(nn.Sequential(*m[:1], nn.InstanceNorm2d(8)))   # and the next audit works normally
    assert set(r.events.module) == {'1'}

class FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x.clone()
    @staticmethod
    def backward(ctx, g): raise RuntimeError('backward boom')

def test_hooks_removed_and_mode_exited_when_backward_raises():
    m = Wrap(nn.ReLU(), tail=FailBackward.apply)
    with pytest.raises(RuntimeError, match='backward boom'): cl_audit(m)
    no_leftovers(m)

def test_audit_leaves_gradients_statistics_and_random_draws_alone():
    "The model's gradients (the very tensors, and their values: autograd would add into them), BN's statistics, the random state"
    m = model_to(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Dropout(0.5)))
    m[0].weight.grad = g = torch.ones_like(m[0].weight)
    x = to_channels_last(torch.randn(2, 3, 16, 16))
    mean, rng = m[1].running_mean.clone(), torch.get_rng_state()
    audit(m, x)
    assert m[0].weight.grad is g and torch.equal(g, torch.ones_like(g)) and m[0].bias.grad is None
    assert torch.equal(m[1].running_mean, mean) and m[1].num_batches_tracked.item() == 0
    assert torch.equal(torch.get_rng_state(), rng)

def test_audit_channelslast_leaves_a_fitted_learner_as_it_was():
    """After a fit (fastai leaves zeroed gradients): the audit adds nothing to them, draws nothing from the random state
    or the training DataLoader's shuffle; with MixUp and CutMix attached it audits their blended batch"""
    from fastai.vision.all import MixUp, CutMix, Learner
    from clfast.callback import ChannelsLast
    from helpers import image_dls, conv_net
    for mix in (None, MixUp(), CutMix()):
        learn = Learner(image_dls(), conv_net(), loss_func=CrossEntropyLossFlat(), cbs=[ChannelsLast()] + ([mix] if mix else []))
        with learn.no_bar(), learn.no_logging(): learn.fit(1)
        grads = {p: p.grad.clone() for p in learn.model.parameters()}
        rng, shuffle, lf = torch.get_rng_state(), learn.dls.train.rng.getstate(), learn.loss_func
        r = learn.audit_channelslast()
        assert isinstance(r, ChannelsLastReport) and not r.note, (mix, r.note)
        assert all(torch.equal(p.grad, g) for p, g in grads.items())
        assert torch.equal(torch.get_rng_state(), rng) and learn.dls.train.rng.getstate() == shuffle
        assert learn.loss_func is lf

class LazyThrash(nn.Module):
    "Lazy modules (shaped by their first call) and a layout loss after them"
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.LazyConv2d(8, 3, padding=1), nn.LazyBatchNorm2d(), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    def forward(self, x): return self.head(self.body(x).contiguous())

def test_lazy_modules_audited():
    """A model of lazy modules not yet run is audited as any (they are shaped first, as their first call shapes them),
    by `audit`, `audit_channelslast` and the `ChannelsLastAudit` callback; the learner then trains"""
    from fastai.vision.all import Learner
    import clfast.callback   # clfast's `to_channelslast` (fastai's crashes on lazy modules)
    from helpers import image_dls
    r = audit(LazyThrash(), to_channels_last(torch.randn(4, 3, 8, 8)))
    assert ('', 'aten.clone', 'forward', 'convert') in rows(r)
    learn = Learner(image_dls(), LazyThrash(), loss_func=CrossEntropyLossFlat()).to_channelslast(use_amp=False)
    assert ('', 'aten.clone', 'forward', 'convert') in rows(learn.audit_channelslast())
    assert type(learn.model.body[0]) is nn.Conv2d   # made (the audit gives back the weights as they were once made)
    cb = ChannelsLastAudit()
    learn = Learner(image_dls(), LazyThrash(), loss_func=CrossEntropyLossFlat()).to_channelslast(use_amp=False)
    with warnings.catch_warnings(), learn.no_bar(), learn.no_logging():
        warnings.simplefilter('ignore'); learn.fit(1, cbs=cb)
    assert ('', 'aten.clone', 'forward', 'convert') in rows(cb.report)

def test_bad_input():
    with pytest.raises(TypeError, match='nn.Module'): audit(lambda x: x, torch.randn(1))
    with pytest.raises(ValueError, match='backward=False'): audit(nn.Identity(), torch.randn(2, 3, 4, 4))
    assert audit(nn.Identity(), torch.randn(2, 3, 4, 4), backward=False).ok

# --- the report ---

def test_report_api():
    m = Wrap(nn.Sequential(nn.InstanceNorm2d(8), nn.ReLU(), nn.InstanceNorm2d(8)))
    r = cl_audit(m)
    assert list(r.events.columns) == COLS and not r.ok
    s = r.summary()
    assert list(s.columns) == ['module_type', 'op', 'count', 'bytes']
    row = s[(s.module_type == 'InstanceNorm2d') & (s.op == 'aten.clone')].iloc[0]
    assert row['count'] == 1 and row['bytes'] == 2*8*16*16*4   # the second norm gets the already-converted tensor
    assert s['bytes'].sum() == r.events.bytes.sum() and s['count'].sum() == len(r.events)
    assert 'InstanceNorm2d' in str(r) and f'{len(r.events)} events' in str(r)
    html = r._repr_html_()
    assert '<table' in html and 'body.0' in html
    ax = r.plot()
    assert len(ax.patches) == r.events.module.nunique() and 'body.0' in ax.get_yticklabels()[-1].get_text()

def test_empty_report():
    r = ChannelsLastReport()
    assert r.ok and list(r.events.columns) == COLS and len(r.summary()) == 0
    assert 'no channels-last events' in str(r) and 'no channels-last events' in r._repr_html_()

# --- fastai ---

def make_learner(size):
    xs, ys = torch.randn(8, 3, size, size), torch.randint(0, 2, (8,))
    dls = DataLoaders.from_dsets(list(zip(xs, ys)), list(zip(xs, ys)), bs=4)
    return vision_learner(dls, resnet18, pretrained=False, n_out=2, loss_func=CrossEntropyLossFlat())

def test_learner_audit_restores_the_model():
    learn = make_learner(64).to_channelslast(use_amp=False)
    learn.model.eval(); learn.model[1].train()
    w = learn.model[0][0].weight
    data_ptr, mean = w.data_ptr(), learn.model[0][1].running_mean.clone()
    r = learn.audit_channelslast(n_batches=2)
    # fastai's AdaptiveConcatPool2d head at 2x2: max-pool and avg-pool gradients meet in different layouts
    assert set(r.events.module) == {'1.0.mp'} and set(r.events.phase) == {'backward'} and len(r.events) == 2
    assert learn.model[0][0].weight is w and w.data_ptr() == data_ptr and not is_channels_last(w) and w.grad is None
    assert not learn.model[0].training and learn.model[1].training
    assert torch.equal(learn.model[0][1].running_mean, mean)

def test_learner_audit_without_channels_last_callback():
    r = make_learner(64).audit_channelslast()   # model left contiguous, as the learner would train it
    assert not r.ok and r.events.empty and 'not channels-last' in str(r) and 'to_channelslast()' in str(r)
    assert 'not channels-last' in r._repr_html_() and 'not channels-last' in str(r + ChannelsLastReport())
    with pytest.raises(ValueError, match='n_batches'): make_learner(32).audit_channelslast(n_batches=0)

# --- real image folders: the batch as fit hands it to the model ---

@pytest.fixture(scope='module')
def digit_folder(tmp_path_factory):
    "An image folder of real handwritten digits (scikit-learn's bundled scans): 3 classes x 8 PNGs"
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    d, path = load_digits(), tmp_path_factory.mktemp('digits')
    for t in range(3):
        (path/str(t)).mkdir()
        for i in np.flatnonzero(d.target == t)[:8]:
            Image.fromarray((d.images[i] * 255 / 16).astype(np.uint8)).convert('RGB').save(path/str(t)/f'{i}.png')
    return path

def folder_learner(path, **kw):
    from fastai.vision.all import ImageDataLoaders, Resize
    dls = ImageDataLoaders.from_folder(path, valid_pct=0.25, seed=0, bs=8, item_tfms=Resize(64), device='cpu')
    return vision_learner(dls, resnet18, pretrained=False, **kw)

class Spy(Callback):
    "Records the type of the batch each `before_batch` sees"
    order = 50
    def __init__(self): self.types = []
    def before_batch(self): self.types.append(type(self.xb[0]))

def test_learner_audit_on_image_folder(digit_folder):
    "ImageDataLoaders yield TensorImage: the audit runs CastToTensor as fit does, so it sees training's plain tensor"
    from fastai.vision.all import TensorImage
    spy = Spy()
    learn = folder_learner(digit_folder, cbs=spy).to_channelslast(amp_mode='bf16')
    assert type(learn.dls.one_batch()[0]) is TensorImage
    r = learn.audit_channelslast()
    # the subclass's own copies (44 backward events at 64 px) are gone: the head's max/avg-pool gradients remain
    assert rows(r) == [('1.0.mp', 'aten.add', 'backward', 'lost')], r
    assert spy.types == [torch.Tensor]
    assert not learn.training and 'xb' not in learn.__dict__ and 'iter' not in learn.__dict__   # the step state put back
    # the TensorImage itself, which training never runs, reports many more
    xb, yb = learn.dls.one_batch()
    sub = audit(model_to(learn.model), to_channels_last(xb), loss_fn=lambda p: learn.loss_func(p, yb))
    assert len(sub.events) > 10
    with warnings.catch_warnings():   # bf16 falls back to fp32 on CPUs without native bf16, with a warning
        warnings.simplefilter('ignore'); learn.fit(1)   # the learner still trains after both audits
    assert spy.types[-1] is torch.Tensor

class AutocastSpy(Callback):
    "Records the CPU autocast state each training forward of the model runs in"
    def __init__(self): self.seen = []
    def before_fit(self):
        self.hook = self.model.register_forward_pre_hook(
            lambda m, a: self.seen.append(torch.get_autocast_dtype('cpu') if torch.is_autocast_enabled('cpu') else None))
    def after_fit(self): self.hook.remove()

def test_learner_audit_runs_in_the_fit_precision(digit_folder, monkeypatch):
    """`audit_channelslast` audits under the autocast the learner's fit trains in (bf16 here where this CPU's fit takes
    it), as `ChannelsLastAudit` does inside the fit: the two reports agree (it audited in fp32, and a bf16 resnet18
    read 1 event there against 67 in the fit). The copies of a half-precision conv backward clfast routes
    (`clfast.routes.slow_backward_conv`, measured slow here: made present for the test) are clfast's own, listed as
    guarded, not counted (66 of those 67)"""
    import clfast.callback   # noqa: F401  (clfast's to_channelslast, whose MixedPrecision autocasts the CPU; fastai's autocasts CUDA alone)
    import math
    from clfast import timing, amp
    from clfast.routes import SLOW_BF16_BACKWARD
    monkeypatch.setitem(timing._here, f'premise:{SLOW_BF16_BACKWARD.name}', True)
    # bf16 measured faster than fp32 here (where the machine's own probe cannot tell them apart, both audits ran in fp32)
    monkeypatch.setattr(amp, 'cpu_amp_speed', lambda refresh=False: {torch.bfloat16: 0.5, torch.float16: math.inf})
    learn = folder_learner(digit_folder).to_channelslast(amp_mode='bf16')
    spy = AutocastSpy()
    spy.learn = learn
    spy.before_fit()
    try: r = learn.audit_channelslast()
    finally: spy.after_fit()
    audit_cb, fit_spy = ChannelsLastAudit(), AutocastSpy()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(1, cbs=[audit_cb, fit_spy])
    assert spy.seen[0] == fit_spy.seen[0] == torch.bfloat16, (spy.seen, fit_spy.seen)
    assert rows(r) == rows(audit_cb.report) == [('1.0.mp', 'aten.add', 'backward', 'lost')], (r, audit_cb.report)
    timed = [g for g in r.guarded if g[1] == 'timed backward']
    assert timed and timed == [g for g in audit_cb.report.guarded if g[1] == 'timed backward'], (r, audit_cb.report)

class _AutocastSeen(torch.autograd.Function):
    "Identity that records whether CPU autocast is on in its forward and in its backward"
    seen = []
    @staticmethod
    def forward(ctx, x): _AutocastSeen.seen.append(('forward', torch.is_autocast_enabled('cpu'))); return x.view_as(x)
    @staticmethod
    def backward(ctx, g): _AutocastSeen.seen.append(('backward', torch.is_autocast_enabled('cpu'))); return g

def test_audit_backward_runs_outside_the_autocast():
    """A fit's backward runs outside autocast (MixedPrecision leaves it at `after_loss`); the audit's ran inside the
    forward's autocast, so a backward that autocasts (a custom Function's) was audited in another precision. The learner's
    audit and `ChannelsLastAudit` (inside the fit's autocast) both go through `audit`"""
    class Net(nn.Sequential):
        def forward(self, x): return super().forward(_AutocastSeen.apply(x))
    model = Net(nn.Conv2d(3, 8, 3), nn.ReLU()).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8, requires_grad=True).to(memory_format=torch.channels_last)
    _AutocastSeen.seen.clear()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        audit(model, x)
        assert torch.is_autocast_enabled('cpu')   # and back on after it
    assert _AutocastSeen.seen == [('forward', True), ('backward', False)], _AutocastSeen.seen

def test_callback_warns_once():
    learn = make_learner(64).to_channelslast(use_amp=False)
    cb = ChannelsLastAudit()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        learn.fit(1, cbs=cb)
    msgs = [str(w.message) for w in ws if 'channels-last audit' in str(w.message)]
    assert len(msgs) == 1 and 'AdaptiveMaxPool2d' in msgs[0]
    assert set(cb.report.events.module) == {'1.0.mp'}

def test_callback_silent_when_clean():
    learn = make_learner(32).to_channelslast(use_amp=False)   # 1x1 final map: ambiguous, nothing to lose
    cb = ChannelsLastAudit()
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        learn.fit(1, cbs=cb)
    assert cb.report is not None and cb.report.ok
    assert not [w for w in ws if 'channels-last audit' in str(w.message)]

@pytest.mark.cuda
def test_cuda():
    m = Wrap(nn.Sequential(nn.ReLU(), nn.InstanceNorm2d(8))).cuda()
    r = audit(model_to(m), to_channels_last(torch.randn(2, 3, 16, 16, device='cuda')))
    assert 'body.1' in set(r.events.module)
    r = audit(model_to(torchvision.models.resnet18(weights=None).cuda()), to_channels_last(torch.randn(2, 3, 64, 64, device='cuda')))
    assert r.ok, r

class Branches(nn.Module):
    "SelectiveKernel's stack of two channels-last branches: 4D maps into one 5D tensor, channels still innermost"
    def __init__(self): super().__init__(); self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
    def forward(self, x): return torch.stack([self.a(x), self.b(x)], 1).sum(1)

def test_rank_change_is_not_lost():
    r = cl_audit(Wrap(Branches()))
    assert r.ok, r
    r = cl_audit(timm.create_model('skresnet18', pretrained=False), size=32)
    assert r.ok, r

# --- the coverage script ---

def test_audit_models_cli(tmp_path):
    from clfast.audit_models import main as audit
    from clfast.cli import audit_models_parser, main
    df = audit(audit_models_parser().parse_args(['--source', 'torchvision', '--models', 'squeezenet1_1', 'mobilenet_v2',
                                                 '--out', str(tmp_path/'cov')]))
    csv = __import__('pandas').read_csv(tmp_path/'cov.csv', keep_default_na=False)
    assert csv.model.tolist() == ['squeezenet1_1', 'mobilenet_v2'] and csv.events_backward.tolist() == [0, 1]
    assert 'features.18.2 (ReLU6)' in (tmp_path/'cov.md').read_text()
    with pytest.raises(SystemExit): main(['audit-models', '--models', 'resnet18'])           # which zoo is ambiguous
    with pytest.raises(SystemExit): main(['audit-models', '--size', '0', '--out', str(tmp_path/'x')])

@pytest.mark.slow
def test_audit_models_zoo(tmp_path):
    from clfast.audit_models import main
    from clfast.cli import audit_models_parser
    df = main(audit_models_parser().parse_args(['--source', 'torchvision', '--models', 'resnet18', 'resnet50', 'squeezenet1_0',
              'mnasnet0_5', 'vgg11', 'shufflenet_v2_x1_0', '--out', str(tmp_path/'cov')])).set_index('model')
    events = df.events_forward + df.events_backward
    assert (events[['resnet18', 'resnet50', 'squeezenet1_0', 'mnasnet0_5']] == 0).all()
    assert df.worst_module['vgg11'] == '(root) (VGG)' and df.worst_module['shufflenet_v2_x1_0'] == 'stage2.0 (InvertedResidual)'

def test_a_fused_model_is_audited_fused():
    """The audit hooks every module; a hook makes a fused layer run as its stock modules (`clfast.fused`), but the
    audit's are clfast's own observers: a fused model is audited as it trains, fused"""
    from clfast.fuse import fuse_conv_bn
    from clfast.stock import observer
    m = fuse_conv_bn(torchvision.models.resnet18(num_classes=10)).to(memory_format=torch.channels_last)
    unfused = []
    for chain in (m.conv1, m.layer1[0].conv2, m.layer1[0]):   # a chain, a chain in a block, the block
        chain.register_forward_pre_hook(observer(lambda mod, args: unfused.append(mod.runs_unfused())))
    audit(m, torch.randn(2, 3, 32, 32).to(memory_format=torch.channels_last))
    assert unfused == [False, False, False]

# --- session 55's review: what the audit left changed, and a copy it misread ---

def test_a_copy_in_the_same_memory_order_is_no_convert():
    """A channels-last map permuted to NHWC and cast to fp32 (timm's LayerNorm2dFp32; its LayerNorm2d under CUDA
    autocast) keeps its memory order: no event. Judged by its permuted shape alone it read as a 'convert'"""
    from timm.layers import LayerNorm2dFp32
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), LayerNorm2dFp32(8), nn.Conv2d(8, 8, 3, padding=1))
    with torch.autocast('cpu', dtype=torch.bfloat16): r = cl_audit(m)
    assert r.ok, r.events
    # a copy that does change the order still shows
    r = cl_audit(Wrap(nn.Identity(), tail=lambda x: x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2) + 0))
    assert r.ok
    assert not cl_audit(Wrap(nn.Identity(), tail=lambda x: x.contiguous())).ok

class _SizedCache(nn.Module):
    "A buffer rebuilt in the forward when the input's size differs from it (trains as any model)"
    def __init__(self): super().__init__(); self.register_buffer('pos', torch.zeros(1, 1, 4, 4), persistent=False)
    def forward(self, h):
        if self.pos.shape[-2:] != h.shape[-2:]: self.pos = torch.zeros(1, 1, *h.shape[-2:])
        return h + self.pos

def test_a_buffer_assigned_anew_in_the_forward_is_put_back():
    "The audit restored buffers by copying into whatever tensor was there: another shape's raised, and the BNs after it kept the audit's update"
    m = model_to(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), _SizedCache(), nn.BatchNorm2d(8)))
    pos, mean = m[1].pos, m[2].running_mean.clone()
    assert audit(m, to_channels_last(torch.randn(2, 3, 16, 16))).ok
    assert m[1].pos is pos and pos.shape == (1, 1, 4, 4)
    assert torch.equal(m[2].running_mean, mean) and m[2].num_batches_tracked.item() == 0

def test_audit_says_what_to_do_for_no_grad_and_scripted_models():
    m = model_to(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()))
    x = to_channels_last(torch.randn(2, 3, 8, 8))
    with torch.no_grad(), pytest.raises(ValueError, match=r"no_grad\(\) or torch.inference_mode\(\).*backward=False"): audit(m, x)
    with pytest.raises(TypeError, match='before scripting it'): audit(torch.jit.script(m), x)

def test_audit_of_a_memory_learner_leaves_no_saved_tensor_hooks():
    """`ChannelsLast.before_batch` enters `recomputed_outputs()` for 'memory' layers, and a fit's `after_pred` leaves it;
    the audit never did: a global saved-tensors hook stayed on, one more each audit, in the fits and code after it"""
    from helpers import tiny_learner
    import clfast.callback   # noqa: F401
    top = torch._C._autograd._top_saved_tensors_default_hooks
    learn = tiny_learner().to_channelslast(use_amp=False, fuse='memory')
    with learn.no_bar(), learn.no_logging(): learn.fit(1)   # the fit decides: the model has 'memory' layers
    assert learn.channels_last.recompute and top(False) is None
    for _ in range(2): learn.audit_channelslast(n_batches=2)
    assert top(False) is None and learn.channels_last.recomputing is None

class _PartlyLazy(nn.Module):
    def __init__(self, in_features=8):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Sequential(nn.LazyConv2d(8, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_features, 2))
    def forward(self, x): return self.head(self.body(self.stem(x)))

@pytest.mark.parametrize('in_features', [8, 7])   # 7: the head does not fit, and the shaping forward raises
def test_audit_of_lazy_modules_leaves_the_learner_as_it_was(in_features):
    """The lazy modules' shaping ran outside the audit's restore: it left the model's other weights channels-last, and
    a forward that raised there left the learner's step state (training, xb, yb, ...) set"""
    from fastai.vision.all import Learner
    from helpers import image_dls
    import clfast.callback   # noqa: F401
    learn = Learner(image_dls(), _PartlyLazy(in_features), loss_func=CrossEntropyLossFlat()).to_channelslast(use_amp=False)
    w, before = learn.model.stem.weight, {k: learn.__dict__.get(k) for k in ('xb', 'yb', 'training', 'iter', 'dl', 'n_iter')}
    if in_features == 8: assert learn.audit_channelslast().ok
    else:
        with pytest.raises(RuntimeError, match='cannot be multiplied'): learn.audit_channelslast()
    assert learn.model.stem.weight is w and not is_channels_last(w)
    assert {k: learn.__dict__.get(k) for k in before} == before

class _HalfSoftmax(nn.Module):
    "A channel split (CSP, GhostNet, ShuffleNetV2): an op on half the channels, then the halves joined"
    def __init__(self): super().__init__(); self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
    def forward(self, x):
        a, b = self.c1(x).chunk(2, 1)
        return self.c2(torch.cat([a.softmax(1), b], 1))

def test_an_op_on_a_channel_slice_that_drops_the_format_is_found():
    """A channel slice of a channels-last map is laid out in its order without being dense: an op given one that
    allocates NCHW lost the format as on the whole map (the audit saw only dense inputs: timm's dpn68 read clean with
    88 NCHW gradients from `slice_backward`). A broadcast is no map (skresnet18 stays clean: `test_rank_change_is_not_lost`)"""
    r = cl_audit(_HalfSoftmax())
    assert {('', 'aten._softmax', 'forward', 'lost'), ('', 'aten.cat', 'forward', 'lost')} <= set(rows(r)), r
