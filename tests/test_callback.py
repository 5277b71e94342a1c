import copy, math, sys, warnings, pytest, torch
from torch import nn
import fastai.callback.fp16 as fastai_fp16
import fastai.callback.channelslast as fastai_cl
from fastai.vision.all import Learner, MSELossFlat, DataLoaders, AMPMode, Callback, set_seed
from clfast.core import is_channels_last, ClfastWarning
from clfast.amp import MixedPrecision, resolve_amp
from clfast.callback import ChannelsLast
from helpers import *

CPU_BF16 = resolve_amp('cpu', 'bf16')[0]   # what the precision policy gives bf16 on this CPU (measured)
native_bf16 = pytest.mark.skipif(CPU_BF16 != torch.bfloat16, reason="CPU without fast native bf16")

def _fit(learn, *cbs, n=1):
    with learn.no_bar(), learn.no_logging(): learn.fit(n, 1e-3, cbs=list(cbs))
    return learn

def test_batches_and_model_channels_last():
    raw, probe = RawProbe(), Probe()
    learn = _fit(tiny_learner().to_channelslast(use_amp=False), raw, probe)
    assert all(is_channels_last(xb[0]) for xb in probe.xb)
    assert not any(is_channels_last(xb[0]) for xb in raw.xb)      # the data really came in contiguous
    assert all(is_channels_last(p) for p in learn.model.parameters() if p.dim() == 4)
    assert all(is_channels_last(g) for g in probe.grads[-1].values() if g.dim() == 4)
    w = learn.model[0][0].weight
    assert is_channels_last(learn.opt.state[w]['grad_avg']) and is_channels_last(learn.opt.state[w]['sqr_avg'])

def test_already_channels_last_batch_not_copied():
    raw, probe = RawProbe(), Probe()
    learn = tiny_learner().to_channelslast(use_amp=False)
    class MakeCL(Callback):
        order = -6
        def before_batch(self): self.learn.xb = tuple(x.contiguous(memory_format=torch.channels_last) for x in self.learn.xb)
    _fit(learn, MakeCL(), raw, probe)
    assert all(a[0] is b[0] for a, b in zip(raw.xb, probe.xb))

def test_ambiguous_grayscale_not_copied():
    raw, probe = RawProbe(), Probe()
    _fit(tiny_learner(c=1).to_channelslast(use_amp=False), raw, probe)   # N1HW input
    assert all(a[0] is b[0] for a, b in zip(raw.xb, probe.xb))

def test_conv3d_batches_channels_last_3d():
    x, y = torch.randn(8, 2, 4, 6, 6), torch.randn(8, 1)
    dls = DataLoaders.from_dsets(list(zip(x, y)), list(zip(x, y)), bs=4, device='cpu')
    model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 1))
    probe = Probe()
    learn = _fit(Learner(dls, model, loss_func=MSELossFlat()).to_channelslast(use_amp=False), probe)
    assert all(xb[0].is_contiguous(memory_format=torch.channels_last_3d) for xb in probe.xb)
    assert learn.model[0].weight.is_contiguous(memory_format=torch.channels_last_3d)

