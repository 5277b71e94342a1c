"""fastai's own notebook checks (18_callback.fp16, 18a_callback.training, 18c_callback.channelslast and the
save/load/export cells of 13a_learner), rewritten as cases that run on a CPU.

`python tests/fastai_port_cases.py stock|clfast OUT.json` runs every case once and writes `{case: result}` to OUT.json,
a result being 'pass', 'fail: <error>' or 'skip: <why>'. `stock` imports fastai only; `clfast` then runs
`from clfast.all import *`, which patches `Learner` (`to_channelslast`, `to_fp16`, `export`, ...) and rebinds
`MixedPrecision` and `ChannelsLast`, so the same case code exercises clfast's versions. The two runs need separate
processes because clfast's patches cannot be undone. `tests/test_fastai_port.py` compares them.

Case names are `<notebook>/<check>[<learner>]`. Learners: `synth` is fastai's `synth_learner` (the notebooks' own);
`conv` is a tiny conv net on 3x8x8 images set up with `learn.to_channelslast()` (or `to_fp16()`) in both runs, so the
stock run uses fastai's callbacks and the clfast run clfast's. Cases registered with `only='stock'`/`only='clfast'`
pin down a behaviour where clfast deliberately differs from fastai (each is paired with its counterpart).
"""
import sys, io, json, math, tempfile, time, traceback, warnings, contextlib
from functools import partial
from pathlib import Path

MODE = sys.argv[1] if len(sys.argv) > 1 else 'stock'
assert MODE in ('stock', 'clfast'), f"mode must be 'stock' or 'clfast', not {MODE!r}"

import torch
from torch import nn
from torch.utils.data import TensorDataset
import torch.nn.functional as F
from fastai.vision.all import *
from fastai.test_utils import synth_learner, synth_dbunch
from fastai.callback.training import ShortEpochCallback, GradientAccumulation, GradientClip, BnFreeze
from fastai.callback.fp16 import (AMPMode, get_master, to_master_grads, to_model_params, test_overflow, grad_overflow,
                                  NonNativeMixedPrecision)
from fastai.fp16_utils import convert_network
import fastai.callback.fp16 as fastai_fp16
import fastai.callback.channelslast as fastai_cl

if MODE == 'clfast':
    from clfast.all import *   # rebinds MixedPrecision and ChannelsLast, patches Learner
    from clfast.all import ClfastWarning, resolve_amp

torch.set_num_threads(1)   # tiny models: threads only contend on the shared cores (and with the other run)
CUDA = torch.cuda.is_available()
CASES = {}

def case(notebook, kinds=(None,), only=None, cuda=False):
    "Register a check ported from `notebook`, once per learner kind; `only` runs it in one mode, `cuda` needs a GPU"
    def register(f):
        for kind in kinds:
            name = f"{notebook}/{f.__name__}" + (f"[{kind}]" if kind else '')
            CASES[name] = (partial(f, kind) if kind else f, only, cuda)
        return f
    return register

# ---------------------------------------------------------------------------------------------------------------
# Learners and probes

def conv_dbunch(bs=16, n_train=10, n_valid=2, size=8, device=None):
    "Like fastai's `synth_dbunch` with 3xHxW images: y = 2*mean(x) + 3 + noise"
    def get_data(n):
        x = torch.randn(bs*n, 3, size, size)
        return TensorDataset(x, 2*x.mean((1, 2, 3))[:, None] + 3 + 0.1*torch.randn(bs*n, 1))
    return DataLoaders(TfmdDL(get_data(n_train), bs=bs, shuffle=True, num_workers=0),
                       TfmdDL(get_data(n_valid), bs=bs, num_workers=0), device=device)

def exportable_dbunch(kind, bs=16, n_train=10, n_valid=2):
    "The same data in fastai `Datasets`, which `Learner.export` needs (it empties them with `new_empty`)"
    n = bs*(n_train + n_valid)
    x = torch.randn(n, 1) if kind == 'synth' else torch.randn(n, 3, 8, 8)
    y = 2*x.mean(tuple(range(1, x.dim())))[:, None] + 3 + 0.1*torch.randn(n, 1)
    dsets = Datasets(list(zip(x, y)), tfms=[[ItemGetter(0)], [ItemGetter(1)]], splits=(range(bs*n_train), range(bs*n_train, n)))
    return dsets.dataloaders(bs=bs, num_workers=0)

