"""Multi-process training with real processes: 2 ranks on gloo over loopback, spawned by each test and bounded in time
(every collective times out after `TIMEOUT` s, and a rank that raises ends the test with its error)."""
import contextlib, copy, faulthandler, os, socket, subprocess, sys, tempfile, textwrap, time, pytest, torch, torch.distributed as dist, torch.multiprocessing as mp
from pathlib import Path
import torch.nn.functional as F
from datetime import timedelta
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from preloaded import spawn

WORLD, TIMEOUT = 2, 120

def _spawn(fn, *args, world:int=WORLD, interpreted:bool=False):
    """Run `fn(rank, *args)` in `world` processes (`preloaded.spawn`; `interpreted`: ranks that set TRITON_INTERPRET);
    an exception in any rank is raised here (the others are killed)"""
    spawn(fn, *args, nprocs=world, interpreted=interpreted)

def _init(rank:int, init:str, timeout:float=TIMEOUT, world:int=WORLD):
    dist.init_process_group('gloo', init_method=f'file://{init}', rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    torch.set_num_threads(1)   # two ranks on two cores

def _net() -> nn.Sequential:
    "conv-BN-ReLU, torchvision's BasicBlock (fused with its add), timm's ConvNormAct (BatchNormAct2d with SiLU), a head with a BatchNorm1d (as fastai's)"
    import timm.layers, torchvision
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                      torchvision.models.resnet.BasicBlock(8, 8),
                      timm.layers.ConvNormAct(8, 16, 3, stride=2, act_layer=nn.SiLU),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.BatchNorm1d(16), nn.Linear(16, 5))
    with torch.no_grad():
        for bn in m.modules():
            if isinstance(bn, (nn.BatchNorm1d, nn.BatchNorm2d)): bn.weight.uniform_(0.5, 1.5); bn.bias.uniform_(-0.5, 0.5)
    return m

def _data(n:int=16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 10, 10, generator=g) * 2 + 1, torch.randint(0, 5, (n,), generator=g)

def _train(model:nn.Module, x, y, n_total:int, steps:int=3):
    "SGD steps on the loss summed over `x` and scaled to the mean over all ranks' `n_total` samples (DDP averages)"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        (F.cross_entropy(model(x), y, reduction='sum') * (dist.get_world_size() if dist.is_initialized() else 1)
         / n_total).backward()
        opt.step(); opt.zero_grad()

def _sync_worker(rank, init, out, mode, order, dtype, sizes, kernels, exchange):
    if exchange == 'msg': os.environ['CLFAST_HOST_EXCHANGE'] = '0'   # gloo's messages, as between hosts
    if kernels == 'triton': os.environ.update(CLFAST_KERNELS='triton', TRITON_INTERPRET='1')   # CUDA's code path
    from clfast.fuse import fuse_conv_bn, unfuse_conv_bn, convert_sync_batchnorm
    if kernels == 'python-op':   # the layer op's Python twin, as on a GPU machine without the C++ library (this one has it)
        from clfast import ops
        ops._layer_op = lambda x: ops._conv_bn_act
    _init(rank, init)
    try:
        model = _net().to(dtype)
        if mode == 'off': model = convert_sync_batchnorm(model)   # every BN unfused: clfast's converter (CPU)
        elif order == 'fuse-first':   # fastai's order: ChannelsLast fuses in before_fit, then DistributedTrainer converts
            fuse_conv_bn(model, mode)
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        else:   # converted before anything was fused: clfast's converter (PyTorch's has no CPU SyncBatchNorm)
            model = convert_sync_batchnorm(model)
            fuse_conv_bn(model, mode)
        model = model.to(memory_format=torch.channels_last)
        x, y = _data(sum(sizes))
        lo = sum(sizes[:rank])
        _train(DDP(model), x[lo:lo + sizes[rank]].to(dtype), y[lo:lo + sizes[rank]], len(x))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        unfuse_conv_bn(model)
        from clfast.syncstats import _twin
        shared = _twin(dist.group.WORLD.group_name).exchange is not None
        torch.save(dict(state=state, kinds=[type(m).__name__ for m in model.modules()], shared=shared), f"{out}/rank{rank}.pt")
    finally: dist.destroy_process_group()

def _rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-12)).item()

@pytest.mark.parametrize('mode,order,dtype,sizes,kernels,exchange', [
    ('speed', 'fuse-first', torch.float64, (11, 5), 'cpu', 'host'),   # uneven per-rank batches: weighted by counts
    ('memory', 'convert-first', torch.float64, (8, 8), 'cpu', 'msg'),  # statistics by gloo's messages
    ('speed', 'convert-first', torch.float32, (8, 8), 'cpu', 'host'),
    ('memory', 'fuse-first', torch.float64, (11, 5), 'triton', 'host'),   # the Triton kernels, interpreted on the CPU
    ('speed', 'convert-first', torch.float64, (11, 5), 'python-op', 'host'),   # the layer op's Python autograd node
    ('off', 'convert-first', torch.float64, (11, 5), 'cpu', 'host'),     # not fused: clfast's precise SyncBatchNorm
    ('off', 'convert-first', torch.float32, (8, 8), 'cpu', 'msg')])