def test_to_contiguous_restores_params_grads_and_opt_state():
    learn = _fit(tiny_learner().to_channelslast(use_amp=False))
    w = learn.model[0][0].weight
    assert is_channels_last(learn.opt.state[w]['grad_avg'])
    assert learn.to_contiguous() is learn
    assert all(p.is_contiguous() for p in learn.model.parameters())
    assert all(v.is_contiguous() for s in learn.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    assert not hasattr(learn, 'channels_last') and hasattr(learn, 'mixed_precision') is False  # use_amp=False added none
    _fit(learn)   # trains on contiguous afterwards

def test_to_contiguous_to_fp32_removes_amp():
    learn = tiny_learner().to_channelslast(amp_mode='bf16')
    assert hasattr(learn, 'mixed_precision')
    learn.to_contiguous(to_fp32=True)
    assert not hasattr(learn, 'mixed_precision') and not hasattr(learn, 'channels_last')

def test_idempotent():
    learn = tiny_learner()
    learn.to_channelslast(amp_mode='bf16').to_channelslast(amp_mode='bf16')
    assert sum(isinstance(cb, ChannelsLast) for cb in learn.cbs) == 1
    assert sum(isinstance(cb, MixedPrecision) for cb in learn.cbs) == 1

def test_replaces_fastai_callbacks():
    learn = tiny_learner(cbs=[fastai_cl.ChannelsLast(), fastai_fp16.MixedPrecision(AMPMode.BF16)])
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        learn.to_channelslast()       # no amp_mode: the attached callback's mode is kept (fastai's rule), as clfast's
    types = [type(cb) for cb in learn.cbs]
    assert fastai_cl.ChannelsLast not in types and fastai_fp16.MixedPrecision not in types
    assert types.count(ChannelsLast) == 1 and types.count(MixedPrecision) == 1
    assert learn.mixed_precision.amp_mode == AMPMode.BF16
    with pytest.warns(UserWarning, match="replacing MixedPrecision\\(bf16\\) with MixedPrecision\\(fp16\\)"):
        learn.to_channelslast(amp_mode='fp16')
    assert learn.mixed_precision.amp_mode == AMPMode.FP16 and types.count(MixedPrecision) == 1

def test_use_amp_false_converts_fastai_amp_keeping_mode():
    learn = tiny_learner(cbs=fastai_fp16.MixedPrecision(AMPMode.BF16)).to_channelslast(use_amp=False)
    assert type(learn.mixed_precision) is MixedPrecision and learn.mixed_precision.amp_mode == AMPMode.BF16

def test_bad_amp_mode_changes_nothing():
    learn = tiny_learner()
    before = list(learn.cbs)
    with pytest.raises(ValueError, match="Unknown amp_mode 'fp8': use one of 'fp16', 'bf16'"):
        learn.to_channelslast(amp_mode='fp8')
    assert list(learn.cbs) == before
    with pytest.raises(ValueError, match="use one of"): MixedPrecision('int8')
    learn.to_channelslast(amp_mode='bf16')
    with pytest.raises(ValueError, match=r"to_contiguous: to_fp32='no' must be True or False"): learn.to_contiguous(to_fp32='no')
    assert learn.mixed_precision.amp_mode == AMPMode.BF16 and learn.channels_last   # the refused call changed nothing
    assert learn.to_channelslast(amp_mode=torch.float16).mixed_precision.amp_mode == AMPMode.FP16   # a dtype, as autocast takes it

def test_warnings_name_the_users_line():
    "A warning from deep in a fit (fastai's callback machinery, then clfast's) names the line that called `fit`, once per callback; one from `to_channelslast` names its own"
    learn = Learner(image_dls(), nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 2)), loss_func=CrossEntropyLossFlat())
    learn.to_channelslast(amp_mode='bf16')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with learn.no_bar(), learn.no_logging(): learn.fit(1); fit_line = sys._getframe().f_lineno
        with learn.no_bar(), learn.no_logging(): learn.fit(1)   # said once per callback, not at every fit
        learn.to_channelslast(amp_mode='fp16'); call_line = sys._getframe().f_lineno
    got = [(x.filename, x.lineno, str(x.message)[:25]) for x in w   # (a CPU without native bf16 also has its fallback said)
           if issubclass(x.category, ClfastWarning) and str(x.message).startswith(('ChannelsLast', 'to_channelslast'))]
    assert got == [(__file__, fit_line, 'ChannelsLast: the model h'), (__file__, call_line, 'to_channelslast: replacin')], got

def test_two_amp_callbacks_refused():
    """Refused by a fit, before a step; not by `validate`, which runs `before_fit` inside fastai's lock of the learner:
    raised there, the lock stayed held and the next `validate` hung for good"""
    learn = tiny_learner().to_channelslast(amp_mode='bf16')
    learn.add_cb(fastai_fp16.MixedPrecision())
    with pytest.raises(ValueError, match="2 MixedPrecision callbacks"): _fit(learn)
    with learn.no_bar():
        for _ in range(2): learn.validate()
    assert not learn.lock.locked()

def test_validate_inside_a_fit_keeps_the_fits_mixed_precision():
    """A callback's `learn.validate()` inside a fit runs `before_fit` and `after_fit` too: MixedPrecision made a new
    GradScaler, then set it to None, and the fit's next step raised ('NoneType' object has no attribute 'scale')"""
    class ValidateMidFit(Callback):
        order = 60
        def after_batch(self):
            if self.training and self.iter == 0: self.learn.validate()
    learn = tiny_learner().to_channelslast(amp_mode='fp16')   # (a GradScaler where this CPU trains fp16; none else)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', ClfastWarning)
        _fit(learn, ValidateMidFit(), n=2)
    # (fastai's Recorder restarts its records at such a `validate`: the weights say the fit trained on)
    assert all(p.isfinite().all() for p in learn.model.parameters()) and learn.scaler is None