def conv_body(bn=True):
    layers = [nn.Conv2d(3, 8, 3, padding=1, bias=not bn)] + ([nn.BatchNorm2d(8)] if bn else []) + [nn.ReLU()]
    return nn.Sequential(*layers)

def conv_model(bn=True):
    return nn.Sequential(conv_body(bn), nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 1)))

def conv_learner(bn=True, data=None, lr=1e-3, setup='to_channelslast', **kwargs):
    "A conv `synth_learner`; `setup` (a name or a function of the learner) calls the `Learner` methods that prepare it"
    learn = Learner(data or conv_dbunch(), conv_model(bn), lr=lr, loss_func=MSELossFlat(),
                    opt_func=partial(SGD, mom=0.9), **kwargs)
    if callable(setup): setup(learn)
    elif setup == 'to_channelslast': learn.to_channelslast()
    elif setup == 'to_channelslast_fp32': learn.to_channelslast(use_amp=False)
    elif setup == 'to_fp16': learn.to_fp16()
    return learn

def make_learner(kind, exportable=False, **kwargs):
    "The learner a two-kind case runs on: fastai's `synth_learner` as in the notebooks, or the conv one"
    if exportable: kwargs['data'] = exportable_dbunch(kind)
    if kind == 'synth': return synth_learner(**kwargs)
    return conv_learner(**kwargs)

def same_state(a, b) -> bool:
    "Equal nested optimizer state dicts (fastai's `test_eq` cannot compare lists of multi-element tensors)"
    if isinstance(a, torch.Tensor): return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict): return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple, L)): return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b