def test_synced_fused_training_equals_one_process(tmp_path, mode, order, dtype, sizes, kernels, exchange):
    """2 ranks x B samples, fused (or not: every BN a `clfast.bn` precise SyncBatchNorm, as PyTorch's has no CPU kernel)
    and synchronized, train as one process on the same 2B samples (stock, fp64): parameters and running statistics
    after 3 SGD steps; the ranks agree exactly; unfusing gives clfast's synchronized BN, which runs on the CPU"""
    _spawn(_sync_worker, str(tmp_path/'init'), str(tmp_path), mode, order, dtype, sizes, kernels, exchange,
           interpreted=kernels == 'triton')
    ranks = [torch.load(tmp_path/f'rank{r}.pt') for r in range(WORLD)]
    from clfast.exchange import STORES_IN_ORDER
    if STORES_IN_ORDER:   # both ranks on this host: shared memory unless turned off
        assert [r['shared'] for r in ranks] == [exchange == 'host'] * WORLD
    ref = _net().double()
    x, y = _data(sum(sizes))
    _train(ref, x.double(), y, len(x))
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    assert list(ranks[0]['state']) == list(ref.state_dict())          # state_dict keys unchanged
    for k, want in ref.state_dict().items():
        got = ranks[0]['state'][k]
        assert torch.equal(got, ranks[1]['state'][k]), f"ranks disagree on {k}"
        if k.endswith('num_batches_tracked'): assert got.item() == want.item() == 3
        else: assert _rel(got, want) < tol, f"{k}: rel {_rel(got, want):.2e}"
    # timm's converter's choice, as clfast's synchronized BN: on the CPU, fused or not, unfused it runs (PyTorch's cannot)
    sync = {'BatchNorm2d': 'PreciseSyncBatchNorm', 'BatchNormAct2d': 'PreciseSyncBatchNormAct', 'BatchNorm1d': 'PreciseSyncBatchNorm'}
    assert sorted(ranks[0]['kinds']) == sorted(sync.get(type(m).__name__, type(m).__name__) for m in _net().modules())

# A rank whose batch is empty (the last batch of a split that does not divide evenly, `drop_last=False`): every
# synchronized BN's exchange still has every rank in it, in forward and in backward
EMPTY_TIMEOUT, EPS, MOMENTUM = 30, 1e-5, 0.1

def _empty_rank_model(kind:str) -> nn.Module:
    "'precise': a head of two BatchNorm1d on [N, C] rows, clfast's precise SyncBatchNorm; 'fused': conv-BN-ReLU and a BasicBlock (three fused layers, one with the residual add)"
    import torchvision
    torch.manual_seed(0)
    if kind == 'precise':
        m = nn.Sequential(nn.BatchNorm1d(6), nn.Linear(6, 4, bias=False), nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 3))
    else:
        m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                          torchvision.models.resnet.BasicBlock(4, 4))
    with torch.no_grad():
        for bn in m.modules():
            if isinstance(bn, (nn.BatchNorm1d, nn.BatchNorm2d)): bn.weight.uniform_(0.5, 1.5); bn.bias.uniform_(-0.5, 0.5)
    return m

def _empty_rank_data(kind:str, n:int):
    "The batch of every rank together, and the weights of the loss `(out * r).sum()`"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g) * 2 + 1 if kind == 'precise' else torch.randn(n, 3, 5, 5, generator=g) * 2 + 1
    return x, torch.randn(n, 3 if kind == 'precise' else 4, *x.shape[2:], generator=g)

def _empty_rank_worker(rank, init, out, kind, kernels, runs):
    import faulthandler
    faulthandler.dump_traceback_later(4 * EMPTY_TIMEOUT, exit=True)   # a hang outside a collective ends the test too
    if kernels == 'triton': os.environ.update(CLFAST_KERNELS='triton', TRITON_INTERPRET='1')   # CUDA's code path
    from clfast.bn import make_precise, is_sync_bn
    from clfast.fuse import fuse_conv_bn
    if kernels == 'python-op':   # the layer op's Python autograd node (a GPU machine's), not the C++ one
        from clfast import ops
        ops._layer_op = lambda x: ops._conv_bn_act
    _init(rank, init, EMPTY_TIMEOUT)
    try:
        res = []
        for sizes in runs:   # one group, one run after the other: a collective one rank skipped would pair wrongly
            model = _empty_rank_model(kind)
            if kind == 'precise':
                for i, m in enumerate(model):
                    if isinstance(m, nn.BatchNorm1d): model[i] = make_precise(m, sync=True)
            else:   # fused first, then converted (not in one expression: it would look the converter up before
                # fuse_conv_bn installs clfast's in PyTorch's place, and the stock one misses the first layer's BN)
                fuse_conv_bn(model)
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(memory_format=torch.channels_last)
                assert all(is_sync_bn(m.fused_bn) for m in model.modules() if hasattr(m, 'fused_bn'))
            x, r = _empty_rank_data(kind, sum(sizes))
            lo, n = sum(sizes[:rank]), sizes[rank]
            xs = x[lo:lo + n].contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.contiguous_format)
            xs.requires_grad_()
            ddp = DDP(model)   # kept until backward is done: its reducer averages the gradients
            pred = ddp(xs)
            ((pred * r[lo:lo + n]).sum() * WORLD).backward()   # DDP averages: the gradient of the whole batch's loss
            res.append(dict(out=pred.detach(), dx=xs.grad, kinds=[type(m).__name__ for m in model.modules()],
                            grads={k: p.grad for k, p in model.named_parameters()},
                            state={k: v.detach().clone() for k, v in model.state_dict().items()}))
        torch.save(res, f"{out}/rank{rank}.pt")
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()

def _bn64(y, w, b):
    "Training BatchNorm in float64, by its formulas: the output, and what its backward takes"
    dims = [d for d in range(y.dim()) if d != 1]
    sh = [1, -1] + [1] * (y.dim() - 2)
    mean, var = y.mean(dims), y.var(dims, unbiased=False)
    invstd = (var + EPS).rsqrt()
    xhat = (y - mean.view(sh)) * invstd.view(sh)
    return xhat * w.view(sh) + b.view(sh), (xhat, invstd, w, dims, sh, mean, y.var(dims, unbiased=True))

def _bn64_back(g, saved):
    "BatchNorm's backward in float64, by its formulas: dy, dweight, dbias"
    xhat, invstd, w, dims, sh, _, _ = saved
    mean_dz = lambda t: t.mean(dims, keepdim=True)
    dx = (w * invstd).view(sh) * (g - mean_dz(g) - xhat * mean_dz(g * xhat))
    return dx, (g * xhat).sum(dims), g.sum(dims)