def test_no_conv_model_warns():
    "A model without 2D/3D convs: said, and its batches left as they are (fastai's `Flatten` views them, as stock fastai trains it)"
    for flatten in (nn.Flatten(), Flatten()):
        learn = Learner(image_dls(), nn.Sequential(flatten, nn.Linear(3 * 16 * 16, 2)), loss_func=CrossEntropyLossFlat())
        probe = Probe()
        with pytest.warns(UserWarning, match="no 2D or 3D convolution"): _fit(learn.to_channelslast(use_amp=False), probe)
        assert probe.xb and all(xb[0].is_contiguous() for xb in probe.xb)
    # a Conv1d's 3D tensors have no channels-last format: as for no conv at all
    x = torch.randn(32, 4, 20)
    dls = DataLoaders.from_dsets(list(zip(x, (x[:, 0, 0] > 0).long())), list(zip(x, (x[:, 0, 0] > 0).long())), bs=8, device='cpu')
    learn = Learner(dls, nn.Sequential(nn.Conv1d(4, 4, 3), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 2)),
                    loss_func=CrossEntropyLossFlat())
    with pytest.warns(UserWarning, match="no 2D or 3D convolution"): _fit(learn.to_channelslast(use_amp=False))

def test_fp32_channels_last_matches_contiguous():
    res = []
    for cl in (False, True):
        set_seed(1)
        learn = tiny_learner()
        if cl: learn.to_channelslast(use_amp=False)
        _fit(learn, n=2)
        res.append((torch.cat([p.detach().flatten() for p in learn.model.parameters()]), learn.recorder.values[-1]))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(torch.tensor(res[0][1]), torch.tensor(res[1][1]), rtol=1e-3, atol=1e-4)

@native_bf16
def test_cpu_bf16_autocast_dtypes():
    probe = Probe()
    class After(Probe): order = 20
    after = After()
    learn = _fit(tiny_learner().to_channelslast(amp_mode='bf16'), probe, after)
    assert set(probe.pred_dtypes) == {torch.bfloat16}     # the model really ran in bf16
    assert set(after.pred_dtypes) == {torch.float32}      # predictions leave after_pred in fp32
    assert all(p.dtype == torch.float32 for p in learn.model.parameters())
    assert not torch.is_autocast_enabled('cpu')           # autocast left after each batch

def test_cpu_no_cuda_warning_and_precision_reported():
    learn = tiny_learner().to_channelslast(amp_mode='bf16')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        _fit(learn)
    assert not any('CUDA' in str(o.message) for o in w)
    assert learn.mixed_precision.dtype == CPU_BF16

@pytest.mark.skipif(resolve_amp('cpu', 'fp16')[0] != torch.float32, reason="fp16 or bf16 is fast on this CPU")
def test_cpu_fp16_falls_back_to_fp32_with_one_warning():
    probe, scaler_on = Probe(), []
    class Scaler(Callback):
        def after_batch(self): scaler_on.append(self.learn.scaler.is_enabled())
    learn = tiny_learner().to_channelslast()              # fastai's default amp_mode: fp16
    with pytest.warns(UserWarning, match="no native fp16") as w: _fit(learn, probe, Scaler())
    assert sum('no native fp16' in str(o.message) for o in w) == 1
    assert learn.mixed_precision.dtype == torch.float32 and set(probe.pred_dtypes) == {torch.float32}
    assert scaler_on and not any(scaler_on)

def test_autocast_not_left_on_after_model_error():
    learn = tiny_learner().to_channelslast(amp_mode='bf16')
    class Boom(Callback):
        def after_pred(self): raise RuntimeError('boom')
    with pytest.raises(RuntimeError, match='boom'): _fit(learn, Boom())
    _fit(learn)                                           # the next fit cleans up what the failed one left
    assert not torch.is_autocast_enabled('cpu')

