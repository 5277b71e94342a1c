"The CPU precision policy, to_fp16/to_bf16/to_fp32, autocast cleanup on any exception, fastai-compatible signatures"
import math, warnings, cloudpickle, pytest, torch
from torch import nn
import fastai.callback.fp16 as fastai_fp16
from fastai.vision.all import Learner, Callback, AMPMode, load_learner, DataLoaders, CrossEntropyLossFlat
import clfast.amp as amp
from clfast.amp import MixedPrecision, resolve_amp, cpu_amp_speed, measure_cpu_amp
from clfast import timing
from clfast.timing import Timing, MAX_PAIRS
from clfast.callback import ChannelsLast
from clfast.core import ClfastWarning
from helpers import *

# Probe ratios (half-precision step time / fp32's) of the CPU kinds this project meets; this machine can only be one
INTEL_AMX_FP16 = {torch.bfloat16: 0.45, torch.float16: 148.}      # fp16 "supported", backward ~150x slower
AMD_BF16 = {torch.bfloat16: 0.6, torch.float16: math.inf}
AVX2_ONLY = {torch.bfloat16: math.inf, torch.float16: math.inf}

@pytest.fixture
def cpu_kind(monkeypatch):
    "Make the policy see another CPU kind's measured speeds (the half dtypes then really run, emulated if need be)"
    def use(speed): monkeypatch.setattr(amp, 'cpu_amp_speed', lambda refresh=False: dict(speed))
    return use

def _fit(learn, *cbs, n=1):
    with learn.no_bar(), learn.no_logging(): learn.fit(n, 1e-3, cbs=list(cbs))
    return learn

def _amps(learn): return [cb for cb in learn.cbs if isinstance(cb, (MixedPrecision, fastai_fp16.MixedPrecision))]

@pytest.mark.parametrize('speed,mode,expected', [
    (INTEL_AMX_FP16, 'fp16', torch.bfloat16), (INTEL_AMX_FP16, 'bf16', torch.bfloat16),
    (AMD_BF16, 'fp16', torch.bfloat16), (AVX2_ONLY, 'fp16', torch.float32), (AVX2_ONLY, 'bf16', torch.float32),
    ({torch.bfloat16: 0.5, torch.float16: 0.4}, 'fp16', torch.float16)])
def test_default_fit_uses_the_fast_precision_with_one_warning(cpu_kind, speed, mode, expected):
    cpu_kind(speed)
    probe = Probe()
    learn = tiny_learner().to_channelslast(amp_mode=mode)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        _fit(learn, probe)
    ours = [str(o.message) for o in w if issubclass(o.category, ClfastWarning)]
    assert learn.mixed_precision.dtype == expected and set(probe.pred_dtypes) == {expected}
    if expected == (torch.float16 if mode == 'fp16' else torch.bfloat16): assert ours == []
    else:
        assert len(ours) == 1 and ours[0].startswith(f"{mode} mixed precision: ")
        # fp16 falls back to bf16 where that is fast: where it is not, both are said
        assert ('no native fp16 or bf16' in ours[0]) == (speed is AVX2_ONLY and mode == 'fp16')
        assert ('training in bf16' in ours[0]) == (expected == torch.bfloat16)
        assert ('148x' in ours[0]) == (speed is INTEL_AMX_FP16 and mode == 'fp16')   # says why: the measured cost

def test_fp16_scaler_only_when_fp16_is_used(cpu_kind):
    cpu_kind(INTEL_AMX_FP16)
    scaler_on = []
    class Scaler(Callback):
        def after_batch(self): scaler_on.append(self.learn.scaler.is_enabled())
    _fit(tiny_learner().to_fp16(), Scaler())
    assert scaler_on and not any(scaler_on)          # bf16 instead of the slow fp16: no loss scaling

def test_measure_is_a_real_ratio_and_leaves_rng_alone():
    state = torch.get_rng_state()
    r = measure_cpu_amp(torch.bfloat16)   # the stopping rule itself: tests/test_timing.py
    assert 0 < r.ratio < math.inf and 1 <= r.pairs <= MAX_PAIRS and torch.equal(torch.get_rng_state(), state)