def _empty_rank_reference(kind:str, n:int):
    """The model on the whole batch in float64, forward and backward by hand (matrix products, `torch.nn.grad`'s conv
    gradients and BatchNorm's formulas): out, dx, the parameters' gradients and the BNs' saved statistics by name"""
    from torch.nn.grad import conv2d_input, conv2d_weight
    p = {k: v.double() for k, v in _empty_rank_model(kind).state_dict().items()}
    x, r = (t.double() for t in _empty_rank_data(kind, n))
    bn = lambda y, name: _bn64(y, p[f'{name}.weight'], p[f'{name}.bias'])
    grads, stats = {}, {}
    def bn_back(g, name, saved):
        dy, grads[f'{name}.weight'], grads[f'{name}.bias'] = _bn64_back(g, saved)
        stats[name] = saved[5:]
        return dy
    if kind == 'precise':
        z0, s0 = bn(x, '0'); h = z0 @ p['1.weight'].T; a = h.clamp_min(0)
        z3, s3 = bn(a, '3'); out = z3 @ p['4.weight'].T + p['4.bias']
        grads['4.weight'], grads['4.bias'] = r.T @ z3, r.sum(0)
        ga = bn_back(r @ p['4.weight'], '3', s3) * (h > 0)
        grads['1.weight'] = ga.T @ z0
        dx = bn_back(ga @ p['1.weight'], '0', s0)
        return out, dx, grads, stats
    conv = lambda t, name: F.conv2d(t, p[name], padding=1)
    conv_back = lambda g, t, name: (conv2d_input(t.shape, p[name], g, padding=1), conv2d_weight(t, p[name].shape, g, padding=1))
    z0, s0 = bn(conv(x, '0.weight'), '1'); a = z0.clamp_min(0)
    z1, s1 = bn(conv(a, '3.conv1.weight'), '3.bn1'); h = z1.clamp_min(0)
    z2, s2 = bn(conv(h, '3.conv2.weight'), '3.bn2'); out = (z2 + a).clamp_min(0)
    g2 = r * (out > 0)
    gh, grads['3.conv2.weight'] = conv_back(bn_back(g2, '3.bn2', s2), h, '3.conv2.weight')
    ga, grads['3.conv1.weight'] = conv_back(bn_back(gh * (h > 0), '3.bn1', s1), a, '3.conv1.weight')
    dx, grads['0.weight'] = conv_back(bn_back((ga + g2) * (a > 0), '1', s0), x, '0.weight')
    return out, dx, grads, stats

@pytest.mark.parametrize('kind,kernels', [('precise', 'cpu'), ('fused', 'cpu'), ('fused', 'python-op'),
                                          ('fused', 'triton')])
def test_synchronized_bn_with_an_empty_rank(tmp_path, kind, kernels):
    """Ranks with batches of 8 and 0 rows, then 0 and 8, synchronized (clfast's precise SyncBatchNorm on a BatchNorm1d
    head; fused conv-BN layers, one with a residual add, converted with `nn.SyncBatchNorm.convert_sync_batchnorm`) under
    DDP: nobody waits (the empty rank joins every exchange), the full rank's output and input gradient are the model's
    on its 8 rows alone (float64, by hand), the empty rank's have no rows, both ranks end with the same parameter
    gradients (the 8 rows') and running statistics (updated from the 8 rows)"""
    runs = [(8, 0), (0, 8), (0, 0)]
    _spawn(_empty_rank_worker, str(tmp_path/'init'), str(tmp_path), kind, kernels, runs, interpreted=kernels == 'triton')
    ranks = [torch.load(tmp_path/f'rank{r}.pt') for r in range(WORLD)]
    out, dx, grads, stats = _empty_rank_reference(kind, 8)
    synced = 'PreciseSyncBatchNorm' if kind == 'precise' else 'PassThroughSyncBatchNorm'
    # every rank's batch empty (a detection head with no boxes anywhere this step): the running statistics stay as they
    # were, as BatchNorm leaves them on an empty batch, and the step is counted (0/0 made them NaN, and every later
    # eval output); no gradient
    fresh = _empty_rank_model(kind).state_dict()
    for r in ranks:
        assert r[2]['out'].shape == (0, *out.shape[1:]) and r[2]['dx'].shape == (0, *dx.shape[1:])
        assert all(not g.any() for g in r[2]['grads'].values())
        for k, want in fresh.items():
            got = r[2]['state'][k]
            assert got.item() == 1 if k.endswith('num_batches_tracked') else torch.equal(got, want), f"{k}: {got}"
    for i, sizes in enumerate(runs[:2]):
        full, empty = (ranks[r][i] for r in (sizes.index(8), sizes.index(0)))
        assert synced in full['kinds'], full['kinds']
        assert empty['out'].shape == (0, *out.shape[1:]) and empty['dx'].shape == (0, *dx.shape[1:])
        assert _rel(full['out'], out) < 1e-6, f"out: rel {_rel(full['out'], out):.2e}"
        # the loss was scaled by WORLD for DDP's average of the parameters' gradients: the input's is not averaged
        assert _rel(full['dx'] / WORLD, dx) < 1e-5, f"dx: rel {_rel(full['dx'] / WORLD, dx):.2e}"
        assert full['grads'].keys() == grads.keys()
        for k, want in grads.items():
            assert torch.equal(full['grads'][k], empty['grads'][k]), f"ranks disagree on {k}'s gradient"
            assert _rel(full['grads'][k], want) < 1e-5, f"{k}: rel {_rel(full['grads'][k], want):.2e}"
        for name, (mean, var) in stats.items():
            for k, want in (('running_mean', MOMENTUM * mean), ('running_var', 1 - MOMENTUM + MOMENTUM * var)):
                assert torch.equal(full['state'][f'{name}.{k}'], empty['state'][f'{name}.{k}']), f"ranks disagree on {name}.{k}"
                assert _rel(full['state'][f'{name}.{k}'], want) < 1e-6, f"{name}.{k}: rel {_rel(full['state'][f'{name}.{k}'], want):.2e}"
            assert full['state'][f'{name}.num_batches_tracked'].item() == empty['state'][f'{name}.num_batches_tracked'].item() == 1