@pytest.mark.cuda
def test_cuda_fp16_scaler_and_bf16():
    learn = tiny_learner().to_channelslast()
    learn.dls.cuda(); learn.model.cuda()
    probe, scaler_on = Probe(), []
    class Scaler(Callback):   # fastai drops its GradScaler after fit: look during it
        def after_batch(self): scaler_on.append(self.learn.scaler.is_enabled())
    _fit(learn, probe, Scaler())
    assert set(probe.pred_dtypes) == {torch.float16} and learn.mixed_precision.dtype == torch.float16
    assert scaler_on and all(scaler_on)
    learn.to_channelslast(amp_mode='bf16')
    probe = Probe(); _fit(learn, probe)
    assert set(probe.pred_dtypes) == {torch.bfloat16}

@pytest.mark.cuda
def test_cuda_fp16_overflow_skips_step():
    learn = tiny_learner().to_channelslast(init_scale=2.**60)    # the first scaled gradients overflow fp16
    learn.dls.cuda(); learn.model.cuda()
    steps = []
    class Count(Callback):
        def after_batch(self):
            if self.training: steps.append((self.learn.scaler.get_scale(), len(self.learn.mixed_precision.scales)))
    _fit(learn, Count())
    assert steps[-1][0] < 2.**60                          # the scaler backed off...
    assert steps[-1][1] < len(steps)                      # ...and the overflowing steps were skipped

def test_fuse_keeps_state_dict_and_to_contiguous_unfuses():
    from clfast.fuse import is_fused
    from clfast.fused import FusedConvBN2d
    learn = tiny_learner()
    sd_keys = list(learn.model.state_dict())
    params = list(learn.model.parameters())
    learn.to_channelslast(use_amp=False, fuse='speed')
    assert is_fused(learn.model) and isinstance(learn.model[0][0], FusedConvBN2d)
    assert list(learn.model.parameters()) == params and list(learn.model.state_dict()) == sd_keys
    _fit(learn)
    learn.to_channelslast(use_amp=False, fuse='memory')          # switches mode, still one callback
    assert learn.model[0][0].mode == 'memory' and sum(isinstance(c, ChannelsLast) for c in learn.cbs) == 1
    learn.to_contiguous()
    assert not is_fused(learn.model) and type(learn.model[0][0]) is nn.Conv2d and type(learn.model[0][1]) is nn.BatchNorm2d
    _fit(learn)