def amp_cbs(learn): return [cb for cb in learn.cbs if isinstance(cb, (MixedPrecision, fastai_fp16.MixedPrecision))]
def cl_cbs(learn):  return [cb for cb in learn.cbs if isinstance(cb, (ChannelsLast, fastai_cl.ChannelsLast))]
def conv_weights(model): return [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
def is_cl(t): return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()

class CountBatches(Callback):
    "How many train and valid batches ran"
    def before_fit(self): self.n_train = self.n_valid = 0
    def after_batch(self):
        if self.training: self.n_train += 1
        else:             self.n_valid += 1

class PredDtype(Callback):
    "The dtype of the predictions before `MixedPrecision.after_pred` casts them back to fp32"
    order = MixedPrecision.order - 1
    def before_fit(self): self.dtypes = set()
    def after_pred(self): self.dtypes |= {t.dtype for t in L(self.pred) if isinstance(t, torch.Tensor)}

def valid_loss_dropped(learn):
    "The notebooks' check that training worked: the last epoch's valid loss (last column) is below the first's"
    losses = [v[-1] for v in learn.recorder.values]
    assert losses[-1] < losses[0], f"valid loss did not decrease: {losses}"

def two_linear(learn):
    "The notebooks' two-layer model with SGD without momentum and one parameter group per layer"
    learn.model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    learn.opt_func = partial(SGD, mom=0.)
    learn.splitter = lambda m: [list(m[0].parameters()), list(m[1].parameters())]
    return learn

# ---------------------------------------------------------------------------------------------------------------
# Which library the run is testing: a harness that imported clfast in the stock run would compare clfast with itself

@case('harness', only='stock')
def stock_run_has_no_clfast():
    assert 'clfast' not in sys.modules
    assert Learner.to_channelslast.__module__ == 'fastai.callback.channelslast' and MixedPrecision is fastai_fp16.MixedPrecision

@case('harness', only='clfast')
def clfast_run_uses_clfast():
    assert Learner.to_channelslast.__module__ == 'clfast.callback' and Learner.to_fp16.__module__ == 'clfast.amp'
    assert MixedPrecision.__module__ == 'clfast.amp' and ChannelsLast.__module__ == 'clfast.callback'

# ---------------------------------------------------------------------------------------------------------------
# 18_callback.fp16

NB_FP16 = '18_callback.fp16'

@case(NB_FP16)
def overflow_detection():
    x = torch.randn(3, 4)
    assert not test_overflow(x)
    for bad in (float('inf'), float('-inf'), float('nan')):
        y = x.clone(); y[1, 2] = bad
        assert test_overflow(y), bad
    p1, p2 = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    p1.grad, p2.grad = torch.ones(2), torch.ones(3)
    assert not grad_overflow([[p1], [p2]])
    p2.grad[0] = float('inf')
    assert grad_overflow([[p1], [p2]])

@case(NB_FP16)
def convert_network_keeps_batchnorm_fp32():
    for bn in (nn.BatchNorm1d(30), BatchNorm(30, ndim=1)):
        model = convert_network(nn.Sequential(nn.Linear(10, 30), bn, nn.Linear(30, 2)), torch.float16)
        for layer, dtype in zip(model, (torch.float16, torch.float32, torch.float16)):
            assert layer.weight.dtype == dtype and layer.bias.dtype == dtype, (layer, layer.weight.dtype)

@case(NB_FP16)
def master_params_copy_grads_and_values():
    "CPU part of the #cuda cells on get_master / to_master_grads / to_model_params"
    learn = two_linear(synth_learner())
    learn.model = convert_network(learn.model, torch.float16)
    learn.opt = learn.opt_func(learn.splitter(learn.model), learn.lr)
    for flat in (False, True):
        model_p, master_p = get_master(learn.opt, flat_master=flat)
        assert len(model_p) == len(master_p) == 2   # two parameter groups
        for pg, mg in zip(model_p, master_p):
            assert all(p.dtype == torch.float16 for p in pg)
            masters = list(mg[0]) if flat else mg
            if flat: assert len(mg) == 1            # one flattened fp32 tensor per group
            assert all(m.dtype == torch.float32 for m in masters)
            test_close(torch.cat([p.float().flatten() for p in pg]), torch.cat([m.flatten() for m in masters]))
        for pg in model_p:
            for p in pg: p.grad = torch.full_like(p, 0.5)
        to_master_grads(model_p, master_p, flat_master=flat)
        for mg in master_p:
            for m in mg: test_close(m.grad, torch.full_like(m, 0.5))
        with torch.no_grad():
            for mg in master_p:
                for m in mg: m.sub_(0.25)
        to_model_params(model_p, master_p, flat_master=flat)
        for pg, mg in zip(model_p, master_p):
            test_close(torch.cat([p.float().flatten() for p in pg]), torch.cat([m.detach().flatten() for m in mg]), eps=1e-3)

@case(NB_FP16)
def mixed_precision_trains():
    "CPU part of the #cuda training cell: a learner with `MixedPrecision` trains"
    set_seed(99, True)
    learn = two_linear(synth_learner(cbs=MixedPrecision))
    learn.fit(3)
    valid_loss_dropped(learn)

@case(NB_FP16)
def mixed_precision_multi_output_trains():
    "CPU part of the #cuda multi-output cell: predictions that are a tuple go through `MixedPrecision`"
    set_seed(99, True)
    class MultiOutput(Module):
        def __init__(self): self.linear1, self.linear2 = nn.Linear(1, 1), nn.Linear(1, 1)
        def forward(self, x): return self.linear1(x), self.linear2(x)
    learn = synth_learner(cbs=MixedPrecision)
    learn.model, learn.opt_func = MultiOutput(), partial(SGD, mom=0.)
    learn.splitter = lambda m: [list(m.linear1.parameters()), list(m.linear2.parameters())]
    learn.loss_func = lambda pred, y: ((y - pred[0]).abs() + 0.5*(y - pred[1]).abs()).sum()
    learn.fit(3)
    valid_loss_dropped(learn)

@case(NB_FP16)
def bf16_mixed_precision_trains():
    "CPU part of the #cuda bf16 cell"
    set_seed(99, True)
    learn = two_linear(synth_learner(cbs=MixedPrecision(amp_mode=AMPMode.BF16)))
    learn.fit(3)
    valid_loss_dropped(learn)

@case(NB_FP16, cuda=True)
def mixed_precision_predicts_half_on_cuda():
    "The #cuda cells: under `MixedPrecision` the model predicts in fp16 (bf16 with amp_mode='bf16') and trains"
    for mode, dtype in ((AMPMode.FP16, torch.float16), (AMPMode.BF16, torch.bfloat16)):
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(): continue
        set_seed(99, True)
        learn = two_linear(synth_learner(cbs=[MixedPrecision(amp_mode=mode), PredDtype()], cuda=True))
        learn.fit(3)
        assert learn.pred_dtype.dtypes == {dtype}, learn.pred_dtype.dtypes
        valid_loss_dropped(learn)

@case(NB_FP16)
def to_fp16_to_bf16_to_fp32():
    learn = synth_learner()
    learn.to_fp16()
    assert learn.mixed_precision.amp_mode == AMPMode.FP16 and len(amp_cbs(learn)) == 1
    learn.to_fp32()
    assert not amp_cbs(learn) and not hasattr(learn, 'mixed_precision')
    learn.to_bf16()
    assert learn.mixed_precision.amp_mode == AMPMode.BF16 and len(amp_cbs(learn)) == 1
    learn.to_fp32()
    assert not amp_cbs(learn)

@case(NB_FP16)
def to_fp16_passes_gradscaler_kwargs():
    learn = synth_learner().to_fp16(init_scale=1024, growth_interval=7)
    assert learn.mixed_precision.kwargs['init_scale'] == 1024 and learn.mixed_precision.kwargs['growth_interval'] == 7

@case(NB_FP16, only='stock')
def cpu_mixed_precision_is_a_noop_with_a_warning():
    "fastai's `MixedPrecision` autocasts on CUDA only: with CPU batches the model computes in fp32"
    if CUDA: return   # with a GPU present autocast('cuda') is enabled (and still leaves CPU ops alone)
    learn = two_linear(synth_learner(cbs=[MixedPrecision, PredDtype()]))
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        learn.fit(1)
    assert learn.pred_dtype.dtypes == {torch.float32}
    assert any('CUDA is not available' in str(w.message) for w in ws), [str(w.message) for w in ws]

@case(NB_FP16, only='clfast')
def cpu_mixed_precision_autocasts_or_says_why_not():
    "clfast autocasts on the CPU in the fastest of fp16/bf16 measured here, else trains fp32 with a ClfastWarning"
    learn = two_linear(synth_learner(cbs=[MixedPrecision, PredDtype()]))
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        learn.fit(1)
    dtype, _, why = resolve_amp('cpu', AMPMode.FP16)
    assert learn.mixed_precision.dtype == dtype
    assert learn.pred_dtype.dtypes == {dtype}, (learn.pred_dtype.dtypes, dtype)   # nn.Linear runs in the autocast dtype
    clfast_warnings = [str(w.message) for w in ws if issubclass(w.category, ClfastWarning)]
    if dtype == torch.float16: assert not clfast_warnings, clfast_warnings
    else: assert why and why in clfast_warnings, (why, clfast_warnings)
    assert not any('CUDA is not available' in str(w.message) for w in ws)

@case(NB_FP16, only='stock')
def to_fp16_twice_stacks_two_callbacks():
    "fastai's `to_fp16` adds a callback every call"
    learn = synth_learner().to_fp16().to_fp16()
    assert len(amp_cbs(learn)) == 2
    learn.to_bf16()
    assert len(amp_cbs(learn)) == 3

@case(NB_FP16, only='clfast')
def to_fp16_twice_keeps_one_callback():
    "clfast keeps one `MixedPrecision`: the last `to_fp16`/`to_bf16` replaces the attached one"
    learn = synth_learner().to_fp16().to_fp16()
    assert len(amp_cbs(learn)) == 1
    learn.to_bf16()
    assert len(amp_cbs(learn)) == 1 and learn.mixed_precision.amp_mode == AMPMode.BF16

@case(NB_FP16, only='stock')
def two_mixed_precision_callbacks_train():
    learn = conv_learner(setup=None, cbs=[ChannelsLast(), MixedPrecision(), MixedPrecision()])
    learn.fit(1)

@case(NB_FP16, only='clfast')
def two_mixed_precision_callbacks_refused():
    "Two `MixedPrecision` would scale the loss twice and nest autocast: clfast's `ChannelsLast` refuses to fit"
    learn = conv_learner(setup=None, cbs=[ChannelsLast(), MixedPrecision(), MixedPrecision()])
    try: learn.fit(1)
    except ValueError as e: assert 'MixedPrecision callbacks' in str(e), e
    else: raise AssertionError("fit with two MixedPrecision callbacks did not raise")

@case(NB_FP16, cuda=True)
def non_native_mixed_precision_trains_on_cuda():
    "The #cuda `to_non_native_fp16` cells: fp16 model during fit, fp32 after, and it trains"
    set_seed(99, True)
    learn = two_linear(synth_learner(cuda=True))
    learn.model.cuda()
    learn.to_non_native_fp16()
    class HalfDuringFit(Callback):
        order = NonNativeMixedPrecision.order + 1
        def before_batch(self): assert first(self.model.parameters()).dtype == torch.float16
    learn.fit(3, lr=1e-2, cbs=HalfDuringFit())
    assert first(learn.model.parameters()).dtype == torch.float32
    valid_loss_dropped(learn)
    learn.to_non_native_fp32()
    assert not hasattr(learn, 'non_native_mixed_precision')

# ---------------------------------------------------------------------------------------------------------------
# 18a_callback.training

NB_TRAIN = '18a_callback.training'
KINDS = ('synth', 'conv')

@case(NB_TRAIN, KINDS)
def short_epoch_cancels_train_and_valid(kind):
    learn, count = make_learner(kind), CountBatches()
    learn.fit(1, cbs=[ShortEpochCallback(), count])
    assert count.n_train < len(learn.dls.train), count.n_train
    assert list(learn.recorder.values[-1]) == []   # neither a train nor a valid loss was logged

@case(NB_TRAIN, KINDS)
def short_epoch_full_validation(kind):
    learn, count = make_learner(kind), CountBatches()
    learn.fit(1, cbs=[ShortEpochCallback(short_valid=False), count])
    assert count.n_train < len(learn.dls.train)
    assert count.n_valid == len(learn.dls.valid)
    assert len(learn.recorder.values[-1]) == 1     # the valid loss only

class GetGrads(Callback):
    run_valid, order = False, GradientAccumulation.order + 1
    def before_step(self): self.grads = to_detach(L([p.grad.clone() for p in self.model.parameters()]))

def _accumulated(kind, bs, n, cbs=None, setup='to_channelslast_fp32'):
    "Train one epoch of `n` batches of `bs`; the final train and valid losses and the last step's gradients"
    with no_random(99):
        if kind == 'synth': learn = synth_learner(data=synth_dbunch(bs=bs, n_train=n, n_valid=n), cbs=[GetGrads] + L(cbs))
        else: learn = conv_learner(bn=False, data=conv_dbunch(bs=bs, n_train=n, n_valid=n), cbs=[GetGrads] + L(cbs), setup=setup)
        learn.fit(1, lr=0.01)
    train, valid = learn.recorder.values[-1]
    return train, valid, learn.get_grads.grads

@case(NB_TRAIN, KINDS)
def gradient_accumulation_matches_one_big_batch(kind):
    "8 batches of 1 accumulated to 8 give the gradients of one batch of 8: same grads and valid loss, other train loss"
    train1, valid1, grads1 = _accumulated(kind, 8, 1)
    train2, valid2, grads2 = _accumulated(kind, 1, 8, GradientAccumulation(n_acc=8))
    test_close(grads2, grads1, eps=1e-4)
    test_close(valid2, valid1, eps=1e-4)
    test_ne(train2, train1)

@case(NB_TRAIN, KINDS)
def gradient_accumulation_with_mixed_precision(kind):
    "CPU part of the #cuda cell: the same with `MixedPrecision(init_scale=1024)` (conv: `to_channelslast`'s fp16)"
    cb = [MixedPrecision(init_scale=1024)] if kind == 'synth' else []   # one instance for both runs, as the notebook
    # GetGrads records the loss-scaled gradients (it runs before MixedPrecision unscales them): a loss scale of 16 keeps
    # the conv's fp16 backward finite where a CPU autocasts in fp16 (1024 overflows it, and the step would be skipped)
    setup = (lambda learn: learn.to_channelslast(init_scale=16)) if kind == 'conv' else None
    train1, valid1, grads1 = _accumulated(kind, 8, 1, cb, setup=setup)
    train2, valid2, grads2 = _accumulated(kind, 1, 8, [GradientAccumulation(n_acc=8)] + cb, setup=setup)
    # the notebook's eps=0.01 (fp16 on CUDA), relative too: where clfast autocasts the conv on a CPU it may be in bf16
    for g2, g1 in zip(grads2, grads1): assert torch.allclose(g2, g1, rtol=0.02, atol=0.01), (g2, g1)
    test_close(valid2, valid1, eps=1e-2)
    test_ne(train2, train1)

@case(NB_TRAIN, KINDS)
def gradient_accumulation_beyond_the_epoch_never_steps(kind):
    "With more items to accumulate than the epoch has, no step happens: weights and valid loss unchanged"
    learn = make_learner(kind, bn=False) if kind == 'conv' else make_learner(kind)   # BatchNorm would move without a step
    before_loss = learn.validate()[0]
    before = [p.detach().clone() for p in learn.model.parameters()]
    learn.fit(1, lr=0.01, cbs=GradientAccumulation(n_acc=1000))
    for b, p in zip(before, learn.model.parameters()): test_eq(b, p.detach())
    test_close(learn.recorder.values[-1][1], before_loss, eps=1e-5)

def _high_lr_run(cbs):
    set_seed(99)
    learn = synth_learner(lr=1.1, cuda=True)
    learn.fit(3, cbs=cbs)
    return [v[1] for v in learn.recorder.values]

@case(NB_TRAIN)
def gradient_clip_avoids_divergence():
    "lr=1.1 diverges even under `MixedPrecision`; `GradientClip` keeps the loss down"
    fp16 = MixedPrecision()   # one instance in both fits, as the notebook does
    diverged = _high_lr_run(fp16)
    clipped = _high_lr_run([GradientClip, fp16])
    assert diverged[-1] > diverged[0], diverged
    assert clipped[-1] < clipped[0] and clipped[-1] < diverged[-1] / 100, (clipped, diverged)

class GradNorms(Callback):
    "The total gradient norm the optimizer steps with (after `GradientClip`)"
    order = GradientClip.order + 1
    def before_fit(self): self.norms = []
    def before_step(self):
        self.norms.append(torch.norm(torch.stack([p.grad.norm() for p in self.model.parameters() if p.grad is not None])).item())

@case(NB_TRAIN, KINDS)
def gradient_clip_bounds_the_step_norm(kind):
    learn, norms = make_learner(kind, lr=1.1 if kind == 'synth' else 0.5), GradNorms()
    learn.fit(1, cbs=[GradientClip(max_norm=0.5), norms])
    assert norms.norms and max(norms.norms) <= 0.5 * (1 + 1e-4), norms.norms

def _bn_freeze_learner(cbs=None, setup='to_channelslast', fuse=False):
    "The notebook's `cnn_learner(..., train_bn=False)` in small: a conv-BN body, a head, the body frozen"
    learn = conv_learner(bn=True, setup=None, train_bn=False, splitter=lambda m: [params(m[0]), params(m[1])], cbs=cbs)
    if fuse: learn.to_channelslast(use_amp=False, fuse=fuse)
    elif setup == 'to_channelslast': learn.to_channelslast()
    learn.freeze()
    bn = learn.model[0][1]
    return learn, bn

@case(NB_TRAIN)
def bn_freeze_keeps_frozen_batchnorm_statistics():
    learn, bn = _bn_freeze_learner()
    mean = bn.running_mean.clone()
    learn.fit(1, lr=0.02)
    test_ne(bn.running_mean, mean)        # train_bn=False alone still updates the running statistics
    learn, bn = _bn_freeze_learner(cbs=BnFreeze)
    mean, var = bn.running_mean.clone(), bn.running_var.clone()
    learn.fit(1, lr=0.02)
    test_eq(bn.running_mean, mean)
    test_eq(bn.running_var, var)

@case(NB_TRAIN, only='clfast')
def bn_freeze_with_fused_conv_bn():
    "clfast's fused conv-BN (to_channelslast(fuse='speed')) honours BnFreeze as BatchNorm2d does"
    learn, bn = _bn_freeze_learner(fuse='speed')
    assert is_fused(learn.model)
    mean = bn.running_mean.clone()
    learn.fit(1, lr=0.02)
    test_ne(bn.running_mean, mean)
    learn, bn = _bn_freeze_learner(cbs=BnFreeze, fuse='speed')
    mean, var = bn.running_mean.clone(), bn.running_var.clone()
    learn.fit(1, lr=0.02)
    test_eq(bn.running_mean, mean)
    test_eq(bn.running_var, var)

# ---------------------------------------------------------------------------------------------------------------
# 18c_callback.channelslast

NB_CL = '18c_callback.channelslast'

class ChannelsLastTest(Callback):
    "Asserts that predictions are in channels last format"
    order = MixedPrecision.order - 1
    def after_pred(self): assert self.pred.is_contiguous(memory_format=torch.channels_last), "prediction isn't channels last"

def _images_only_dbunch(bs=16, n_train=2, n_valid=2, cuda=False):
    "The notebook's data: images and no targets (so no loss is computed)"
    get = lambda n: TensorDataset(TensorImage(torch.randn(bs*n, 3, 32, 32)))
    return DataLoaders(TfmdDL(get(n_train), bs=bs, shuffle=True, num_workers=0), TfmdDL(get(n_valid), bs=bs, num_workers=0),
                       device=default_device() if cuda else None)

def _channels_last_prediction(cuda):
    with no_random():
        learn = synth_learner(cbs=[MixedPrecision, ChannelsLast, ChannelsLastTest], cuda=cuda, data=_images_only_dbunch(cuda=cuda))
        class ConvModel(Module):
            def __init__(self): self.conv = nn.Conv2d(3, 32, 1)
            def forward(self, x): return self.conv(x)
        learn.model, learn.opt_func, learn.loss_func = ConvModel(), partial(SGD, mom=0.), lambda *a: None
        learn.fit(3)

@case(NB_CL)
def model_predicts_channels_last():
    "CPU part of the #cuda cell"
    _channels_last_prediction(cuda=False)

@case(NB_CL, cuda=True)
def model_predicts_channels_last_on_cuda():
    _channels_last_prediction(cuda=True)

@case(NB_CL)
def to_channelslast_adds_channels_last_and_mixed_precision():
    learn = conv_learner(setup=None)
    learn.to_channelslast()
    assert len(cl_cbs(learn)) == 1 and len(amp_cbs(learn)) == 1
    assert AMPMode(learn.mixed_precision.amp_mode) == AMPMode.FP16
    learn = conv_learner(setup=None)
    learn.to_channelslast(amp_mode='bf16')
    assert AMPMode(learn.mixed_precision.amp_mode) == AMPMode.BF16
    learn = conv_learner(setup=None)
    learn.to_channelslast(use_amp=False)
    assert len(cl_cbs(learn)) == 1 and not amp_cbs(learn)

@case(NB_CL)
def to_channelslast_keeps_one_of_each():
    "After `to_fp16`, and when called twice, there is still one `ChannelsLast` and one `MixedPrecision`"
    learn = conv_learner(setup='to_fp16')
    learn.to_channelslast()
    learn.to_channelslast()
    assert len(cl_cbs(learn)) == 1 and len(amp_cbs(learn)) == 1

@case(NB_CL)
def fit_makes_the_model_channels_last_and_trains():
    set_seed(99)
    learn = conv_learner(lr=1e-2)
    learn.fit(3)
    assert all(is_cl(w) for w in conv_weights(learn.model))
    valid_loss_dropped(learn)

@case(NB_CL)
def to_contiguous_undoes_to_channelslast():
    learn = conv_learner()
    learn.fit(1)
    learn.to_contiguous()
    assert not cl_cbs(learn) and len(amp_cbs(learn)) == 1
    assert all(w.is_contiguous() for w in conv_weights(learn.model))
    learn.to_channelslast().to_contiguous(to_fp32=True)
    assert not cl_cbs(learn) and not amp_cbs(learn)

class ModelInput(Callback):
    "The batch the model receives, after ChannelsLast (order -1) has run"
    order = 0
    def before_fit(self): self.inputs = []
    def before_batch(self): self.inputs.append(self.learn.xb[0])

@case(NB_CL, only='stock')
def batches_left_contiguous():
    "fastai converts only the model: PyTorch's conv picks the channels-last format up from the weights"
    learn = conv_learner(cbs=ModelInput())
    learn.fit(1)
    assert learn.model_input.inputs and all(x.is_contiguous() for x in learn.model_input.inputs)

@case(NB_CL, only='clfast')
def batches_converted_to_channels_last():
    "clfast also converts every batch's image tensors, so the first conv gets channels-last input"
    learn = conv_learner(cbs=ModelInput())
    learn.fit(1)
    assert learn.model_input.inputs and all(is_cl(x) for x in learn.model_input.inputs)

def _exported_conv_weights():
    learn = conv_learner(data=exportable_dbunch('conv'))
    learn.fit(1)
    with tempfile.TemporaryDirectory() as d:
        learn.path = Path(d)
        learn.export('export.pkl')
        exported = torch.load(Path(d)/'export.pkl', weights_only=False)
    return conv_weights(learn.model), conv_weights(exported.model)

@case(NB_CL, only='stock')
def export_writes_channels_last_weights():
    live, exported = _exported_conv_weights()
    assert all(is_cl(w) for w in live) and all(is_cl(w) for w in exported)

@case(NB_CL, only='clfast')
def export_writes_contiguous_weights():
    "clfast's export writes the weights contiguous (loadable anywhere) and leaves the live model channels-last"
    live, exported = _exported_conv_weights()
    assert all(is_cl(w) for w in live) and all(w.is_contiguous() for w in exported)

# ---------------------------------------------------------------------------------------------------------------
# 13a_learner: save / load / export / load_learner

NB_LEARNER = '13a_learner'

def _same_params(a, b):
    for p, q in zip(a.model.parameters(), b.model.parameters()): test_eq(p, q)

@case(NB_LEARNER, KINDS)
def save_then_load_restores_model_and_optimizer(kind):
    with tempfile.TemporaryDirectory() as d:
        learn = make_learner(kind, path=d)
        learn.fit(1)
        file = learn.save('tmp')
        assert (Path(d)/'models/tmp.pth').exists() and file == Path(d)/'models/tmp.pth'
        learn1 = make_learner(kind, path=d).load('tmp')
        _same_params(learn, learn1)
        assert same_state(learn.opt.state_dict(), learn1.opt.state_dict())
        learn1.fit(1)   # and it trains on from there

@case(NB_LEARNER, KINDS)
def save_without_optimizer(kind):
    with tempfile.TemporaryDirectory() as d:
        learn = make_learner(kind, path=d)
        learn.fit(1)
        learn.save('tmp', with_opt=False)
        learn1 = make_learner(kind, path=d).load('tmp', with_opt=False)
        _same_params(learn, learn1)
        assert not same_state(learn.opt.state_dict(), learn1.opt.state_dict())
        with warnings.catch_warnings(record=True) as ws:   # asking for the optimizer state it does not have
            warnings.simplefilter('always')
            make_learner(kind, path=d).load('tmp')
        assert any("doesn't contain an optimizer state" in str(w.message) for w in ws)

@case(NB_LEARNER, KINDS)
def export_leaves_the_learner_as_it_was(kind):
    with tempfile.TemporaryDirectory() as d:
        learn = make_learner(kind, exportable=True, path=d)
        learn.fit(1)
        dls, state = learn.dls, learn.opt.state_dict()
        learn.export()
        assert (Path(d)/'export.pkl').exists()
        assert learn.dls is dls
        assert same_state(learn.opt.state_dict(), state)
        learn.fit(1)

@case(NB_LEARNER, KINDS)
def load_learner_predicts_as_the_exported_one(kind):
    with tempfile.TemporaryDirectory() as d:
        learn = make_learner(kind, exportable=True, path=d)
        learn.fit(1)
        learn.export('learn.pkl')
        learn1 = load_learner(Path(d)/'learn.pkl')
    x = learn.dls.valid.one_batch()[0]
    learn.model.eval(); learn1.model.eval()
    with torch.no_grad(): test_close(learn1.model(x), learn.model(x), eps=1e-5)
    assert learn1.dls.device in (None, torch.device('cpu'))
    # cpu=True drops what needs an accelerator: MixedPrecision, and with it ChannelsLast
    assert not amp_cbs(learn1) and not cl_cbs(learn1)
    assert all(w.is_contiguous() for w in conv_weights(learn1.model))
    preds, targs = learn1.get_preds(dl=learn.dls.valid)
    with torch.no_grad(): expected = torch.cat([learn.model(xb) for xb, _ in learn.dls.valid])   # fp32, as learn1 predicts
    test_close(preds, expected, eps=1e-5)

# ---------------------------------------------------------------------------------------------------------------

def run_case(f, only, cuda):
    if only and only != MODE: return f"skip: {only} only"
    if cuda and not CUDA: return "skip: needs CUDA"
    torch.manual_seed(0)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter('ignore')
            f()
        return 'pass'
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        return f"fail: {type(e).__name__}: {e} ({Path(where.filename).name}:{where.lineno})"[:600]

if __name__ == '__main__':
    only = sys.argv[3:]   # optional case names, for debugging one case
    results = {}
    for name, spec in CASES.items():
        if only and name not in only: continue
        start = time.perf_counter()
        results[name] = run_case(*spec)
        print(f"{time.perf_counter() - start:6.2f}s {name}: {results[name][:80]}", file=sys.stderr)
    out = json.dumps({'mode': MODE, 'cuda': CUDA, 'results': results}, indent=1)
    if len(sys.argv) > 2 and sys.argv[2] != '-': Path(sys.argv[2]).write_text(out)
    else: print(out)
