"""CUDA graphs (`CudaGraphs`, `to_channelslast(graphs=True)`) and `to_channelslast(compile=...)`: the switches and the
fallbacks everywhere; capture, replay and the numerics of a replayed step on a CUDA GPU"""
import math, warnings
import pytest, torch
from torch import nn
from fastai.vision.all import Learner, CrossEntropyLossFlat, Adam, Callback, set_seed
from clfast.all import *
from clfast.core import ClfastWarning, is_compiled
from clfast.graphs import GraphedForward, not_graphable, WARM_STEPS, MAX_SHAPES, MEASURED_WARM, MEASURED_REPLAYS
from clfast.finder import Setup, BASELINE
from helpers import image_dls, conv_net, tiny_learner

def _fit(learn, *cbs, epochs=1):
    with learn.no_logging(), learn.no_bar(): learn.fit(epochs, 1e-3, cbs=list(cbs))

def _clfast_warnings(rec): return [str(w.message) for w in rec if issubclass(w.category, ClfastWarning)]

def test_cpu_model_trains_eagerly_and_says_why_once():
    "graphs=True (or 'if_faster') on a CPU learner: one message, then the same training as without it (bit for bit), nothing left behind"
    params = []
    for graphs in (False, True, 'if_faster'):
        set_seed(0)
        learn = tiny_learner().to_channelslast(use_amp=False, graphs=graphs)
        set_seed(1)   # after any probe that drew random numbers: the same shuffles either way
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter('always')
            _fit(learn, epochs=2)
        said = [m for m in _clfast_warnings(rec) if m.startswith('CudaGraphs')]
        assert said == ([] if not graphs else
                        ["CudaGraphs: CUDA graphs need a model on a CUDA GPU, and this one is on cpu; training eagerly."])
        assert 'forward' not in learn.model.__dict__
        params.append([p.detach().clone() for p in learn.model.parameters()])
    for p in params[1:]:
        for a, b in zip(params[0], p): assert torch.equal(a, b)
    assert learn.cuda_graphs.captured == 0 and learn.cuda_graphs.measured is None   # nothing measured: no graph

def test_the_last_steps_autograd_graph_is_let_go_before_each_step():
    """fastai keeps a step's pred and loss, and with them its autograd graph (which holds the parameters' gradient
    accumulators), until the next step replaces them; with CudaGraphs they are let go of before each step, so that a
    capture's backward never reaches an accumulator made on the eager steps' stream (on a GPU: a failed capture)"""
    for graphs in (False, True):
        held = []
        class Look(Callback):
            order = 13   # after CudaGraphs (12)
            def before_batch(self):
                if self.training and self.iter > 0:
                    held.append([getattr(self.learn, n).grad_fn is not None for n in ('pred', 'loss', 'loss_grad')])
        learn = tiny_learner().to_channelslast(graphs=graphs)   # the default AMP
        with warnings.catch_warnings(): warnings.simplefilter('ignore'); _fit(learn, Look())
        assert held and all(h == [not graphs] * 3 for h in held), (graphs, held)

def test_switches():
    learn = tiny_learner()
    with pytest.raises(ValueError, match='choose one'): learn.to_channelslast(graphs=True, compile=True)
    with pytest.raises(ValueError, match=r'auto=True\) chooses'): learn.to_channelslast(auto=True, graphs=True)
    with pytest.raises(ValueError, match=r'auto=True\) chooses'): learn.to_channelslast(auto=True, compile=True)
    with pytest.raises(ValueError, match=r"graphs='False' must be True, False or 'if_faster'"): learn.to_channelslast(graphs='False')
    with pytest.raises(ValueError, match=r"graphs=2 must be True, False or 'if_faster'"): learn.to_channelslast(graphs=2)
    with pytest.raises(ValueError, match=r"use_amp='no' must be"): learn.to_channelslast(use_amp='no')
    with pytest.raises(ValueError, match=r"compile='yes': pass True, False"): learn.to_channelslast(compile='yes')
    with pytest.raises(ValueError, match=r"torch.compile has no argument 'modee'; it takes .*mode"):
        learn.to_channelslast(compile=dict(modee='max-autotune'))
    with pytest.raises(ValueError, match=r"GradScaler's init_scale='big' must be"): learn.to_channelslast(init_scale='big')
    assert not hasattr(learn, 'channels_last') and not hasattr(learn, 'mixed_precision')   # a refused call changes nothing
    assert not is_compiled(learn.model) and next(learn.model.parameters()).is_contiguous()
    learn.to_channelslast(graphs=True).to_channelslast(graphs=True)
    assert sum(isinstance(c, CudaGraphs) for c in learn.cbs) == 1 and not learn.cuda_graphs.if_faster
    learn.to_channelslast(graphs='if_faster')   # replaces the callback: one, measuring, with its longer warm-up
    assert sum(isinstance(c, CudaGraphs) for c in learn.cbs) == 1
    assert learn.cuda_graphs.if_faster and learn.cuda_graphs.warm == MEASURED_WARM
    learn.to_channelslast()                      # graphs=False: the callback goes
    assert not any(isinstance(c, CudaGraphs) for c in learn.cbs)
    learn.to_channelslast(graphs=True).to_contiguous()
    assert not any(isinstance(c, CudaGraphs) for c in learn.cbs)