def test_fused_training_matches_stock():
    res = []
    for fuse in (False, 'speed', 'memory'):
        set_seed(2)
        learn = _fit(tiny_learner().to_channelslast(use_amp=False, fuse=fuse), n=1)
        res.append(torch.cat([p.detach().flatten() for p in learn.model.parameters()]))
        res[-1] = torch.cat([res[-1], learn.model[0][1].running_var])
    torch.testing.assert_close(res[1], res[0], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(res[2], res[0], rtol=1e-3, atol=1e-4)

def test_callback_fuse_argument_and_bad_fuse():
    from clfast.fuse import is_fused
    learn = _fit(tiny_learner(cbs=ChannelsLast(fuse='memory')))
    assert is_fused(learn.model) and learn.model[0][0].mode == 'memory'
    learn2 = tiny_learner()
    with pytest.raises(ValueError, match="Unknown fuse 'fast'"): learn2.to_channelslast(fuse='fast')
    assert not is_fused(learn2.model) and not hasattr(learn2, 'channels_last')
    learn.to_channelslast(fuse=False)
    assert not is_fused(learn.model)

def test_a_model_fused_otherwise_assigned_later_trains_in_the_asked_mode():
    "A model fused in 'speed', assigned to a learner made with fuse='memory', is switched to 'memory' at the next fit"
    other = tiny_learner().to_channelslast(use_amp=False, fuse='speed')
    learn = tiny_learner().to_channelslast(use_amp=False, fuse='memory')
    learn.model = other.model
    _fit(learn)
    assert learn.model[0][0].mode == 'memory'

import inspect, json, subprocess, sys

NAMES = ['to_fp16', 'to_bf16', 'to_fp32', 'to_channelslast', 'to_contiguous', 'export', 'MixedPrecision', 'ChannelsLast']
FASTAI_SIGNATURES = """
import inspect, json
from fastai.vision.all import Learner, MixedPrecision, ChannelsLast
objs = {n: getattr(Learner, n, None) for n in NAMES}
objs.update(MixedPrecision=MixedPrecision, ChannelsLast=ChannelsLast)
print(json.dumps({n: [(p.name, int(p.kind), repr(p.default)) for p in inspect.signature(o).parameters.values()] for n, o in objs.items()}))
"""

def _params(obj): return [(p.name, int(p.kind), repr(p.default)) for p in inspect.signature(obj).parameters.values()]

def test_signatures_are_fastais_then_extras():
    """Every fastai parameter with its name, kind and default, in fastai's order; clfast's extras only after, keyword-only.
    fastai's signatures come from stock fastai in another process (clfast's import replaces fastai's methods)"""
    code = f"NAMES = {NAMES!r}\n" + FASTAI_SIGNATURES
    fastai = json.loads(subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout)
    ours = {n: getattr(Learner, n) for n in NAMES[:6]}
    ours.update(MixedPrecision=MixedPrecision, ChannelsLast=ChannelsLast)
    for name in NAMES:
        mine, theirs = _params(ours[name]), [tuple(p) for p in fastai[name]]
        assert mine[:len(theirs)] == theirs, (name, mine, theirs)
        assert all(kind == inspect.Parameter.KEYWORD_ONLY for _, kind, _ in mine[len(theirs):]), (name, mine)
def test_fastai_arguments_are_taken():
    "What the signatures show is what the calls take: GradScaler's arguments reach the scaler, events their callback"
    learn = tiny_learner().to_channelslast(init_scale=1024., growth_interval=7, fuse=False)
    assert learn.mixed_precision.kwargs == dict(init_scale=1024., growth_interval=7)
    assert tiny_learner().to_fp16(init_scale=8.).mixed_precision.kwargs == dict(init_scale=8.)
    seen = []
    learn = tiny_learner(cbs=ChannelsLast(after_fit=lambda cb: seen.append(type(cb).__name__), fuse=False))
    learn.fit(1)
    assert seen == ['ChannelsLast']
    with pytest.raises(TypeError): ChannelsLast('speed')   # fuse is keyword-only, as fastai's callback takes no positional

def test_clips_for_a_model_of_2d_convs_stay_as_they_are():
    """5D batches are converted for a model with a Conv3d only: clips `[B, T, C, H, W]` that fastai's `TimeDistributed`
    views as 4D frames for its 2D convs train as with stock fastai's `to_channelslast`"""
    from fastai.layers import TimeDistributed
    x = torch.randn(32, 4, 3, 16, 16)
    y = (x[:, :, 0].mean((1, 2, 3)) > 0).long()
    dls = DataLoaders.from_dsets(list(zip(x, y)), list(zip(x, y)), bs=8, device='cpu')
    frames = nn.Sequential(ConvLayer(3, 8), nn.AdaptiveAvgPool2d(1), Flatten())
    model = nn.Sequential(TimeDistributed(frames), Flatten(), nn.Linear(4 * 8, 2))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat()).to_channelslast(use_amp=False)
    probe = Probe()
    _fit(learn, probe)
    assert probe.xb and all(xb[0].is_contiguous() for xb in probe.xb)
    assert is_channels_last(frames[0][0].weight)   # the model's 2D convs are channels-last all the same
    assert all(math.isfinite(l) for l in learn.recorder.losses)

def test_learner_pickled_by_an_older_clfast_loads_and_trains():
    """A learner pickled with clfast's callbacks from before they had some of their state (an export from
    2026-11-22 to 27 holds them) unpickles with that state at its defaults, and trains"""
    import pickle
    learn = tiny_learner().to_channelslast(amp_mode='bf16')
    cl, mp = learn.channels_last, learn.mixed_precision
    for cb, names in ((cl, ('fuse', 'user_events', 'guarded_on', 'ranks')), (mp, ('device_arg', 'fp32_ops'))):
        for n in names: del cb.__dict__[n]   # as an older clfast pickled them
    old = pickle.loads(pickle.dumps(learn))
    assert old.channels_last.fuse is None and old.mixed_precision.device_arg is None
    _fit(old)
    assert all(math.isfinite(l) for l in old.recorder.losses)