def test_speed_is_measured_once_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path)); monkeypatch.setattr(timing, '_here', {})
    monkeypatch.setattr(amp, 'cpu_native_dtypes', lambda: {torch.bfloat16})   # as a CPU whose oneDNN flags bf16
    calls = []
    monkeypatch.setattr(amp, 'measure_cpu_amp', lambda dtype: calls.append(dtype) or Timing(0.5, 6, True, 1e-3))
    assert cpu_amp_speed() == {torch.bfloat16: 0.5, torch.float16: math.inf}
    assert cpu_amp_speed() == {torch.bfloat16: 0.5, torch.float16: math.inf}
    assert calls == [torch.bfloat16] and 'amp:bf16_step' in timing.timings('amp:')
    cpu_amp_speed(refresh=True)
    assert calls == [torch.bfloat16] * 2

def test_a_tie_trains_fp32_and_says_so(monkeypatch, tmp_path):
    "An undecided probe (bf16 within noise of fp32) gives fp32 with a message saying the probe could not tell"
    monkeypatch.setenv('CLFAST_CACHE_DIR', str(tmp_path)); monkeypatch.setattr(timing, '_here', {})
    monkeypatch.setattr(amp, 'cpu_native_dtypes', lambda: {torch.bfloat16})
    monkeypatch.setattr(amp, 'measure_cpu_amp', lambda dtype: Timing(0.89, MAX_PAIRS, None, 1e-3))
    dtype, scaler, why = resolve_amp('cpu', 'bf16')
    assert dtype == torch.float32 and not scaler and 'could not tell' in why

def test_lstm_runs_fp32_where_cpu_autocast_cannot_run_it(cpu_kind):
    "fastai's AWD_LSTM language model under bf16 on a CPU whose oneDNN has no bf16 LSTM: the LSTM runs fp32, no error"
    from fastai.text.all import get_language_model, AWD_LSTM, awd_lstm_lm_config
    from fastai.callback.rnn import ModelResetter, RNNCallback
    cpu_kind({torch.bfloat16: 0.5, torch.float16: math.inf})
    runs = amp.MachineCache('cpu_amp').get('lstm_runs_bf16')     # measured before clfast's fallback was registered
    if runs is None and amp._lstm_lib is None: runs = amp._lstm_runs(torch.bfloat16)
    if runs: pytest.skip("this CPU's oneDNN runs LSTM in bf16")
    cfg = {**awd_lstm_lm_config, 'emb_sz': 16, 'n_hid': 32, 'n_layers': 2}
    toks = torch.randint(0, 50, (64, 13))
    dls = DataLoaders.from_dsets(list(zip(toks[:48, :-1], toks[:48, 1:])), list(zip(toks[48:, :-1], toks[48:, 1:])),
                                 bs=16, device='cpu')
    learn = Learner(dls, get_language_model(AWD_LSTM, 50, config=cfg), loss_func=CrossEntropyLossFlat(),
                    cbs=[ModelResetter(), RNNCallback()]).to_bf16()
    _fit(learn)
    assert learn.mixed_precision.dtype == torch.bfloat16 and learn.mixed_precision.fp32_ops == ['lstm']
    assert math.isfinite(learn.recorder.values[-1][0])