def test_counts_that_would_capture_nothing_are_refused_before_a_step():
    "CudaGraphs' counts checked where they are given and where a fit starts (set on the callback since), not at a capture"
    with pytest.raises(ValueError, match=r'max_graphs=0 would capture nothing'): CudaGraphs(max_graphs=0)
    with pytest.raises(ValueError, match=r'warm=-1 must be'): CudaGraphs(warm=-1)
    with pytest.raises(ValueError, match=r'max_graphs=1.5'): GraphedForward(conv_net(), max_graphs=1.5)
    learn = tiny_learner().to_channelslast(graphs=True)
    before = [p.detach().clone() for p in learn.model.parameters()]
    learn.cuda_graphs.max_graphs = 0
    with pytest.raises(ValueError, match=r'max_graphs=0'): _fit(learn)
    assert all(torch.equal(a, b) for a, b in zip(before, learn.model.parameters()))   # not a step trained
    learn.cuda_graphs.max_graphs = 2
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); _fit(learn)
    assert len(learn.recorder.losses) > 0

def test_not_graphable_says_why():
    m = conv_net()
    assert not_graphable(m) is None
    assert 'DataParallel' in not_graphable(nn.DataParallel(m))
    h = m[1][0].register_forward_pre_hook(lambda mod, args: None)
    assert not_graphable(m) == "module 1.0 (Conv2d) has hooks, which a replayed graph would not call"
    h.remove()
    h = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)
    try: assert 'global module hooks' in not_graphable(m)
    finally: h.remove()
    m[0][1].momentum = None
    assert not_graphable(m) == "module 0.1 is a BatchNorm with momentum=None, which reads its step count on the host"
    m[0][1].momentum = 0.1
    assert 'compiled' in not_graphable(torch.compile(m))   # the usual `learn.model = torch.compile(m)`: it was let in
    m.compile()
    assert 'compiled' in not_graphable(m)

@pytest.fixture
def as_on_cuda(monkeypatch):
    """CudaGraphs puts its forward on a CPU model as on a CUDA one (this machine may have no GPU: what happens around
    the graphs is the same), with a warm-up no test reaches, so that every step runs eagerly through it"""
    import clfast.graphs
    monkeypatch.setattr(clfast.graphs, '_not_on_cuda', lambda model: None)
    return CudaGraphs(warm=10**6)

def _raises_between_batches(learn, exc):
    "A fit whose epoch raises `exc` after its batches (as a KeyboardInterrupt in the DataLoader's fetch would, between two)"
    class Boom(Callback):
        def after_epoch(self): raise exc('boom')
    with pytest.raises(exc): _fit(learn, Boom())

def test_a_fit_ended_between_batches_puts_the_models_forward_back(as_on_cuda):
    """A KeyboardInterrupt in the DataLoader's fetch, an `after_epoch` that raises: fastai calls no `after_fit`, and
    clfast's `one_batch` saw nothing: the model kept the graphs' forward for good, through later fits without the
    callback too. A forward set on the model itself before the fit (a library's patch) is the one put back, where the
    graphs' removal dropped it"""
    learn = tiny_learner().to_channelslast(use_amp=False)
    learn.add_cb(as_on_cuda)
    seen = []
    class Patched(Callback):
        def after_pred(self):
            if self.training: seen.append(isinstance(self.model.__dict__.get('forward'), GraphedForward))
    _fit(learn, Patched())
    assert seen and all(seen) and 'forward' not in learn.model.__dict__
    for exc in (KeyboardInterrupt, RuntimeError):
        _raises_between_batches(learn, exc)
        assert 'forward' not in learn.model.__dict__, exc
    patch = learn.model.forward = lambda x: type(learn.model).forward(learn.model, x) * 2
    _fit(learn)
    assert learn.model.__dict__['forward'] is patch
    _raises_between_batches(learn, KeyboardInterrupt)
    assert learn.model.__dict__['forward'] is patch

def test_inference_runs_neither_check_nor_reset_the_graphs(as_on_cuda):
    """fastai runs `validate`, `get_preds` and `summary` as fits without training (their `before_fit` and
    `after_fit`): they put no graphs on, say nothing (`summary`'s own hooks were said to stop the next fit's graphs,
    and that being said once, a real hook later was not) and keep the last fit's results"""
    learn = tiny_learner().to_channelslast(use_amp=False)
    learn.add_cb(as_on_cuda)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        _fit(learn)
        as_on_cuda.last_retried = ['a capture that failed once']   # as a GPU's fit may leave it
        with learn.no_bar():
            learn.summary(); learn.validate(); learn.get_preds()
    assert not [m for m in _clfast_warnings(rec) if m.startswith('CudaGraphs')], _clfast_warnings(rec)
    assert as_on_cuda.retried == ['a capture that failed once'] and 'forward' not in learn.model.__dict__
    learn.model[0][0].register_forward_hook(lambda *a: None)   # a hook now: said by the next fit
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        _fit(learn)
    said = [m for m in _clfast_warnings(rec) if m.startswith('CudaGraphs')]
    assert len(said) == 1 and said[0].startswith("CudaGraphs: module 0.0 (") and 'has hooks' in said[0], said   # (Conv2d, or the CPU guard's)