def test_to_channelslast_again_keeps_the_users_event_functions():
    "The event functions given to a ChannelsLast (clfast's or fastai's) still run after `to_channelslast` replaces it"
    for cls in (ChannelsLast, fastai_cl.ChannelsLast):
        seen = []
        learn = tiny_learner(cbs=cls(after_fit=lambda cb: seen.append(('after_fit', cb.learn is not None)),
                                     before_batch=lambda cb: seen.append(('before_batch', is_channels_last(cb.xb[0])))))
        _fit(learn.to_channelslast(amp_mode='bf16'))
        assert ('after_fit', True) in seen and ('before_batch', True) in seen, (cls, seen)
        assert len(learn.cbs.filter(lambda cb: isinstance(cb, (ChannelsLast, fastai_cl.ChannelsLast)))) == 1

def test_fits_and_predictions_keep_the_models_modules(monkeypatch):
    """`ChannelsLast` guards the model again at each `before_fit` (fastai runs one in `fit`, `predict`, `get_preds`
    and `validate`): a model guarded already keeps every module object (each guarded conv and precise BN was
    unguarded and guarded anew, a new object at every fit), so a module the user holds stays the model's: a fastai hook
    on it fires, and an attribute set on it acts"""
    from fastai.callback.hook import hook_output
    from clfast import timing
    from clfast.guard import IMPRECISE_CL_BATCH_NORM
    from clfast.routes import GuardedConv2d, SLOW_BF16_BACKWARD
    from clfast.bn import PreciseBatchNorm2d
    for k in (IMPRECISE_CL_BATCH_NORM, SLOW_BF16_BACKWARD):   # guarded as where these premises hold, whatever this CPU measured
        monkeypatch.setitem(timing._here, f'premise:{k.name}', True)
    learn = datasets_learner().to_channelslast(use_amp=False)
    conv, bn = learn.model[1][0], learn.model[0][1]
    assert type(conv) is GuardedConv2d and type(bn) is PreciseBatchNorm2d
    ids = [id(m) for m in learn.model.modules()]
    hook = hook_output(conv)
    _fit(learn)
    with learn.no_bar(): learn.predict(0)
    assert [id(m) for m in learn.model.modules()] == ids
    bn.momentum = 0.   # through the module held: the model's BN keeps its running statistics
    stats, hook.stored = bn.running_mean.clone(), None
    _fit(learn)
    with learn.no_bar(): learn.get_preds()
    assert [id(m) for m in learn.model.modules()] == ids and hook.stored is not None
    assert torch.equal(learn.model[0][1].running_mean, stats)
    hook.remove()

def test_validation_puts_back_a_model_made_contiguous():
    """A model put back in the contiguous format by hand between calls is channels-last again in `get_preds` and
    `validate` (a `before_fit` just before), and in `get_preds(inner=True)` (none): `before_validate` skips its check
    only right after `before_fit`"""
    learn = _fit(tiny_learner().to_channelslast(use_amp=False))
    convs = [p for p in learn.model.parameters() if p.dim() == 4]
    for call in (learn.get_preds, learn.validate, lambda: learn.get_preds(inner=True), lambda: _fit(learn)):
        learn.model.to(memory_format=torch.contiguous_format)
        assert not any(is_channels_last(p) for p in convs)
        with learn.no_bar(): call()
        assert all(is_channels_last(p) for p in convs) and not learn.channels_last.prepared

def test_a_model_that_views_its_input_is_told_why():
    "A model that `.view`s its raw batch fails on a channels-last batch (fastai's ChannelsLast leaves batches as they are): the error says why and what to do"
    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.lin = nn.Conv2d(3, 2, 3), nn.Linear(3 * 16 * 16, 2)
        def forward(self, x): return self.conv(x).mean((2, 3)) + self.lin(x.view(x.size(0), -1))
    learn = Learner(image_dls(), Views(), loss_func=CrossEntropyLossFlat()).to_channelslast(use_amp=False)
    with pytest.raises(RuntimeError, match='view size is not compatible') as e: _fit(learn)
    said = [*getattr(e.value, '__notes__', []), str(e.value)]   # a note from Python 3.11, the message itself on 3.10
    assert any('`.reshape`' in n and 'to_contiguous' in n for n in said)
    assert type(e.value) is RuntimeError and str(e.value).startswith('view size is not compatible')   # torch's, kept

