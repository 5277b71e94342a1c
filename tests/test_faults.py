"""Fault injection (issue 37): a fit SIGKILLed mid-epoch and resumed from its checkpoint, fp16 gradients overflowing
through fused layers, NaN / inf batches through a whole fit, a rank SIGKILLed mid-step under `distrib_ctx`. Each is
compared with stock fastai / PyTorch meeting the same fault. Processes that die run as subprocesses with a time bound."""
import copy, json, math, os, re, signal, socket, subprocess, sys, time, warnings, pytest, torch
from pathlib import Path
from torch import nn
from fastai.vision.all import (Learner, Callback, CrossEntropyLossFlat, Adam, ConvLayer, Flatten, SaveModelCallback,
                               TerminateOnNaNCallback, set_seed)
import clfast.callback   # Learner.to_channelslast
import clfast.amp as amp
from clfast.core import is_channels_last
from clfast.fuse import is_fused
from clfast.fused import FusedConvBN2d
from helpers import image_dls, conv_net

TESTS = Path(__file__).parent
ROOT = TESTS.parent

def _learner(fuse=None, net=conv_net, **kw):
    "3 training batches of 16 an epoch; `fuse`: `to_channelslast(fuse=fuse)` as users call it, None: a stock fastai learner"
    learn = Learner(image_dls(n=64), net(), loss_func=CrossEntropyLossFlat(), opt_func=Adam, **kw)
    return learn if fuse is None else learn.to_channelslast(fuse=fuse)

def _fit(learn, *cbs, n=1):
    with learn.no_bar(), learn.no_logging(): learn.fit(n, 1e-3, cbs=list(cbs))
    return learn

def _state(learn) -> dict:
    "A copy of all that a step can change: the model's state_dict (parameters, BN statistics) and the optimizer's state"
    return copy.deepcopy(dict(model=learn.model.state_dict(), opt=learn.opt.state_dict()))