def test_validate_inside_a_fit_keeps_its_graphs(as_on_cuda):
    """A callback's `learn.validate()` inside a fit runs `before_fit` and `after_fit`: the graphs went for the rest of
    the fit (after_fit), silently"""
    learn = tiny_learner().to_channelslast(use_amp=False)
    learn.add_cb(as_on_cuda)
    on = []
    class ValidateEachEpoch(Callback):
        order = 60
        def before_train(self): on.append(isinstance(self.model.__dict__.get('forward'), GraphedForward))
        def after_train(self): self.learn.validate()   # (not after_epoch: validate's own exit calls that)
    _fit(learn, ValidateEachEpoch(), epochs=3)
    assert on == [True] * 3 and 'forward' not in learn.model.__dict__

def test_one_cudagraphs_at_a_time_and_its_settings_kept():
    """A second `CudaGraphs` (given to `fit` on a learner with one) would wrap the first's forward and capture its
    replays: refused before a step. `to_channelslast(graphs=...)` keeps an attached one's `max_graphs` (which its own
    message says to set) and its warm-up where it measures as asked"""
    learn = tiny_learner().to_channelslast(use_amp=False, graphs=True)
    graphs = learn.cuda_graphs
    with pytest.raises(ValueError, match='2 CudaGraphs callbacks are attached'): _fit(learn, CudaGraphs())
    assert 'forward' not in learn.model.__dict__ and graphs in learn.cbs
    with learn.added_cbs(CudaGraphs()), learn.no_bar():   # not `validate`'s: raised there, fastai's lock stayed held (a hang)
        for _ in range(2): learn.validate()
    assert not learn.lock.locked()
    graphs.max_graphs, graphs.warm = 3, 6
    learn.to_channelslast(use_amp=False, graphs=True)
    assert (learn.cuda_graphs.max_graphs, learn.cuda_graphs.warm, learn.cuda_graphs.if_faster) == (3, 6, False)
    learn.to_channelslast(use_amp=False, graphs='if_faster')   # another warm-up: the measuring one's
    assert (learn.cuda_graphs.max_graphs, learn.cuda_graphs.warm, learn.cuda_graphs.if_faster) == (3, MEASURED_WARM, True)
    assert sum(isinstance(c, CudaGraphs) for c in learn.cbs) == 1

def test_torch_compiles_wrapper_is_refused_where_clfast_would_compile_it():
    "`learn.model = torch.compile(m)`: `to_channelslast(compile=...)` can neither compile nor undo it in place: one clear error, nothing changed"
    learn = tiny_learner()
    learn.model = torch.compile(learn.model)
    for how in (True, False):
        with pytest.raises(ValueError, match=r'_orig_mod'): learn.to_channelslast(use_amp=False, compile=how)
        assert not hasattr(learn, 'channels_last')
    assert is_compiled(learn.to_channelslast(use_amp=False).model)

def test_graphed_forward_passes_cpu_calls_through():
    m = conv_net().train()
    g = GraphedForward(m, warm=0)
    x = torch.randn(2, 3, 8, 8)
    torch.manual_seed(0); out = g(x)
    assert out.shape == (2, 2) and g.graphs == {}
    m.eval()
    assert torch.equal(g(x), m(x))

def test_a_copy_or_pickle_of_a_graphed_model_gets_its_own_forward():
    """A copy or a pickle of the model made while it trains from graphs (an EMA callback's deepcopy, a checkpoint's
    torch.save) gets the model's own forward, bound to the copy, not the `GraphedForward` and its CUDA graphs"""
    import copy, io, pickle
    m = conv_net().train()
    m.forward = GraphedForward(m)
    x = torch.randn(2, 3, 8, 8)
    buf = io.BytesIO(); torch.save(m, buf); buf.seek(0)
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m)), torch.load(buf, weights_only=False)):
        assert not isinstance(c.__dict__.get('forward'), GraphedForward) and c.forward.__self__ is c
        m.eval(); c.eval()
        assert torch.equal(c(x), m(x))

def test_a_modules_mode_is_part_of_what_a_graph_depends_on():
    "A module switched to eval (or back) during a fit changes what a captured graph would run: a replay then captures again"
    from clfast.graphs import _depends_on, _changed
    m = conv_net().train()
    at = _depends_on(m)
    m[0][1].eval()
    assert _changed(at, _depends_on(m))
    m[0][1].train()
    assert not _changed(at, _depends_on(m))