def _reinit_worker(rank, init):
    "A process group destroyed and made again (a notebook re-running its setup) gets fresh collectives, not stale ones"
    from clfast.fused import FusedConvBN2d
    from clfast.fuse import convert_sync_batchnorm
    for i in range(2):
        _init(rank, f"{init}{i}")
        f = convert_sync_batchnorm(FusedConvBN2d(3, 4, 3, padding=1))
        torch.manual_seed(rank)
        f(torch.randn(2 + rank, 3, 6, 6)).sum().backward()
        every = [torch.empty(4) for _ in range(WORLD)]
        dist.all_gather(every, f.bn.running_mean)
        assert torch.equal(every[0], every[1])   # synchronized: both ranks computed the same statistics
        from clfast.syncstats import _twin   # the collectives' twin group belongs to this process group, not a destroyed one
        assert dist.get_process_group_ranks(_twin(dist.group.WORLD.group_name).group) == [0, 1]
        # both ranks done with the group before either tears it down: without this, gloo aborted a rank ("terminate
        # called without an active exception") in 2 of 12 runs, at this session's start commit as well
        dist.barrier()
        dist.destroy_process_group()

def test_process_group_made_again(tmp_path): _spawn(_reinit_worker, str(tmp_path/'init'))

def _subgroup_worker(rank, init, out):
    """Ranks 0 and 1 synchronize over a subgroup, rank 2 (outside it: `new_group` gave it no group, as PyTorch's
    SyncBatchNorm takes it) trains alone; afterwards the whole world makes a group (a later `new_group`, as a user's
    evaluation or a second subgroup split would)"""
    from clfast.fuse import fuse_conv_bn, convert_sync_batchnorm
    from clfast.syncstats import _twin
    _init(rank, init, timeout=30, world=3)
    sub = dist.new_group([0, 1])   # every rank makes every group (torch's rule), uses its own
    torch.manual_seed(0); m = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU()).double()
    fuse_conv_bn(m)
    m = convert_sync_batchnorm(m, process_group=sub)   # on rank 2 too: it raised there (the group's name of no group)
    x = _data(14)[0].double()[4 * rank:4 * rank + 4 + rank]   # 4, 5 and 6 samples (rows 0-3, 4-8, 8-13)
    m(x).sum().backward()
    faulthandler.dump_traceback_later(60, exit=True)   # a rendezvous that hangs is bounded by no collective's timeout
    later = dist.new_group([0, 1, 2])
    seen = torch.tensor([float(rank)]); dist.all_reduce(seen, group=later)
    shared = _twin(sub.group_name).exchange is not None if rank < 2 else None
    torch.save(dict(mean=m.state_dict()['1.running_mean'], seen=seen, shared=shared), f"{out}/rank{rank}.pt")
    faulthandler.cancel_dump_traceback_later()
    dist.barrier(); dist.destroy_process_group()

def test_subgroup_synchronized_then_a_world_group(tmp_path):
    """Synchronizing over a subgroup of the world leaves every rank's group counter alike: a later world group forms
    (it hung: the twin group made by the subgroup's ranks alone moved their counter only). The subgroup's ranks share
    its batch statistics, fp64 reference; the rank outside, converted with the same group, keeps its own"""
    _spawn(_subgroup_worker, str(tmp_path/'init'), str(tmp_path), world=3)
    ranks = [torch.load(tmp_path/f'rank{r}.pt') for r in range(3)]
    assert [r['seen'].item() for r in ranks] == [3.0] * 3
    x = _data(14)[0].double()
    torch.manual_seed(0); conv = nn.Conv2d(3, 4, 3, bias=False).double()   # the workers' conv
    with torch.no_grad():
        both, alone = conv(x[:9]), conv(x[8:14])
    assert torch.equal(ranks[0]['mean'], ranks[1]['mean'])
    assert _rel(ranks[0]['mean'], 0.1 * both.mean((0, 2, 3))) < 1e-12
    assert _rel(ranks[2]['mean'], 0.1 * alone.mean((0, 2, 3))) < 1e-12
    from clfast.exchange import STORES_IN_ORDER
    assert [r['shared'] for r in ranks] == [STORES_IN_ORDER] * 2 + [None]   # the subgroup's own shared memory

def _message_shapes_worker(rank, init, world, channels):
    "Gloo's messages (as between hosts); the last rank's layer has `channels[1]` channels, the others' `channels[0]`"
    os.environ['CLFAST_HOST_EXCHANGE'] = '0'
    import clfast.ops   # registers torch.ops.clfast
    _init(rank, init, timeout=30, world=world)
    c = channels[rank == world - 1]
    y = torch.randn(2, c, 3, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=rf"different shapes: rank {rank} gives \[3, {c}\].*rank \d gives \[3, "
                                           rf"(?!{c}\])\d+\].*same number of channels on every rank"):
        torch.ops.clfast.synced_stats(y, dist.group.WORLD.group_name)
    dist.barrier()   # the group still works: every message was taken in
    dist.destroy_process_group()

@pytest.mark.parametrize('world,channels', [(2, (6, 4)), (3, (6, 40))])
def test_ranks_with_different_channels_all_raise_over_messages(tmp_path, world, channels):
    """Between hosts (gloo's messages), a rank whose layer has more or fewer channels than its peers': every rank raises
    the same clear error, none computes with garbage. Before, gloo aborted the process that received the longer message
    ("Received data size doesn't match expected size") and the other went on with a short read"""
    _spawn(_message_shapes_worker, str(tmp_path/'init'), world, channels, world=world)

def _failing_worker(rank, init):
    _init(rank, init)
    if rank == 1: raise ValueError("boom in rank 1")
    dist.barrier()   # rank 0 waits for a rank that is gone

def test_error_in_one_rank_ends_the_test(tmp_path, monkeypatch):
    # torch.multiprocessing keeps a failed process's error file (pytorch-errorfile-*.pickle): in the test's own folder
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
    t = time.time()
    with pytest.raises(mp.ProcessRaisedException, match="boom in rank 1"): _spawn(_failing_worker, str(tmp_path/'init'))
    assert time.time() - t < TIMEOUT