@pytest.mark.isa_neutral   # callbacks' control flow after an exception: the same at every instruction-set level
@pytest.mark.parametrize('exc', [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize('where', ['fit', 'validate', 'get_preds', 'predict', 'tta'])
def test_autocast_never_leaks(cpu_kind, exc, where):
    cpu_kind({torch.bfloat16: 0.5, torch.float16: 0.4})          # fp16 with a real GradScaler, emulated if need be
    learn = datasets_learner().to_channelslast()
    _fit(learn)
    class Boom(Callback):
        order = 11   # after MixedPrecision entered autocast (before_batch) and before it leaves it (after_loss)
        def after_pred(self): raise exc('boom')
    learn.add_cb(Boom())
    calls = {'fit': lambda: learn.fit(1), 'validate': learn.validate, 'get_preds': learn.get_preds,
             'predict': lambda: learn.predict(0), 'tta': lambda: learn.tta(n=1)}
    with pytest.raises(exc, match='boom'): calls[where]()
    assert not torch.is_autocast_enabled('cpu') and not torch.is_autocast_enabled('cuda')
    learn.remove_cb(learn.boom)
    _fit(learn)                                                    # the scaler works on as before
    assert learn.mixed_precision.dtype == torch.float16 and not torch.is_autocast_enabled('cpu')

def test_interrupted_step_leaves_scaler_usable(cpu_kind):
    cpu_kind({torch.bfloat16: 0.5, torch.float16: 0.4})
    learn = tiny_learner().to_fp16()
    class Stop(Callback):
        order = 5   # after the scaler stepped, before MixedPrecision.after_step updates it
        def after_step(self): raise KeyboardInterrupt
    learn.add_cb(Stop())
    with pytest.raises(KeyboardInterrupt): _fit(learn)
    scaler = learn.scaler
    learn.remove_cb(learn.stop)
    scaler.step(learn.mixed_precision)                             # no "step() has already been called" error
    _fit(learn)

def test_one_amp_callback_whatever_the_order():
    learn = tiny_learner()
    for calls in (('to_fp16', 'to_bf16'), ('to_bf16', 'to_channelslast'), ('to_channelslast', 'to_fp16', 'to_bf16')):
        learn.to_fp32()
        for c in calls: getattr(learn, c)()
        assert len(_amps(learn)) == 1 and type(_amps(learn)[0]) is MixedPrecision
    assert learn.mixed_precision.amp_mode == AMPMode.BF16
    learn.add_cb(fastai_fp16.MixedPrecision())
    learn.to_fp32()
    assert _amps(learn) == []
    _fit(learn.to_channelslast().to_fp16())                        # fastai: "2 MixedPrecision callbacks" here

def test_to_bf16_then_to_channelslast_keeps_bf16():
    learn = tiny_learner().to_bf16()
    with warnings.catch_warnings():
        warnings.simplefilter('error', ClfastWarning)
        learn.to_channelslast()
    assert learn.mixed_precision.amp_mode == AMPMode.BF16

def test_load_learner_then_to_fp32(tmp_path):
    learn = datasets_learner(cbs=MixedPrecision('bf16'), path=tmp_path)
    _fit(learn)
    learn.export('e.pkl', cloudpickle, 2)                               # fastai's positional arguments
    loaded = load_learner(tmp_path/'e.pkl', cpu=True)
    assert _amps(loaded.to_fp32()) == []
    learn = datasets_learner(path=tmp_path).to_channelslast()
    learn.export('e2.pkl')
    loaded = load_learner(tmp_path/'e2.pkl')
    assert len(_amps(loaded)) <= 1 and _amps(loaded.to_fp16().to_fp32()) == []

@pytest.mark.isa_neutral   # arguments and messages
def test_signatures_accept_what_fastai_accepts():
    seen = []
    learn = tiny_learner(cbs=ChannelsLast(after_fit=lambda cb: seen.append('after_fit')))
    _fit(learn)
    assert seen == ['after_fit']
    _fit(tiny_learner(cbs=MixedPrecision(device='cpu')))
    with pytest.raises(ValueError, match='batches are on cpu'): _fit(tiny_learner(cbs=MixedPrecision(device='meta')))

def test_scaler_kwargs_checked_at_call_nothing_changed():
    learn = tiny_learner()
    before = list(learn.cbs)
    with pytest.raises(TypeError, match="'init_scal'.*init_scale"): learn.to_channelslast(init_scal=2.)
    assert list(learn.cbs) == before
    with pytest.raises(TypeError, match="growth_factor"): learn.to_fp16(growth_factr=2.)
    assert list(learn.cbs) == before

@pytest.mark.isa_neutral   # a message, said once
def test_fuse_that_fuses_nothing_says_so():
    learn = Learner(image_dls(), nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                                nn.Linear(4, 2)), loss_func=CrossEntropyLossFlat())
    with pytest.warns(ClfastWarning, match="fuse='speed' fused nothing"): learn.to_channelslast(use_amp=False, fuse='speed')
    with warnings.catch_warnings(record=True) as rec:   # said once: not again at each fit, which tries again
        warnings.simplefilter('always')
        for _ in range(2): learn.fit(1)
    assert not [w for w in rec if 'fused nothing' in str(w.message)] and len(learn.recorder.values) == 1