@pytest.mark.parametrize('fuse', [False, 'speed'])
def test_a_fastai_step_changes_nothing_a_graph_depends_on(fuse):
    """A graph is captured again whenever what it depends on changes (`_depends_on`: module attributes by identity
    among it): fastai's training steps of a fused or stock timm model, with a scheduler, must change none of it, or
    every replay would capture again. And a hook registered meanwhile is a change (the capture then refuses it)"""
    import timm
    from clfast.graphs import _depends_on, _changed
    learn = Learner(image_dls(n=48, bs=8), timm.create_model('resnet18', num_classes=2, drop_path_rate=0.1),
                    loss_func=CrossEntropyLossFlat(), opt_func=Adam).to_channelslast(fuse=fuse)
    changes = []
    class Watch(Callback):
        order = 100
        def before_fit(self): self.then = None
        def after_step(self):
            now = _depends_on(self.model)
            if self.then is not None: changes.append(_changed(self.then, now))
            self.then = now
    with learn.no_logging(), learn.no_bar(): learn.fit_one_cycle(1, cbs=[Watch()])
    assert len(changes) >= 3 and not any(changes)
    then = _depends_on(learn.model)
    learn.model.layer1[0].conv1.register_forward_hook(lambda *a: None)
    assert _changed(then, _depends_on(learn.model))

def test_finder_graphed_setup_on_cpu_is_a_failed_row():
    "A graphed setup on a CPU model: its row says why, the others are measured"
    learn = tiny_learner()
    df = learn.format_find(setups=[BASELINE, Setup(graphs=True)], n_batches=2, show_plot=False)
    row = df.loc['channels-last fp32 graphs']
    assert row.steps == 0 and 'no CUDA graphs' in row.error and 'on cpu' in row.error
    assert df.loc['contiguous fp32', 'error'] == '' and df.loc['contiguous fp32', 'steps'] >= 1
    assert 'first_step_s' in df.columns and df.loc['contiguous fp32', 'first_step_s'] > 0

def _fp64_grads(model, xb, yb):
    "The exact (fp64) gradients of the loss at `model`'s current weights, BN in training mode on the batch"
    import copy
    ref = copy.deepcopy(model).double().to(memory_format=torch.contiguous_format)
    from clfast.fuse import unfuse_conv_bn
    unfuse_conv_bn(ref)
    ref.train()
    nn.functional.cross_entropy(ref(xb.double().contiguous()), yb).backward()
    return {n: p.grad for n, p in ref.named_parameters()}

@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)])
def test_compile_fused_model_in_place_trains(device):
    """compile=True compiles the learner's model in place (same object, same state_dict keys) and a fused model trains
    under it (clfast's ops through their fakes; on CUDA inductor around the Triton kernels, which no GPU has run yet):
    a compiled step's gradients against fp64; compile=False undoes it"""
    from clfast.check import grad_error
    torch.manual_seed(0)
    learn = tiny_learner() if device == 'cpu' else _cuda_learner()
    model, keys = learn.model, list(learn.model.state_dict())
    learn.to_channelslast(use_amp=False, fuse='speed', compile=True)
    assert learn.model is model and is_compiled(model) and list(model.state_dict()) == keys
    errors = []
    class Exact(Callback):   # the first training step's gradients against fp64 at the same weights
        order = 20
        def before_batch(self):
            if self.training and not errors: self.ref = _fp64_grads(self.model, self.x, self.y)
        def after_backward(self):
            if self.training and not errors:
                errors.append(grad_error({n: p.grad for n, p in self.model.named_parameters()}, self.ref))
    _fit(learn, Exact())
    assert errors and errors[0] < 1e-3            # fp32 through the compiled fused ops: fp32's error, not a wrong one
    assert learn.recorder.losses and all(math.isfinite(l) for l in learn.recorder.losses)
    learn.to_channelslast(use_amp=False, fuse='speed', compile=False)
    assert not is_compiled(model)

def test_first_error_names_what_failed_inside_a_capture():
    "A capture's end reports 'a previous error'; the message names the op that failed first, not an unrelated earlier one"
    from clfast.graphs import _first_error
    def capture():
        try: raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        finally: raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    with pytest.raises(RuntimeError) as e: capture()
    assert _first_error(e.value) == "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    try:
        try: {}['x']
        except KeyError: raise TypeError("the model returns something other than tensors")
    except TypeError as e2: assert _first_error(e2) == "TypeError: the model returns something other than tensors"

# ---- on a CUDA GPU ----

def _cuda_learner(n=160, bs=16, **kw):
    """A CUDA learner whose training epoch has 7 full batches (steady: captured after WARM_STEPS) and a short last one;
    its loaders in the process (fastai's default: a worker per core, 16 on a GPU machine, forked from a CUDA process
    by each of the GPU script's 8 test processes; one such worker was lost on the H200)"""
    learn = Learner(image_dls(n=n, bs=bs, num_workers=0), conv_net(), loss_func=CrossEntropyLossFlat(), opt_func=Adam, **kw)
    learn.dls.cuda(); learn.model.cuda()
    return learn