@pytest.fixture
def one_rank_gloo(tmp_path):
    dist.init_process_group('gloo', init_method=f"file://{tmp_path/'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()

def test_unfused_bn_on_cpu_is_synchronized_by_clfast(one_rank_gloo, monkeypatch):
    "PyTorch's SyncBatchNorm cannot run on the CPU: a BN clfast cannot fuse becomes clfast's precise SyncBatchNorm in "
    "place; where that cannot run either (no C++ kernels), it is refused by name, before any change"
    import clfast.fuse.syncbn
    from clfast.fuse import fuse_conv_bn
    from clfast.bn import PreciseSyncBatchNorm
    m = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    fuse_conv_bn(m)
    kinds = [type(a) for a in m.modules()]
    monkeypatch.setattr(clfast.fuse.syncbn, 'cpu_sync_capable', lambda bn: False)
    with pytest.raises(RuntimeError, match=r"would become.*: 0 \(BN's input is the module's input.*sync_bn=False"):
        nn.SyncBatchNorm.convert_sync_batchnorm(m)
    assert [type(a) for a in m.modules()] == kinds
    monkeypatch.undo()
    assert nn.SyncBatchNorm.convert_sync_batchnorm(m) is m and type(m[0]) is PreciseSyncBatchNorm
    assert m[0].process_group is None and not isinstance(m[0], nn.SyncBatchNorm)

def test_a_bn_without_tensors_synchronizes_where_the_model_is(one_rank_gloo):
    """A BN with neither affine parameters nor running statistics has no tensor to say where it is: under gloo it became
    PyTorch's SyncBatchNorm on a CPU model, which cannot run there (and was not refused). It is now where the model's
    first tensor is: clfast's precise BN on the CPU, which normalizes as fp64 does; PyTorch's elsewhere (meta standing
    in for a GPU)"""
    from clfast.bn import PreciseSyncBatchNorm
    from clfast.fuse import convert_sync_batchnorm
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, affine=False, track_running_stats=False))
    convert_sync_batchnorm(m)
    assert type(m[1]) is PreciseSyncBatchNorm
    x = torch.randn(4, 3, 10, 10)
    with torch.no_grad():
        y = m[0](x).double()
        want = F.batch_norm(y, None, None, training=True, eps=m[1].eps)
        err = (m(x).double() - want).abs().max().item()
    assert err < 1e-5, err
    on_meta = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, affine=False, track_running_stats=False)).to('meta'))
    assert type(on_meta[1]) is nn.SyncBatchNorm

def _func_refusal_worker(rank, init):
    from torch.func import functional_call, grad
    from clfast.fuse import convert_sync_batchnorm, fuse_conv_bn
    _init(rank, init)
    try:
        x = torch.randn(4, 3, 10, 10)
        for fuse in (False, True):
            # (no running statistics, as `torch.func.replace_all_batch_norm_modules_` makes them: torch.func refuses
            # their update in place)
            m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, track_running_stats=False), nn.SiLU())
            if fuse: fuse_conv_bn(m)
            convert_sync_batchnorm(m)
            loss = lambda p: functional_call(m, p, (x,)).sum()
            with pytest.raises(RuntimeError, match=r"cannot run inside a torch.func transform.*BatchNorms are not synchronized"):
                grad(loss)(dict(m.named_parameters()))
            # a second differentiation, as PyTorch's SyncBatchNorm has none (each rank refuses before its exchange)
            out = m(x.requires_grad_())
            with pytest.raises(RuntimeError, match=r"synchronized BatchNorm has no double backward.*not synchronized"):
                torch.autograd.grad(out.square().sum(), x, create_graph=True)
            x = x.detach()
    finally: dist.destroy_process_group()

def test_a_synchronized_bn_inside_torch_func_is_refused_by_name(tmp_path):
    """torch.func cannot run clfast's synchronizing op (a C++ autograd Function): a synchronized BN training on the CPU,
    alone or fused, says so and what to do in each rank, where torch's own error named neither clfast nor the module;
    and so does backward under `create_graph=True`, which PyTorch's SyncBatchNorm cannot differentiate again either"""
    _spawn(_func_refusal_worker, str(tmp_path/'init'))

@pytest.mark.cuda
def test_to_distributed_synchronizes_bns_on_the_device_the_fit_runs_on(tmp_path, monkeypatch):
    """fastai's learner keeps its model where it was made (the CPU) until the fit moves it: under a group where gloo
    serves CPU tensors and NCCL CUDA ones, `to_distributed` converted its BNs there, to clfast's CPU-only precise BN,
    whose first CUDA batch raised. Converted on accelerate's device, they are PyTorch's SyncBatchNorm, and a fit trains"""
    from fastai.vision.all import Learner
    from clfast.bn import PreciseSyncBatchNorm
    from helpers import image_dls
    import clfast.distrib   # noqa: F401
    from accelerate.state import AcceleratorState
    # torchrun's variables: accelerate reads LOCAL_RANK to know it runs distributed (without it, one process is not,
    # and `prepare` leaves the model unwrapped); its state is a process-wide singleton, made afresh for this test
    for k, v in dict(RANK='0', LOCAL_RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(k, v)
    AcceleratorState._reset_state(reset_partial_state=True)
    dist.init_process_group('cpu:gloo,cuda:nccl', init_method=f"file://{tmp_path/'init'}", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.BatchNorm1d(8), nn.Linear(8, 2))
        learn = Learner(image_dls().to('cuda'), model, loss_func=nn.CrossEntropyLoss()).to_distributed()
        assert not any(isinstance(m, PreciseSyncBatchNorm) for m in learn.model.modules())
        assert sum(isinstance(m, nn.SyncBatchNorm) for m in learn.model.modules()) == 2
        with learn.no_bar(), learn.no_logging(): learn.fit(1)
        assert next(learn.model.parameters()).is_cuda and torch.isfinite(torch.tensor(learn.recorder.values[-1])).all()
    finally:
        dist.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)