def test_unguardable_conv_said_once_per_model(monkeypatch):
    "A conv the guard cannot guard (not a stock nn.Conv2d) is said once for the model, not at `to_channelslast` and every fit"
    from clfast import guard
    class MyConv(nn.Conv2d): pass
    # as if `check_channelslast` had found this geometry wrong here: a plan, on every machine
    monkeypatch.setattr(guard, '_checked_failures', lambda: [guard._conv_params(nn.Conv2d(3, 8, 3, padding=1))])
    learn = Learner(image_dls(), nn.Sequential(MyConv(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), Flatten(),
                                               nn.Linear(8, 2)), loss_func=CrossEntropyLossFlat())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')   # each that clfast says, whatever line it names
        learn.to_channelslast(use_amp=False); _fit(learn); _fit(learn)
    said = [str(x.message) for x in w if 'cannot guard them' in str(x.message)]
    assert len(said) == 1 and said[0].startswith('clfast guard: 0 (MyConv) would reach'), said

def _lazy_net():
    return nn.Sequential(nn.LazyConv2d(8, 1, stride=2), nn.LazyBatchNorm2d(), nn.ReLU(),
                         nn.LazyConv2d(8, 3, padding=1), nn.LazyBatchNorm2d(), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))

@pytest.mark.parametrize('fuse', [False, 'speed'])
def test_lazy_modules_prepared_once_they_have_run(fuse):
    """A model of lazy modules (no shapes before its first batch; fastai trains it) fits: from the second step its convs
    are channels-last, guarded as this machine needs (as `guard_model` guards the same model made eagerly) and fused
    as asked, over the parameters the optimizer holds"""
    from clfast.fuse import is_fused
    seen = []
    class Seen(Callback):
        def before_batch(self): seen.append([type(m) for m in self.learn.model])
    with warnings.catch_warnings():
        warnings.simplefilter('error', ClfastWarning)   # no "fused nothing": the lazy pairs are fused once they have run
        learn = Learner(image_dls(), _lazy_net(), loss_func=CrossEntropyLossFlat(), opt_func=Adam).to_channelslast(use_amp=False, fuse=fuse)
        _fit(learn, Seen())
    eager = _lazy_net(); eager(torch.randn(2, 3, 16, 16))
    Learner(image_dls(), eager, loss_func=CrossEntropyLossFlat()).to_channelslast(use_amp=False, fuse=fuse)   # fused, guarded
    assert seen[1] == seen[-1] == [type(m) for m in eager]   # from the second step on, as made eagerly
    assert is_fused(learn.model) == bool(fuse)
    assert all(is_channels_last(p) for p in learn.model.parameters() if p.dim() == 4)
    held = {id(p) for g in learn.opt.param_lists for p in g}
    assert held == {id(p) for p in learn.model.parameters()}

def test_export_after_a_fit_given_channels_last_writes_contiguous_weights(tmp_path):
    """`fit(cbs=[ChannelsLast(fuse=...)])` leaves the model channels-last and fused once its callback is gone: `export`
    still writes contiguous weights in stock modules (it wrote the channels-last ones), and the model in memory stays
    as the fit left it"""
    learn = datasets_learner(path=tmp_path)
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit(1, cbs=[ChannelsLast(fuse='speed')])
    assert not any(isinstance(c, ChannelsLast) for c in learn.cbs)
    w = learn.model[0][0].weight
    assert is_channels_last(w) and 'Fused' in type(learn.model[0][0]).__name__
    # and a model partly channels-last (a block put in since, contiguous): written contiguous, left as it was
    w2 = learn.model[1][0].weight
    for fname in ('export.pkl', 'partly.pkl'):
        if fname == 'partly.pkl': w2.data = w2.data.contiguous()
        learn.export(fname)
        assert learn.model[0][0].weight is w and is_channels_last(w)
        assert is_channels_last(w2) == (fname == 'export.pkl') and w2.is_contiguous() == (fname == 'partly.pkl')
        exported = torch.load(tmp_path/fname, weights_only=False).model
        convs = [m for m in exported.modules() if isinstance(m, nn.Conv2d)]
        assert len(convs) == 2 and all(type(m) is nn.Conv2d and m.weight.is_contiguous() for m in convs)