# 'fused' layers (not the default 'timed'), so that both fits run the same ones: 'timed' chooses a graph's layers by the
# GPU's time alone, an eager step's by the host's too (tests/test_fused.py tests that choice)
@pytest.mark.cuda
@pytest.mark.parametrize('fuse', [False, 'speed'])
@pytest.mark.parametrize('amp_mode', ['fp16', 'bf16'])
@pytest.mark.usefixtures('fused_way')
def test_graphed_fit_trains_as_eager(fuse, amp_mode):
    """A graphed fit captures the steady training shape once, replays it, and trains as the eager fit does: BN's running
    statistics (each batch counted once, none by the capture's warm-up) and the weights, to what the precision explains"""
    runs = []
    for graphs in (False, True):
        set_seed(0)   # Python's random too: fastai's loaders shuffle with it (torch's alone: another order)
        learn = _cuda_learner().to_channelslast(amp_mode=amp_mode, fuse=fuse, graphs=graphs)
        counted = []
        class Count(Callback):
            order = 20
            def after_batch(self):
                if self.training and graphs: counted.append(learn.cuda_graphs.captured)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter('always')
            _fit(learn, Count(), epochs=2)
        assert not [m for m in _clfast_warnings(rec) if m.startswith('CudaGraphs')]
        if graphs: assert counted[-2] == 1 and counted[0] == 0   # eager while warming, replayed once steady
        if graphs: assert learn.cuda_graphs.retried == []   # captured at the first try (no retry hides a failure)
        bn = learn.model[0][1]
        runs.append((bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.item(),
                     [p.detach().float().clone() for p in learn.model.parameters()], learn.recorder.losses))
    (m0, v0, n0, p0, l0), (m1, v1, n1, p1, l1) = runs
    assert n0 == n1 == 2 * len(learn.dls.train)   # each training batch counted once (fastai drops the short last one)
    eps = {'fp16': 2**-10, 'bf16': 2**-7}[amp_mode] * 8
    assert torch.allclose(m0, m1, rtol=eps, atol=eps) and torch.allclose(v0, v1, rtol=eps, atol=eps)
    for a, b in zip(p0, p1): assert torch.allclose(a, b, rtol=eps, atol=eps * a.abs().max().item())
    assert len(l0) == len(l1)

@pytest.mark.cuda
def test_replayed_step_gradients_against_fp64():
    "The gradients of a step replayed from a graph (fp32, `fuse='speed'`: its layers as 'timed' chooses them for a replay), against fp64 at the same weights"
    from clfast.check import grad_error
    learn = _cuda_learner().to_channelslast(use_amp=False, fuse='speed', graphs=True)
    errors = []
    class Exact(Callback):
        order = 20
        ref = None
        def before_batch(self):   # a step that replays (captured before it began; the capture's own step ran eagerly)
            self.ref = _fp64_grads(self.model, self.x, self.y) if self.training and learn.cuda_graphs.captured else None
        def after_backward(self):
            if self.ref is not None and self.x.shape[0] == 16:
                errors.append(grad_error({n: p.grad for n, p in self.model.named_parameters()}, self.ref))
    _fit(learn, Exact())
    assert errors and max(errors) < 1e-3

@pytest.mark.cuda
def test_shape_change_and_hooks_train_eagerly():
    m = conv_net().cuda().train().to(memory_format=torch.channels_last)
    g = GraphedForward(m, warm=1)
    x = torch.randn(16, 3, 16, 16, device='cuda').to(memory_format=torch.channels_last)
    for _ in range(3): g(x).sum().backward()
    assert len(g.graphs) == 1
    out = g(x[:4])                                 # another shape: eager (one graph at most)
    assert len(g.graphs) == 1 and out.shape == (4, 2)
    learn = _cuda_learner()
    learn.model[1][0].register_forward_hook(lambda mod, args, out: None)
    learn.to_channelslast(graphs=True)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        _fit(learn)
    said = [m for m in _clfast_warnings(rec) if m.startswith('CudaGraphs')]
    assert said == ["CudaGraphs: module 1.0 (Conv2d) has hooks, which a replayed graph would not call; training eagerly."]
    assert learn.cuda_graphs.captured == 0 and all(math.isfinite(l) for l in learn.recorder.losses)

@pytest.mark.cuda
def test_a_second_steady_shape_beyond_max_graphs_is_said_once():
    """A batch shape that settles after `max_graphs` were captured (progressive resizing within a fit) trains eagerly,
    said once when it is as steady as a captured shape was (a one-off shape, a short last batch, is not said)"""
    m = conv_net().cuda().train().to(memory_format=torch.channels_last)
    said = []
    g = GraphedForward(m, warm=1, say=lambda why, then='training eagerly': said.append(f"{why}; {then}"))
    big, small = (torch.randn(n, 3, 16, 16, device='cuda').to(memory_format=torch.channels_last) for n in (16, 4))
    for _ in range(3): g(big).sum().backward()
    g(small).sum().backward()
    assert len(g.graphs) == 1 and said == []   # seen once: a last batch, not steady
    for _ in range(3):
        out = g(small)
        out.sum().backward()
        assert out.grad_fn is not None and torch.isfinite(out).all()
    assert len(g.graphs) == 1 and g.why is None   # the first shape still replays
    assert said == ["batches of shape 4x3x16x16 came steady after the 1 graph that max_graphs allows was captured "
                    "(`learn.cuda_graphs.max_graphs = 2` before the fit would capture them too); training them eagerly"]