@pytest.mark.parametrize('mode', ['speed', 'memory', 'off'])
def test_a_group_of_one_rank_normalizes_as_batchnorm(one_rank_gloo, mode):
    """A synchronized BN over a group of one rank (`torchrun --nproc_per_node 1`) does PyTorch's SyncBatchNorm's work
    there: BatchNorm's, unsynchronized. A fused model (converted after fusing) and an unfused one (clfast's
    precise SyncBatchNorm) train as the stock model in fp64; an empty batch gives an empty output and leaves the
    running statistics as they were, the step counted (it raised: "batch statistics need at least one value")"""
    from clfast.fuse import fuse_conv_bn, convert_sync_batchnorm
    import torchvision
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                        torchvision.models.resnet.BasicBlock(4, 4)).double()
    m = copy.deepcopy(ref)
    if mode != 'off': fuse_conv_bn(m, mode)
    m = convert_sync_batchnorm(m).to(memory_format=torch.channels_last)
    x = (torch.randn(3, 3, 5, 5, dtype=torch.float64) * 2 + 1).to(memory_format=torch.channels_last)
    for batch in (x, x[:0]):
        got, want = m(batch.clone().requires_grad_()), ref(batch.clone().requires_grad_())
        assert got.shape == want.shape
        got.square().sum().backward(); want.square().sum().backward()
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
        for (k, a), b in zip(m.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=k)
        for (k, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-10, rtol=1e-10, msg=k)
    assert all(v.item() == 2 for k, v in m.state_dict().items() if k.endswith('num_batches_tracked'))

def test_standalone_fused_module_converts(one_rank_gloo):
    """A FusedConvBN2d built directly runs its child `bn`: converted (as PyTorch converts: a new BN over the same
    parameters and buffers put in its place), it synchronizes and unfolds to SyncBatchNorm"""
    from clfast.fused import FusedConvBN2d
    from clfast.bn import is_sync_bn
    from clfast.fuse import convert_sync_batchnorm
    f = FusedConvBN2d(3, 4, 3, padding=1)
    bn = f.bn
    g = convert_sync_batchnorm(f)
    assert g is f and f.bn is not bn and is_sync_bn(f.bn) and not isinstance(f.bn, nn.SyncBatchNorm)
    assert f.bn.weight is bn.weight and f.bn.running_mean is bn.running_mean
    assert [type(m) for m in f.to_stock()][:2] == [nn.Conv2d, nn.SyncBatchNorm]
    DDP(f)   # DDP refuses real SyncBatchNorm modules on the CPU; the pass-through is a BatchNorm2d

def test_synchronized_fused_layer_the_stock_way(one_rank_gloo):
    """A synchronized fused layer run the stock way (`set_layer_way('stock')`, or 'timed' choosing it once the fit is
    over): training synchronizes through clfast's BN on the CPU, eval runs BN's rules; both as stock BN in fp64"""
    from clfast.fused import FusedConvBN2d, set_layer_way
    from clfast.fuse import convert_sync_batchnorm
    torch.manual_seed(0)
    f = convert_sync_batchnorm(FusedConvBN2d(3, 4, 3, padding=1, act='relu')).double().to(memory_format=torch.channels_last)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU()).double()
    ref.load_state_dict(f.to_stock().state_dict())
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    prev = set_layer_way('stock')
    try:
        for train in (True, False):
            f.train(train); ref.train(train)
            got, want = f(x.to(memory_format=torch.channels_last)), ref(x)
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
            got.sum().backward(); want.sum().backward()
            torch.testing.assert_close(f.weight.grad, ref[0].weight.grad, atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(f.bn.running_var, ref[1].running_var, atol=1e-12, rtol=1e-12)
    finally: set_layer_way(prev)

def _fastai_worker(rank, port, out, sync_bn):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR='127.0.0.1',
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from fastai.vision.all import Learner, CrossEntropyLossFlat, accuracy
    import clfast.all   # to_channelslast, and fastai's distrib_ctx made to work on gloo (clfast.distrib)
    from clfast.demo import digits_dls, simple_cnn
    dls = digits_dls(bs=16, n_items=128, size=16)
    learn = Learner(dls, simple_cnn(widths=(8, 16)), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    learn.to_channelslast(fuse='speed')
    with learn.distrib_ctx(sync_bn=sync_bn):
        learn.fit(1, 1e-2)
        kinds = {type(m).__name__ for m in learn.model.modules()}
    vec = torch.cat([t.detach().flatten().double() for t in learn.model.state_dict().values()])
    every = [torch.empty_like(vec) for _ in range(WORLD)]
    dist.all_gather(every, vec)
    torch.save(dict(kinds=kinds, values=learn.recorder.values, every=every,
                    n_bn=sum(isinstance(m, nn.BatchNorm2d) for m in learn.model.modules())), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

@pytest.mark.parametrize('sync_bn', [False])   # sync_bn=True, fastai's default, is the README script's (below)
def test_fastai_distrib_ctx_fused(tmp_path, sync_bn):
    """`learn.to_channelslast(fuse=...)` inside `learn.distrib_ctx()` fits on 2 CPU ranks (gloo): fastai's DistributedDL
    and accelerate's CPU mode work, the fused layers are synchronized exactly when sync_bn (the numerics of that are
    `test_synced_fused_training_equals_one_process`'s), and the ranks end with the same weights and statistics"""
    _spawn(_fastai_worker, _free_port(), str(tmp_path), sync_bn)
    r = torch.load(tmp_path/'rank0.pt', weights_only=False)
    assert r['n_bn'] > 0 and {'PassThroughBN2d', 'PassThroughSyncBatchNorm'} & r['kinds']   # fused
    assert ('PassThroughSyncBatchNorm' in r['kinds']) == sync_bn and 'SyncBatchNorm' not in r['kinds']
    assert all(torch.isfinite(torch.tensor(v[:2])).all() for v in r['values'])
    a, b = r['every']
    assert torch.equal(a, b)

def test_torch_converter_replaced_only_once_a_model_is_fused():
    """Importing clfast leaves PyTorch's (and timm's) convert_sync_batchnorm alone; fusing a model puts clfast's in
    their place, since on a fused model theirs would apply BN twice (a fresh process: this one has fused models)"""
    code = textwrap.dedent("""
        import torch.nn as nn, timm.layers
        from clfast.all import *
        assert 'clfast' not in nn.SyncBatchNorm.convert_sync_batchnorm.__func__.__code__.co_filename
        assert 'clfast' not in timm.layers.convert_sync_batchnorm.__module__
        fuse_conv_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
        assert 'clfast' in nn.SyncBatchNorm.convert_sync_batchnorm.__func__.__code__.co_filename
        assert timm.layers.convert_sync_batchnorm.__module__.startswith('clfast')
        m = nn.SyncBatchNorm.convert_sync_batchnorm(fuse_conv_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))))
        assert type(m[1]).__name__ == 'PassThroughSyncBatchNorm'
        print('ok')""")
    p = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert p.returncode == 0 and p.stdout.strip() == 'ok', p.stdout + p.stderr[-3000:]

def _spelling_worker(rank, init, out, backend):
    from clfast.fuse import fuse_conv_bn
    from clfast.syncstats import _twin
    dist.init_process_group(backend, init_method=f'file://{init}', rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=TIMEOUT))
    torch.set_num_threads(1)
    try:
        m = nn.SyncBatchNorm.convert_sync_batchnorm(fuse_conv_bn(_spelled_net())).to(memory_format=torch.channels_last)
        x = _spelled_batch()[rank * 4:(rank + 1) * 4].contiguous(memory_format=torch.channels_last)
        y = m(x)
        y.square().sum().backward()
        torch.save(dict(y=y.detach(), kinds=[type(a).__name__ for a in m.modules()],
                        shared=_twin(dist.group.WORLD.group_name).exchange is not None), f"{out}/rank{rank}.pt")
    finally: dist.destroy_process_group()

def _spelled_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm2d(4))

def _spelled_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 6, 6, generator=g) * torch.linspace(0.5, 3, 8).view(8, 1, 1, 1)