def _assert_same(a, b, at='state'):
    "`a` equals `b` exactly, recursively: keys in order, tensors in dtype, shape and every value"
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{at} differs"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{at}: keys {list(a)} != {list(b)}"
        for k in a: _assert_same(a[k], b[k], f"{at}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{at}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)): _assert_same(x, y, f"{at}[{i}]")
    else: assert a == b, f"{at}: {a!r} != {b!r}"

def _bn_keys(sd) -> list:
    "The BN statistics' keys of state_dict `sd`"
    return [k for k in sd if k.split('.')[-1] in ('running_mean', 'running_var', 'num_batches_tracked')]

def _env(**kw) -> dict:
    return {**os.environ, 'PYTHONPATH': os.pathsep.join([str(ROOT), str(TESTS), os.environ.get('PYTHONPATH', '')]),
            'OMP_NUM_THREADS': '1', **kw}

def _python(call:str) -> list:
    "The command line of a fresh process running `call` from this module"
    return [sys.executable, '-c', f"import test_faults as t; t.{call}"]

# --- 1. SIGKILL mid-epoch, then resume from the checkpoint --------------------------------------------------------

def _killed_fit(mode:str, path:str):
    "Child process: a fused channels-last fit of 3 epochs, checkpointed with its optimizer after each; SIGKILLed in epoch 2"
    path = Path(path)
    set_seed(0)
    learn = _learner(mode, path=path)
    class Kill(Callback):
        order = SaveModelCallback.order + 1   # after the epoch's checkpoint is written
        def after_epoch(self):   # what the learner held when it wrote epoch 1's checkpoint
            if self.epoch == 0: torch.save(_state(self.learn), path/'held.pt')
        def after_step(self):
            if self.epoch == 1 and self.iter == 1: os.kill(os.getpid(), signal.SIGKILL)
    _fit(learn, SaveModelCallback(every_epoch=True, with_opt=True), Kill(), n=3)

@pytest.mark.parametrize('mode', ['speed', 'memory'])
def test_sigkill_mid_epoch_then_resume(tmp_path, mode):
    """A fused channels-last fit SIGKILLed in epoch 2, after epoch 1's checkpoint (`SaveModelCallback(every_epoch=True,
    with_opt=True)`): a fresh fused learner loads weights, Adam's moments and step counts and the BN running statistics
    exactly as the checkpoint holds them (what the killed learner held at epoch 1's end), is fused and trains on in
    channels-last from Adam's saved step; the checkpoint loads as exactly into a stock fastai learner (fusion leaves the
    state_dict's keys alone), which trains on too"""
    p = subprocess.run(_python(f"_killed_fit({mode!r}, {str(tmp_path)!r})"), env=_env(), cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-3000:]
    assert [f.name for f in (tmp_path/'models').iterdir()] == ['model_0.pth']   # killed before epoch 2's checkpoint
    ck = torch.load(tmp_path/'models'/'model_0.pth', weights_only=False)
    _assert_same(ck, torch.load(tmp_path/'held.pt', weights_only=False), 'checkpoint')
    bn = _bn_keys(ck['model'])
    assert len(bn) == 6 and all(ck['model'][k].item() == 3 for k in bn if k.endswith('num_batches_tracked'))
    assert all(s['step'] == 3 for s in ck['opt']['state'])   # Adam's step counts: 3 batches in epoch 1
    for fuse in (mode, None):
        set_seed(1)
        learn = _learner(fuse, path=tmp_path)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            learn.load('model_0', with_opt=True)
        assert not [o for o in w if 'optimizer' in str(o.message)]   # fastai only warns if the optimizer state fails to load
        _assert_same(_state(learn), ck, 'loaded')
        assert is_fused(learn.model) == (fuse is not None)
        _fit(learn)
        assert all(math.isfinite(v) for v in learn.recorder.values[-1][:2])
        sd = learn.model.state_dict()
        assert all(not torch.equal(sd[k], ck['model'][k]) for k in sd if k not in bn)   # every parameter trained
        assert all(s['step'] == 6 for s in learn.opt.state_dict()['state'])              # from the loaded Adam state
        assert all(sd[k].item() == 6 for k in bn if k.endswith('num_batches_tracked'))
        if fuse is not None:
            w4 = [q for q in learn.model.parameters() if q.dim() == 4]
            assert is_fused(learn.model) and all(is_channels_last(q) for q in w4)
            assert all(is_channels_last(learn.opt.state[q][k]) for q in w4 for k in ('grad_avg', 'sqr_avg'))

# --- 2. fp16 with a GradScaler: a step whose gradients overflow ----------------------------------------------------

@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """clfast trains fp16 on a CPU only where fp16 is native and fast; on another (no native fp16, as this project's
    CI machines) `to_channelslast()` trains bf16 without a GradScaler, and no step can overflow. The policy is made to
    see a fast fp16 (as test_precision's `cpu_kind`): fp16 autocast and a real GradScaler then run, emulated if need be"""
    if amp.resolve_amp('cpu', 'fp16')[:2] != (torch.float16, True):
        monkeypatch.setattr(amp, 'cpu_amp_speed', lambda refresh=False: {torch.bfloat16: math.inf, torch.float16: 0.5})

class LossSpike(Callback):
    "Training batch `at`'s loss gradient times 2**30 (a loss spike): its scaled fp16 gradients overflow. Records every step"
    def __init__(self, at:int=1): self.at, self.steps = at, []
    def before_batch(self):
        if self.training and self.iter == self.at:
            self.before, self.scale_before = _state(self.learn), self.learn.scaler.get_scale()
    def after_loss(self):
        if self.training and self.iter == self.at: self.learn.loss_grad = self.learn.loss_grad * 2.**30
    def after_batch(self):
        if not self.training: return
        self.steps.append((self.learn.mixed_precision.skipped, self.learn.scaler.get_scale()))
        if self.iter == self.at: self.after = _state(self.learn)
        if self.iter == self.at + 1: self.next = _state(self.learn)

@pytest.mark.parametrize('mode', ['speed', 'memory'])
def test_fp16_overflow_skips_the_step_as_stock(fp16_on_cpu, mode):
    """An fp16 step whose scaled gradients overflow through the fused layers is skipped as the stock modules' is:
    parameters and Adam's state unchanged exactly, the scale halved; the BN running statistics updated by its forward
    as stock's are; the next step trains. Stock: a stock fastai learner with the same MixedPrecision (fastai's own
    autocasts CUDA only: on a CPU it would train fp32)"""
    runs = {}
    for fuse in (None, mode):
        set_seed(0)
        learn = _learner(fuse)
        if fuse is None: learn.to_fp16()
        spike = LossSpike()
        _fit(learn, spike)
        assert learn.mixed_precision.dtype == torch.float16
        runs[fuse] = spike
        b, a, nxt = spike.before, spike.after, spike.next
        assert spike.steps[1] == (True, spike.scale_before / 2)     # skipped, the scale halved (GradScaler's backoff)
        assert spike.steps[0][0] is False and spike.steps[2][0] is False
        bn = _bn_keys(a['model'])
        params = lambda st: {k: v for k, v in st['model'].items() if k not in bn}
        _assert_same(params(a), params(b))
        _assert_same(a['opt'], b['opt'])
        assert all(a['model'][k] == b['model'][k] + 1 for k in bn if k.endswith('num_batches_tracked'))
        assert all(not torch.equal(a['model'][k], b['model'][k]) for k in bn)   # stock BN updates them in forward
        assert all(not torch.equal(nxt['model'][k], a['model'][k]) for k in a['model'])   # the next step trains
        assert all(torch.isfinite(v).all() for v in nxt['model'].values())
    stock, fused = runs[None], runs[mode]
    assert fused.steps == stock.steps
    for k in _bn_keys(stock.after['model']):
        # fp16's precision: the largest difference seen was 8e-6
        torch.testing.assert_close(fused.after['model'][k], stock.after['model'][k], rtol=1e-3, atol=1e-4, msg=k)

def _layer_overflow(scales, res:bool) -> dict:
    """One fused conv-BN-ReLU(+add) layer and its stock modules, an SGD step each under CPU fp16 autocast with a
    GradScaler at each of `scales`: `{scale: {'stock'|'fused': dict(grads, stepped, next_scale, dtype)}}`"""
    out = {}
    for scale in scales:
        torch.manual_seed(0)
        f = FusedConvBN2d(3, 4, 3, padding=1, act='relu')
        stock = copy.deepcopy(f).to_stock()
        x = torch.randn(2, 3, 6, 6).contiguous(memory_format=torch.channels_last)
        # a residual in fp16, as autocast's layers make one (an fp32 one promotes stock's `z + r`, not the fused layer's)
        r = torch.randn(2, 4, 6, 6).half().contiguous(memory_format=torch.channels_last) if res else None
        out[scale] = {}
        for name, conv, bn in (('stock', stock[0], stock[1]), ('fused', f, f.bn)):
            xx, rr = x.clone().requires_grad_(), None if r is None else r.clone().requires_grad_()
            with torch.autocast('cpu', dtype=torch.float16):
                if name == 'fused': y = f(xx, rr)
                else:
                    z = bn(conv(xx))
                    y = torch.relu(z if rr is None else z + rr)
            params = [conv.weight, bn.weight, bn.bias]
            before = [q.detach().clone() for q in params]
            scaler, opt = torch.amp.GradScaler('cpu', init_scale=scale), torch.optim.SGD(params, lr=0.1)
            scaler.scale(y.float().square().mean()).backward()
            grads = dict(x=xx.grad, weight=conv.weight.grad, bn_weight=bn.weight.grad, bn_bias=bn.bias.grad,
                         **({} if rr is None else dict(residual=rr.grad)))
            scaler.step(opt); scaler.update()
            out[scale][name] = dict(grads={k: g.detach().clone() for k, g in grads.items()}, dtype=y.dtype,
                                    stepped=not all(torch.equal(q0, q) for q0, q in zip(before, params)),
                                    next_scale=scaler.get_scale())
    return out

OVERFLOW_SCALES = (2.**40, 2.**21, 2.**8)   # every gradient overflows fp16 / only some of the conv weight's / none

def _check_layer_overflow(res:dict):
    "inf / NaN gradients where stock's are, so GradScaler skips (and steps) the same steps with the same next scale"
    every, some, none = OVERFLOW_SCALES
    for scale, r in res.items():
        s, f = r['stock'], r['fused']
        assert s['dtype'] == f['dtype'] == torch.float16
        want = (False, scale / 2) if scale > none else (True, scale)   # skipped and the scale halved, or stepped
        assert (f['stepped'], f['next_scale']) == (s['stepped'], s['next_scale']) == want
        for k, g in s['grads'].items():
            h = f['grads'][k]
            # where values cross fp16's largest, the last bits decide which overflow (on the CPU, also the conv backward's
            # way, which the C++ kernels time once per process as cudnn.benchmark does): the same gradients overflow
            if scale == some: assert g.isfinite().all() == h.isfinite().all(), (scale, k)
            else: assert torch.equal(g.isnan(), h.isnan()) and torch.equal(g.isinf(), h.isinf()), (scale, k)
    assert not all(g.isfinite().all() for g in res[some]['stock']['grads'].values())
    assert all(g.isfinite().all() for g in res[none]['stock']['grads'].values())

@pytest.mark.parametrize('res', [False, True])
def test_fp16_overflow_in_one_fused_layer(fused_way, res):
    "`_check_layer_overflow` on the C++ CPU kernels (`fused_way`: the op itself; 'timed' could run the stock way)"
    _check_layer_overflow(_layer_overflow(OVERFLOW_SCALES, res))

def test_fp16_overflow_in_one_fused_layer_triton(tmp_path):
    """The CUDA code path: the layer's Triton kernels serving the CPU under the Triton interpreter (a fresh process, as
    test_ops' `test_triton_interpreted_layer`; clfast's op forced as there), each of `_check_layer_overflow`'s cases"""
    pytest.importorskip('triton')
    out = tmp_path/'res.pt'
    code = ("from clfast.fused import set_layer_way; set_layer_way('fused'); "
            f"res = {{res: t._layer_overflow({OVERFLOW_SCALES!r}, res) for res in (False, True)}}; "
            "cpu = next(l for l in torch._C._dispatch_dump('clfast::layer_fwd').splitlines() if l.startswith('CPU:')); "
            "assert 'clfast/ops.py' in cpu, cpu; "   # the CPU key was served by the Triton kernels, not the C++ ones
            f"torch.save(res, {str(out)!r})")
    p = subprocess.run([sys.executable, '-c', f"import torch, test_faults as t; {code}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=_env(TRITON_INTERPRET='1', CLFAST_KERNELS='triton'))
    assert p.returncode == 0, p.stderr[-3000:]
    for res in torch.load(out, weights_only=False).values(): _check_layer_overflow(res)

# --- 3. A NaN / inf batch through a whole fit ---------------------------------------------------------------------

def _dw_net():
    "conv_net with a depthwise first layer: a NaN in one input channel reaches 2 of its 6 BN channels, not all of them"
    return nn.Sequential(ConvLayer(3, 6, groups=3), ConvLayer(6, 16, stride=2), nn.AdaptiveAvgPool2d(1), Flatten(),
                         nn.Linear(16, 2))

class BadBatch(Callback):
    "Training batch `at` of epoch 1 gets `value` in one pixel of channel 1; records the training losses, the state after it"
    order = -5   # before ChannelsLast: the batch as the data gave it
    def __init__(self, value, at:int=1): self.value, self.at, self.losses = value, at, []
    def before_batch(self):
        if self.training and self.epoch == 0 and self.iter == self.at:
            x = self.learn.xb[0].clone()
            x[0, 1, 2, 3] = self.value
            self.learn.xb = (x, *self.learn.xb[1:])
    def after_loss(self):
        if self.training: self.losses.append(self.learn.loss.item())
    def after_batch(self):
        if self.training and self.epoch == 0 and self.iter == self.at: self.after = _state(self.learn)['model']

def _pattern(sd:dict) -> dict: return {k: (v.isnan(), v.isinf()) for k, v in sd.items() if v.is_floating_point()}

def _bad_fit(fuse, value, terminate:bool):
    set_seed(0)
    bad = BadBatch(value)
    learn = _fit(_learner(fuse, net=_dw_net), bad, *([TerminateOnNaNCallback()] if terminate else []), n=2)
    return learn, bad

@pytest.mark.parametrize('value', [math.nan, math.inf])
@pytest.mark.parametrize('mode,way', [('speed', 'timed'), ('memory', 'timed'), ('speed', 'fused')])
def test_nan_or_inf_batch_fits_as_stock(request, value, mode, way):
    """A training batch holding a NaN (an inf): the fused channels-last fit runs to its end as the stock modules'
    (`to_channelslast(fuse=False)`) does: losses NaN from the same batch, the BN statistics after it NaN / inf in the
    same channels, every parameter and buffer NaN where stock's is at the end, NaN epoch losses alike; fastai's
    TerminateOnNaNCallback stops both at that batch. 'memory' always runs clfast's op; 'speed' runs the way 'timed'
    chose for these shapes, so it runs again forced to clfast's op"""
    if way == 'fused': request.getfixturevalue('fused_way')
    (stock, sbad), (fused, fbad) = [_bad_fit(f, value, False) for f in (False, mode)]
    assert is_fused(fused.model) and not is_fused(stock.model)
    assert [math.isnan(l) for l in fbad.losses] == [math.isnan(l) for l in sbad.losses] == [False] + [True] * 5
    nans = lambda learn: [[math.isnan(v) for v in row] for row in learn.recorder.values]
    assert nans(fused) == nans(stock)
    for a, b in ((fbad.after, sbad.after), (fused.model.state_dict(), stock.model.state_dict())):
        pa, pb = _pattern(a), _pattern(b)
        assert list(pa) == list(pb)
        for k in pa: assert all(torch.equal(x, y) for x, y in zip(pa[k], pb[k])), k
    first = sbad.after['0.1.running_var']
    assert first.isnan().tolist() == [False, False, True, True, False, False]   # only channel 1's two filters
    for learn, bad in [_bad_fit(f, value, True) for f in (False, mode)]:
        assert (learn.epoch, learn.iter, len(bad.losses)) == (0, 1, 2) and learn.recorder.values == []

# --- 4. A rank SIGKILLed mid-step under distrib_ctx -----------------------------------------------------------------

GROUP_TIMEOUT = 60   # s; accelerate's default for gloo (fastai's distrib_ctx makes the group through it) is 30 min

def _bn1d_net():
    "conv_net with a BatchNorm1d in its head (as fastai's heads): one BN clfast cannot fuse"
    return nn.Sequential(ConvLayer(3, 8), ConvLayer(8, 16, stride=2), nn.AdaptiveAvgPool2d(1), Flatten(), nn.BatchNorm1d(16),
                         nn.Linear(16, 2))

def _rank_fit(rank:int, port:int, sync_bn:bool, timeout_s:int, out:str):
    "Child process: rank `rank` of 2 fits a fused learner in `distrib_ctx`; rank 1 is SIGKILLed before batch 3's backward"
    from datetime import timedelta
    from accelerate.utils import InitProcessGroupKwargs
    import clfast.all   # as the README's script: distrib_ctx on gloo
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    set_seed(0)
    # no loader workers: forked after the group is made, they hold its sockets open past their rank's death until they
    # notice it (5 s apart, longer under load), so rank 0's gloo may see no closed connection within the 10 s group
    # timeout of test_rank_killed_mid_step_unreaped (it timed out so once, in a test command run beside the ISA matrix)
    learn = Learner(image_dls(n=128, bs=8, num_workers=0), _bn1d_net(), loss_func=CrossEntropyLossFlat(), opt_func=Adam)
    learn.to_channelslast(fuse='speed')
    seen = {}
    class Die(Callback):
        def before_train(self): seen['kinds'] = sorted({type(m).__name__ for m in self.learn.model.modules()})
        def before_backward(self):
            if rank == 1 and self.iter == 2: os.kill(os.getpid(), signal.SIGKILL)
    # the process group's timeout bounds every collective here (the default would let a lost rank hold rank 0 30 min)
    pg = [InitProcessGroupKwargs(backend='gloo', timeout=timedelta(seconds=timeout_s))]
    try:
        with learn.distrib_ctx(sync_bn=sync_bn, kwargs_handlers=pg): _fit(learn, Die())
    except Exception as e:
        Path(out, f'rank{rank}.json').write_text(json.dumps(dict(kinds=seen.get('kinds'), error=f"{type(e).__name__}: {e}")))
        raise

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def _run_ranks(tmp_path, sync_bn:bool, reap:bool, timeout_s:int=GROUP_TIMEOUT, bound:float=2 * GROUP_TIMEOUT):
    """Start 2 ranks; wait at most `bound` s for them (then kill what runs). `reap`: collect each rank's exit as it
    happens (torchrun, torch.multiprocessing); else wait for rank 0 first, leaving a dead rank 1 a zombie till then"""
    port, procs = _free_port(), []
    tmp_path.mkdir(parents=True, exist_ok=True)
    for r in range(2):
        log = open(tmp_path/f'rank{r}.log', 'w')   # a file, not a pipe: a full pipe would block the rank writing to it
        call = f"_rank_fit({r}, {port}, {sync_bn}, {timeout_s}, {str(tmp_path)!r})"
        procs.append(subprocess.Popen(_python(call), cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT))
        log.close()
    t0 = time.monotonic()
    try:
        if reap:
            while None in [p.poll() for p in procs] and time.monotonic() - t0 < bound: time.sleep(0.1)
        else:
            try: procs[0].wait(timeout=bound)
            except subprocess.TimeoutExpired: pass
    finally:
        for p in procs:
            if p.poll() is None: p.kill()
            p.wait()
    info = json.loads((tmp_path/'rank0.json').read_text()) if (tmp_path/'rank0.json').exists() else {}
    logs = '\n'.join(f"--- rank {r} (exit {p.returncode}):\n{(tmp_path/f'rank{r}.log').read_text()[-2500:]}" for r, p in enumerate(procs))
    return [p.returncode for p in procs], [p.pid for p in procs], info, logs

def _killed_ranks(tmp_path, sync_bn:bool, reap:bool, **kw):
    """`_run_ranks`, once more where rank 1 ended before its kill (the fault was not injected, so the run says nothing
    of it: once in three whole-suite runs rank 1 exited 1 early, the cause unknown; both ranks' logs now say)"""
    for attempt in range(2):
        res = _run_ranks(tmp_path/f'try{attempt}', sync_bn, reap, **kw)
        if res[0][1] == -signal.SIGKILL: break
        warnings.warn(f"rank 1 ended before its kill, run again: {res[3][-3000:]}")
    return res

def _lost_rank_named(err:str, pid:int) -> bool:
    "rank 0's error says that rank 1 is gone (clfast's shared-memory exchange) or that a peer closed the connection (gloo)"
    return bool(re.search(rf"clfast: rank 1 \(pid {pid}\) exited while rank 0 waited", err)
                or re.search(r"Connection (closed|reset) by peer", err))

@pytest.mark.parametrize('sync_bn', [True, False])
def test_rank_killed_mid_step_ends_rank0_with_error(tmp_path, sync_bn):
    """2 gloo ranks fitting fused layers (synchronized with sync_bn, clfast's shared-memory exchange between ranks of one
    host) and an unfused BatchNorm1d: rank 1 SIGKILLed before batch 3's backward; rank 0 raises an error that says a
    peer is gone, at once, not the process group's timeout; nothing hangs"""
    (rc0, rc1), (_, pid1), info, log = _killed_ranks(tmp_path, sync_bn, reap=True)
    assert rc1 == -signal.SIGKILL, log[-5000:]
    assert rc0 in (1, -signal.SIGABRT) and 'error' in info, f"rank 0 ended with {rc0}: {log[-5000:]}"
    # once in a fresh clone's test command (sync_bn False), rank 0 raised its error, then aborted at exit as gloo's
    # process group came down after a lost peer ("terminate called without an active exception": torch's teardown,
    # pytorch/pytorch#50701's kind): the error said, the process ended; an abort before the error fails above
    if rc0 != 1: assert 'terminate called' in log.split('--- rank 1')[0], log[-5000:]
    assert _lost_rank_named(info['error'], pid1), info['error']
    kinds = set(info['kinds'])
    assert 'FusedConvBN2d' in kinds and ('PassThroughSyncBatchNorm' in kinds) == sync_bn
    assert ('PreciseSyncBatchNorm' in kinds) == sync_bn and ('BatchNorm1d' in kinds) != sync_bn

def test_rank_killed_mid_step_unreaped(tmp_path):
    """As `test_rank_killed_mid_step_ends_rank0_with_error` (sync_bn), with a launcher that waits on rank 0 before rank 1
    (so the killed rank 1 stays a zombie meanwhile): rank 0 must still say at once that rank 1 is gone (`process_alive` took a
    zombie for alive, and rank 0 waited out the group's timeout, then blamed the model). A short group timeout bounds
    the run: past it, rank 0's error is the timeout's, which this test rejects"""
    (rc0, rc1), (_, pid1), info, log = _killed_ranks(tmp_path, True, reap=False, timeout_s=10, bound=60)
    assert rc1 == -signal.SIGKILL and rc0 == 1 and 'error' in info, log[-3000:]
    assert _lost_rank_named(info['error'], pid1), info['error']