@pytest.mark.cuda
def test_batch_shapes_that_never_settle_train_eagerly_and_say_so():
    """A batch shape that changes at every step (a callback resizing each batch) leaves nothing to capture: said once,
    naming it, and every step trains eagerly"""
    m = conv_net().cuda().train().to(memory_format=torch.channels_last)
    said = []
    g = GraphedForward(m, say=said.append)
    for size in range(8, 8 + MAX_SHAPES + 3):
        x = torch.randn(4, 3, size, size, device='cuda').to(memory_format=torch.channels_last)
        out = g(x)
        out.sum().backward()
        assert out.shape == (4, 2) and out.grad_fn is not None and torch.isfinite(out).all()
    assert said == [f"the training batches came in {MAX_SHAPES + 1} shapes in {MAX_SHAPES + 1} steps, none "
                    f"{WARM_STEPS + 1} times: nothing to capture"]
    assert g.why == said[0] and g.graphs == {}

@pytest.mark.cuda
def test_finder_measures_graphed_setups():
    "On CUDA the finder measures graphed setups and judges their gradients against fp64 as any other's"
    learn = _cuda_learner()
    graphed = [Setup(dtype=torch.bfloat16, graphs=True), Setup(dtype=torch.float16, fuse='speed', graphs=True)]
    df = learn.format_find(setups=[BASELINE, *graphed], n_batches=4, show_plot=False)
    for s in graphed:
        row = df.loc[s.name]
        assert row.error == '' and row.steps == 4 and row.first_step_s > 0

@pytest.mark.cuda
def test_a_replay_draws_the_dropout_masks_an_eager_step_draws():
    "The capture's warm-up gives its random numbers back: a replay draws the masks an eager step draws from the same seed"
    m = nn.Sequential(conv_net(n_out=64), nn.Dropout(0.5)).cuda().train().to(memory_format=torch.channels_last)
    g = GraphedForward(m, warm=0)
    x = torch.randn(16, 3, 16, 16, device='cuda').to(memory_format=torch.channels_last)
    torch.manual_seed(5); replayed = g(x)            # captured, then replayed
    assert len(g.graphs) == 1
    torch.manual_seed(5); eager = g.forward(x)
    assert torch.equal(replayed == 0, eager == 0) and (eager == 0).any()
    assert torch.allclose(replayed, eager, rtol=1e-4, atol=1e-5)

@pytest.mark.cuda
def test_a_second_forward_before_the_backward_trains_eagerly():
    """Two forwards, then one backward (a loss that runs the model twice): the graph holds one forward's activations, so
    the second call trains eagerly, said once; the gradients are the step's, against fp64; the next step replays again"""
    from clfast.check import grad_error
    m = conv_net().cuda().train().to(memory_format=torch.channels_last)
    said = []
    g = GraphedForward(m, warm=1, say=lambda why, then='training eagerly': said.append(f"{why}; {then}"))
    x1, x2 = (torch.randn(16, 3, 16, 16, device='cuda').to(memory_format=torch.channels_last) for _ in range(2))
    for _ in range(3): g(x1).sum().backward()
    assert len(g.graphs) == 1
    import copy
    ref = copy.deepcopy(m).double()
    ref.zero_grad(set_to_none=True)   # the copy's gradients are the warm-up steps'
    (ref(x1.double()).square().sum() + ref(x2.double()).sum()).backward()
    m.zero_grad(set_to_none=True)
    (g(x1).square().sum() + g(x2).sum()).backward()
    assert said == ["the model was called again before the backward of its replayed forward (a graph holds one "
                    "forward's activations); such calls train eagerly"]
    err = grad_error({n: p.grad for n, p in m.named_parameters()}, {n: p.grad for n, p in ref.named_parameters()})
    assert err < 1e-3, err
    g(x1).sum().backward()
    assert len(said) == 1 and len(g.graphs) == 1

@pytest.mark.cuda
def test_fastais_cancels_keep_the_graphs_and_a_short_last_batch_is_never_steady():
    """A callback's CancelTrainException (fastai's ShortEpochCallback's way) ends an epoch's training, not the graphs:
    the next epochs replay; and the epoch's short last batch, back every epoch, is never said to be steady"""
    from fastai.callback.core import CancelTrainException
    from clfast.graphs import GraphedForward
    learn = _cuda_learner().to_channelslast(amp_mode='bf16', graphs=True)
    installed = []
    class CutFirstEpoch(Callback):
        order = 20
        def after_batch(self):
            if not self.training: return
            installed.append((self.epoch, isinstance(self.model.__dict__.get('forward'), GraphedForward)))
            if self.epoch == 0 and self.iter == 5: raise CancelTrainException()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        _fit(learn, CutFirstEpoch(), epochs=WARM_STEPS + 3)
    assert not [m for m in _clfast_warnings(rec) if m.startswith('CudaGraphs')]
    assert [i for e, i in installed if e > 0] and all(i for e, i in installed)
    assert learn.cuda_graphs.captured == 1 and learn.cuda_graphs.retried == []