@pytest.mark.parametrize('backend', [None, 'cpu:gloo'])
def test_gloo_spelled_otherwise(tmp_path, backend):
    """`init_process_group()` with no backend (torchrun's scripts; torch names it 'undefined' on a CPU machine) or
    'cpu:gloo' is gloo for CPU tensors: the unfused BN becomes clfast's synchronized BN (PyTorch's SyncBatchNorm cannot
    run on the CPU), the fused layer exchanges through shared memory, and both match fp64 over both ranks' batch"""
    _spawn(_spelling_worker, str(tmp_path/'init'), str(tmp_path), backend)
    want = _spelled_net().double()(_spelled_batch().double())
    for rank in (0, 1):
        got = torch.load(tmp_path/f"rank{rank}.pt")
        assert 'SyncBatchNorm' not in got['kinds'] and got['shared'], got
        torch.testing.assert_close(got['y'].double(), want[rank * 4:(rank + 1) * 4].detach(), rtol=1e-4, atol=1e-5)

def _unfuse_worker(rank, init, out):
    from clfast.fuse import fuse_conv_bn, unfuse_conv_bn
    _init(rank, init)
    try:
        m = nn.SyncBatchNorm.convert_sync_batchnorm(fuse_conv_bn(_spelled_net())).to(memory_format=torch.channels_last)
        x = _spelled_batch()[rank * 4:(rank + 1) * 4].contiguous(memory_format=torch.channels_last)
        DDP(m)(x).sum().backward()
        unfuse_conv_bn(m)   # as learn.to_contiguous() does
        m.zero_grad()
        y = DDP(m)(x)
        torch.save(dict(y=y.detach(), kinds=[type(a).__name__ for a in m.modules()]), f"{out}/rank{rank}.pt")
    finally: dist.destroy_process_group()

def test_unfused_after_synchronizing_trains_on_the_cpu(tmp_path):
    """A fused model synchronized over gloo, then unfused (`unfuse_conv_bn`, `learn.to_contiguous()`): its BNs unfuse to
    clfast's synchronized BN, which runs on the CPU (PyTorch's SyncBatchNorm refused: 'only work with GPU modules'); the
    next step matches fp64 over both ranks' batch (the running statistics after one step: the model's BN layers')"""
    _spawn(_unfuse_worker, str(tmp_path/'init'), str(tmp_path))
    stock, x = _spelled_net().double(), _spelled_batch().double()
    stock(x)   # the fused step's running statistics
    want = stock(x)
    for rank in (0, 1):
        got = torch.load(tmp_path/f"rank{rank}.pt")
        assert 'SyncBatchNorm' not in got['kinds'] and 'PreciseSyncBatchNorm' in got['kinds'], got['kinds']
        torch.testing.assert_close(got['y'].double(), want[rank * 4:(rank + 1) * 4].detach(), rtol=1e-4, atol=1e-5)

def _finder_learner(rank):
    "A conv net with BatchNorms on 64 random images of this rank's own (as DDP's ranks see theirs), no loader workers"
    from fastai.vision.all import DataLoaders, Learner, ConvLayer, Flatten, CrossEntropyLossFlat, Adam, TensorImage, TensorCategory
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 3, 16, 16, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long()
    items = list(zip(TensorImage(x), TensorCategory(y)))
    dls = DataLoaders.from_dsets(items[:48], items[48:], bs=16, device='cpu', num_workers=0)
    torch.manual_seed(0)
    model = nn.Sequential(ConvLayer(3, 8), ConvLayer(8, 16, stride=2), nn.AdaptiveAvgPool2d(1), Flatten(), nn.Linear(16, 2))
    return Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=Adam)

def _model_state(learn):
    return [type(m).__name__ for m in learn.model.modules()], {k: v.clone() for k, v in learn.model.state_dict().items()}

def _same_state(a, b): return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(v, b[1][k]) for k, v in a[1].items())