def test_a_failed_export_leaves_the_learner_as_it_was(tmp_path):
    "Saving fails (a folder that does not exist): the learner keeps its data and optimizer state (fastai's export left them emptied: the next fit logged nan) and trains on"
    learn = datasets_learner(path=tmp_path).to_channelslast(use_amp=False)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    dls, opt, cbs = learn.dls, learn.opt, list(learn.cbs)
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state_dict()['state'][0].items()}
    with pytest.raises((FileNotFoundError, RuntimeError)): learn.export('no/such/folder/export.pkl')
    assert learn.dls is dls and learn.opt is opt and list(learn.cbs) == cbs and len(learn.dls.train) > 0
    for k, v in learn.opt.state_dict()['state'][0].items(): assert torch.equal(v, state[k]) if torch.is_tensor(v) else v == state[k], k
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert all(math.isfinite(v) for v in learn.recorder.values[-1])

def test_export_after_a_fold_in_place_writes_and_keeps_the_optimizer(tmp_path):
    """`fold_conv_bn(learn.model, inplace=True)` then `export`: fastai's export wrote the file, then failed loading the
    optimizer's state into one made for the folded model's fewer parameters. The file is written and loads as stock
    modules, and the learner keeps its very optimizer, state and all (an export without a fold too)"""
    from clfast.fuse import fold_conv_bn
    learn = datasets_learner(path=tmp_path).to_channelslast(use_amp=False)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    opt = learn.opt
    learn.export('trained.pkl')
    assert learn.opt is opt and len(opt.state_dict()['state']) == len(list(learn.model.parameters()))
    x = learn.dls.one_batch()[0]
    learn.model.eval()
    with torch.no_grad(): want = copy.deepcopy(learn.model).double()(x.double())   # the unfolded model in fp64
    fold_conv_bn(learn.model, inplace=True)
    learn.export('folded.pkl')
    assert learn.opt is opt
    exported = torch.load(tmp_path/'folded.pkl', weights_only=False).model.eval()
    assert all(type(m) is nn.Conv2d for m in exported.modules() if isinstance(m, nn.Conv2d))
    with torch.no_grad(): got = exported(x.contiguous()).double()
    assert (got - want).abs().max() < 1e-4 * want.abs().max(), (got - want).abs().max()

def test_export_keeps_the_state_of_an_optimizer_given_as_opt_func(tmp_path):
    """`opt_func=OptimWrapper(opt=...)` is the optimizer itself: fastai's export clears its state making "a new one", and
    clfast's, putting the very optimizer back, put it back empty (SGD's momentum buffers lost)"""
    from fastai.optimizer import OptimWrapper
    learn = datasets_learner(path=tmp_path)
    learn.opt_func = OptimWrapper(opt=torch.optim.SGD(learn.model.parameters(), lr=0.01, momentum=0.9))
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    before = {k: v.clone() for k, v in learn.opt.opt.state_dict()['state'][0].items()}
    learn.export('wrapped.pkl')
    after = learn.opt.opt.state_dict()['state']
    assert learn.opt is learn.opt_func and after and all(torch.equal(after[0][k], v) for k, v in before.items())

def test_a_predict_under_inference_mode_before_the_first_fit_leaves_normal_weights():
    """fastai's `predict` under `torch.inference_mode()` before any fit converts the model there: its weights were made
    inference tensors for good, and the next fp32 fit failed ("Inference tensors cannot be saved for backward")"""
    learn = datasets_learner().to_channelslast(use_amp=False)
    with torch.inference_mode(): learn.predict(learn.dls.valid_ds[0][0])
    assert not any(p.is_inference() for p in learn.model.parameters())
    assert all(is_channels_last(p) for p in learn.model.parameters() if p.dim() == 4)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    assert all(math.isfinite(v) for v in learn.recorder.values[-1])

def test_inner_get_preds_outside_a_fit_autocasts_as_a_fit_would():
    "`get_preds(inner=True)` runs no `before_fit`: MixedPrecision's batches autocast as a fit's would (it raised on its missing autocast)"
    learn = datasets_learner().to_channelslast(amp_mode='bf16')
    seen = []
    h = learn.model.register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_enabled('cpu')))
    try:
        with learn.removed_cbs(learn.recorder): inner, _ = learn.get_preds(dl=learn.dls.valid, inner=True)   # (fastai's Recorder needs a fit)
    finally: h.remove()
    outer, _ = learn.get_preds(dl=learn.dls.valid)
    assert torch.equal(inner, outer)   # (the same batches, the same autocast)
    assert seen and all(seen) == (learn.mixed_precision.fit_autocast().fast_dtype == torch.bfloat16 and
                                   learn.mixed_precision.fit_autocast()._enabled)
    assert not torch.is_autocast_enabled('cpu')