@pytest.mark.cuda
def test_a_setting_changed_after_the_capture_is_replayed_as_set():
    """A BN's momentum set mid-fit, after the capture (a schedule's): the graphed fit's running statistics are the eager
    fit's with the same change (a replay of the old capture would have kept the old momentum)"""
    runs = []
    for graphs in (False, True):
        set_seed(0)   # Python's random too: fastai's loaders shuffle with it (torch's alone: another order)
        learn = _cuda_learner().to_channelslast(use_amp=False, graphs=graphs)
        class Momentum(Callback):
            order = 20
            def before_batch(self):
                if self.training and self.epoch == 1 and self.iter == 2: self.model[0][1].momentum = 0.9
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter('always')
            _fit(learn, Momentum(), epochs=2)
        if graphs: assert learn.cuda_graphs.captured >= 1   # captured again after the change, once steady
        assert not [m for m in _clfast_warnings(rec) if m.startswith('CudaGraphs')]   # one change: no graphs stopped
        bn = learn.model[0][1]
        runs.append((bn.running_mean.clone(), bn.running_var.clone()))
    (m0, v0), (m1, v1) = runs
    assert torch.allclose(m0, m1, rtol=1e-4, atol=1e-5) and torch.allclose(v0, v1, rtol=1e-4, atol=1e-5)

@pytest.mark.cuda
def test_a_setting_changed_at_every_step_stops_graphs_and_is_named():
    "An attribute set anew at each step (each change a new capture): the graphs stop, naming it, and the fit trains eagerly"
    learn = _cuda_learner().to_channelslast(use_amp=False, graphs=True)
    class Jitter(Callback):
        order = 20
        def before_batch(self):
            if self.training: self.model[0][1].momentum = 0.1 + 1e-3 * self.iter
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        _fit(learn, Jitter(), epochs=4)
    said = [m for m in _clfast_warnings(rec) if m.startswith('CudaGraphs')]
    assert len(said) == 1 and '`0.1.momentum` changed after the capture' in said[0], said
    assert all(math.isfinite(l) for l in learn.recorder.losses)

@pytest.mark.cuda
def test_a_hook_added_during_the_fit_is_seen_at_the_capture():
    "A hook registered after the fit began, before the capture: said at the capture, and every step calls it (eager)"
    learn = _cuda_learner().to_channelslast(amp_mode='bf16', graphs=True)
    calls = []
    class AddHook(Callback):
        order = 20
        def before_batch(self):
            if self.training and self.epoch == 0 and self.iter == 1:
                self.model[1][0].register_forward_hook(lambda mod, a, out: calls.append(mod.training) if mod.training else None)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        _fit(learn, AddHook())
    said = [m for m in _clfast_warnings(rec) if m.startswith('CudaGraphs')]
    assert said == ["CudaGraphs: module 1.0 (Conv2d) has hooks, which a replayed graph would not call; training eagerly."]
    assert learn.cuda_graphs.captured == 0 and len(calls) == len(learn.recorder.losses) - 1

@pytest.mark.cuda
def test_a_deepcopy_during_a_graphed_fit():
    "An EMA-like callback's deepcopy of the model after the capture: a working copy with its own forward, training unharmed"
    import copy
    from clfast.graphs import GraphedForward
    learn = _cuda_learner().to_channelslast(amp_mode='bf16', graphs=True)
    copies = []
    class Snapshot(Callback):
        order = 20
        def after_batch(self):
            if self.training and learn.cuda_graphs.captured: copies.append(copy.deepcopy(self.model))
    _fit(learn, Snapshot())
    assert copies and learn.cuda_graphs.captured == 1
    c = copies[-1].eval()
    assert not isinstance(c.__dict__.get('forward'), GraphedForward) and c(learn.dls.one_batch()[0]).isfinite().all()

@pytest.mark.cuda
def test_finder_graphed_step_refuses_a_second_shape_with_its_message():
    "The finder's graphed step says why it cannot go on (a second steady shape) as a RuntimeError naming it"
    from clfast.finder import _graphed
    m = conv_net().cuda().train().to(memory_format=torch.channels_last)
    g = _graphed(m, torch.device('cuda'))
    big, small = (torch.randn(n, 3, 16, 16, device='cuda').to(memory_format=torch.channels_last) for n in (16, 4))
    g(big).sum().backward()
    with pytest.raises(RuntimeError, match='no CUDA graphs: batches of shape 4x3x16x16 came steady'): g(small)