def _finder_worker(rank, port, init, out, how):
    import faulthandler
    faulthandler.dump_traceback_later(60, exit=True)   # a hang ends the rank, and so fails the test, instead of blocking it
    import clfast.all   # to_channelslast, format_find, fastai's distrib_ctx on gloo
    from clfast.finder import Setup, BASELINE, best_setup
    from clfast.fuse import convert_sync_batchnorm
    learn = _finder_learner(rank)
    if how == 'distrib_ctx':   # fastai's: the fused layers become synchronized ones on entry (sync_bn=True)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR='127.0.0.1',
                          MASTER_PORT=str(port))
        torch.set_num_threads(1)
        learn.to_channelslast(fuse='speed')
        ctx = learn.distrib_ctx(sync_bn=True)
    else:   # a script's process group; the BNs synchronized over a group of their own (which `deepcopy` cannot copy)
        _init(rank, init, timeout=30)
        learn.model = convert_sync_batchnorm(learn.model, process_group=dist.new_group([0, 1]))
        ctx = contextlib.nullcontext()
    with ctx:
        before = _model_state(learn)
        time.sleep(3 * rank)   # rank 1 starts its find 3 s after rank 0, as a rank that logged or saved first
        df = learn.format_find(setups=[BASELINE, Setup(fuse='speed'), Setup(dtype=torch.bfloat16)], n_batches=3,
                               show_plot=False, budget=2.)
        unchanged = _same_state(before, _model_state(learn))
        learn.to_channelslast(auto=True)   # from the stored table
        torch.save(dict(df=df, best=best_setup(df)[0], unchanged=unchanged, before=before[0],
                        after=_model_state(learn)[0],   # fastai shows progress on rank 0 only
                        cbs=[type(c).__name__ for c in learn.cbs if type(c).__name__ != 'ProgressCallback']), f"{out}/rank{rank}.pt")
        dist.barrier()
        if how != 'distrib_ctx': dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()

@pytest.mark.parametrize('how', ['distrib_ctx', 'own group'])
def test_format_find_in_a_process_group_measures_in_lockstep(tmp_path, how):
    """`format_find` on every rank of a process group, the model's BNs synchronized (collectives in every step), rank 1
    starting 3 s late, a budget of 2 s: the ranks measure the same setups and steps together (each rank counting its
    own steps from its own clock hung the other in its next collective), and every rank gets rank 0's table, so
    `to_channelslast(auto=True)` sets them up alike (each picked from its own timings before); the learners unchanged"""
    _spawn(_finder_worker, _free_port(), str(tmp_path/'init'), str(tmp_path), how)
    r0, r1 = (torch.load(tmp_path/f'rank{r}.pt', weights_only=False) for r in range(WORLD))
    df = r0['df']
    assert any('SyncBatchNorm' in k for k in r0['before']), r0['before']   # what was measured synchronizes
    for r in (r0, r1): assert r['unchanged'] and (r['df'].error == '').all(), r['df'].error.to_dict()
    assert df.equals(r1['df']) and df.attrs == r1['df'].attrs and 'lockstep' in df.attrs['ranks']
    assert r0['best'] == r1['best'] and r0['after'] == r1['after'] and r0['cbs'] == r1['cbs']
    assert df.steps.nunique() == 1
    # the stock setups stepped in the same order on both ranks (a set of dtypes iterates in a per-process order; their
    # synchronized statistics were mixed then): the stock fp32 step is the baseline's, to the bit
    fp32 = df[[' fp32' in n for n in df.index]]
    assert (fp32[fp32.grad_batch == 0].stock_grad_error == df.loc['contiguous fp32', 'grad_error']).all(), df

def _one_rank_finder_worker(rank, init, out):
    import faulthandler
    faulthandler.dump_traceback_later(60, exit=True)
    import clfast.all, clfast.finder
    from clfast.finder import Setup, BASELINE
    from clfast.fuse import convert_sync_batchnorm
    _init(rank, init, timeout=30)
    learn = _finder_learner(rank)
    learn.model = convert_sync_batchnorm(learn.model)
    clfast.finder.JOIN_TIMEOUT = 2.
    before, err, took = _model_state(learn), None, 0.
    if rank == 0:   # as `if rank_distrib() == 0: learn.format_find()`
        t = time.time()
        try: learn.format_find(n_batches=2, show_plot=False)
        except RuntimeError as e: err = str(e)
        took = time.time() - t
    unchanged = _same_state(before, _model_state(learn))
    dist.barrier()
    df = learn.format_find(setups=[BASELINE, Setup()], n_batches=2, show_plot=False, budget=None)   # then on every rank
    torch.save(dict(err=err, took=took, unchanged=unchanged, df=df), f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()

def test_format_find_on_one_rank_is_refused(tmp_path):
    """`format_find` on rank 0 alone (the other rank never calls it) with synchronized BNs hung in its first collective;
    it raises, after `JOIN_TIMEOUT`, saying to call it on every rank, nothing measured or changed, and the next find on
    every rank meets and measures"""
    _spawn(_one_rank_finder_worker, str(tmp_path/'init'), str(tmp_path))
    r0, r1 = (torch.load(tmp_path/f'rank{r}.pt', weights_only=False) for r in range(WORLD))
    assert r0['err'] and 'rank(s) 1 did not within 2 s' in r0['err'] and 'on every rank' in r0['err'], r0['err']
    assert 2 <= r0['took'] < 10 and r0['unchanged']
    assert r0['df'].equals(r1['df']) and (r0['df'].error == '').all()

def test_a_refused_cpu_sync_bn_leaves_the_learner_as_it_was(one_rank_gloo):
    """`to_channelslast(fuse=...)` of a model with a CPU SyncBatchNorm clfast cannot fuse (timm's, with a Tanh) is
    refused, as before; but it was refused after the model had been fused and the learner's callbacks swapped"""
    from fastai.vision.all import Learner
    from timm.layers.norm_act import SyncBatchNormAct
    from helpers import image_dls
    import clfast.callback   # noqa: F401
    # made synchronized directly (PyTorch's and timm's converters are clfast's once a model was fused: they refuse it)
    bn_act = SyncBatchNormAct(4)   # as timm's converter makes it
    bn_act.act, bn_act.drop = nn.Tanh(), nn.Identity()
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4), nn.ReLU(), nn.Conv2d(4, 4, 3), bn_act,
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    learn = Learner(image_dls(), m, loss_func=nn.CrossEntropyLoss()).to_fp16()
    cbs, kinds, params = list(learn.cbs), [type(c) for c in m.modules()], list(m.parameters())
    with pytest.raises(RuntimeError, match='SyncBatchNorm on the CPU'): learn.to_channelslast(fuse='speed', amp_mode='bf16')
    assert list(learn.cbs) == cbs and learn.model is m
    assert [type(c) for c in m.modules()] == kinds and all(a is b for a, b in zip(m.parameters(), params))