class _ReadsOnHost(nn.Module):
    "A forward that reads a value on the host: fine eagerly, impossible inside a capture"
    def forward(self, x): return x * 0 if x.isnan().any().item() else x

@pytest.mark.cuda
def test_failed_capture_trains_eagerly_and_keeps_the_generator():
    """A step that cannot be captured (a host read in forward, found only by trying) says why once, naming the op that
    failed, and trains eagerly; the CUDA generator, which a failed capture leaves in capture mode, still draws (dropout)"""
    learn = _cuda_learner()
    learn.model = nn.Sequential(_ReadsOnHost(), nn.Dropout(0.1), *learn.model).cuda()
    learn.to_channelslast(amp_mode='bf16', graphs=True)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        _fit(learn, epochs=2)
    said = [m for m in _clfast_warnings(rec) if m.startswith('CudaGraphs')]
    assert len(said) == 1 and said[0].startswith("CudaGraphs: its step could not be captured (") and 'previous error' not in said[0]
    steps = 2 * len(learn.dls.train)   # fastai drops the training epoch's short last batch
    assert learn.cuda_graphs.captured == 0 and len(learn.recorder.losses) == steps
    assert all(math.isfinite(l) for l in learn.recorder.losses)
    assert learn.model[2][1].num_batches_tracked.item() == steps    # each batch counted once, the failed capture's none
    assert torch.rand(4, device='cuda').isfinite().all()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()   # the failed capture's stream is not left current

class _FailsFirstCapture(nn.Module):
    "A host read inside its first capture only: a capture that fails once, as a process's first did on an H100"
    def __init__(self): super().__init__(); self.captures = []   # a list, appended to: a new int each capture would be
    def forward(self, x):                                           # an attribute that changed after it (stale graphs)
        if torch.cuda.is_current_stream_capturing():
            self.captures.append(x.shape)
            if len(self.captures) == 1: x.sum().item()
        return x

@pytest.mark.cuda
def test_a_capture_that_fails_once_is_tried_again():
    """A failed capture is tried again at once: a second capture that succeeds replays from then on, says nothing, and
    `retried` names the first failure; every batch counted once (the failed try's warm-up and BN updates undone)"""
    learn = _cuda_learner()
    learn.model = nn.Sequential(_FailsFirstCapture(), *learn.model).cuda()
    learn.to_channelslast(amp_mode='bf16', graphs=True)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter('always')
        _fit(learn, epochs=2)
    assert not [m for m in _clfast_warnings(rec) if m.startswith('CudaGraphs')]
    assert learn.cuda_graphs.captured == 1 and len(learn.cuda_graphs.retried) == 1 and 'previous error' not in learn.cuda_graphs.retried[0]
    assert len(learn.model[0].captures) == 2 and all(math.isfinite(l) for l in learn.recorder.losses)
    assert learn.model[1][1].num_batches_tracked.item() == 2 * len(learn.dls.train)

@pytest.mark.cuda
@pytest.mark.parametrize('faster_by', [None, 0.999])
def test_if_faster_measures_then_keeps_or_drops_the_graphs(faster_by, monkeypatch):
    """graphs='if_faster' times the eager steps before the capture and the first replays, then keeps the graphs or
    stops them (said once, with both medians), and the fit goes on either way, training as an eager fit does. Asked for
    a 1000-fold gain (`FASTER_BY` 0.999: a forced drop, not what any setting would be), it drops them"""
    from clfast import graphs as cg
    if faster_by is not None: monkeypatch.setattr(cg, 'FASTER_BY', faster_by)
    runs = []
    for graphs in (False, 'if_faster'):
        set_seed(0)
        learn = _cuda_learner().to_channelslast(amp_mode='fp16', graphs=graphs)   # 7 full training batches an epoch
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter('always')
            _fit(learn, epochs=3)
        said = [m for m in _clfast_warnings(rec) if m.startswith('CudaGraphs')]
        if graphs:
            m = learn.cuda_graphs.measured
            # 5 eager steps, the first not timed; the capture's; then 4 replays (the second epoch's, across its start);
            # fewer eager ones where fp16's GradScaler skipped an optimizer step (the first steps may overflow)
            assert m is not None and m['steps'][1] == MEASURED_REPLAYS and m['steps'][0] <= MEASURED_WARM - 1, m
            assert m['replay_ms'] > 0 and (m['eager_ms'] is None) == (m['steps'][0] == 0), m
            if faster_by is not None and m['eager_ms'] is not None: assert not m['kept']
            if m['kept']: assert said == [] and learn.cuda_graphs.captured == 1
            else:
                assert len(said) == 1 and said[0].startswith("CudaGraphs: its replayed steps were not faster here (")
                assert said[0].endswith("; training eagerly.") and learn.cuda_graphs.captured == 0
        runs.append([p.detach().float().clone() for p in learn.model.parameters()])
    eps = 2**-10 * 8
    for a, b in zip(*runs): assert torch.allclose(a, b, rtol=eps, atol=eps * a.abs().max().item())
