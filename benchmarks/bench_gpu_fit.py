"""Training throughput through fastai's own `Learner.fit` on a CUDA GPU: every setup issue 34 names, side by side in
one run, ending with one table (img/s, ratio to stock channels-last and to stock fastai `to_channelslast()`, peak
memory, time of the first steps: compile, capture, clfast's per-layer timing) and issue 34's done-when read off it.

    python benchmarks/bench_gpu_fit.py                       # resnet50 + efficientnet_b0, batch 256 and 64, bf16 and fp16
    python benchmarks/bench_gpu_fit.py --budget 300 --models resnet50 --bs 256 --dtypes bfloat16
    python benchmarks/bench_gpu_fit.py --device cpu --models resnet18 --bs 4 --px 64 --steps 2 --warm 5   # a dry run

Batches are synthetic and in memory (one batch of random images on the device, served again each step: the loader
costs nothing, the step is the model's, the optimizer's and fastai's own callbacks'). One group is a model, batch size
and dtype: each of its setups trains its own copy of the model, and `--rounds` times over, in an order rotated each
round, each setup runs one `fit` of `warm + steps` batches, the clock over the last `steps` (GPU synchronized at both
ends), after the setup's first steps (which compile, capture its CUDA graph, or time clfast's layers). A setup's img/s
is its median over the rounds and its ratio to another the median of the per-round ratios: setups measured seconds
apart, so that the machine's drift (a 17% swing between two runs of one row on an H100) cancels. Peak memory is a
setup's own: its step's peak over what was allocated before that fit, plus its model, gradients and optimizer state.
Groups run in priority order (the issue's goals first) until `--budget` seconds are spent; the rest print as not run.
"""
from __future__ import annotations
import argparse, copy, gc, signal, statistics, sys, time, warnings
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from torch import nn
from fastai.data.load import DataLoader
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from fastai.callback.core import Callback
from fastai.torch_core import TensorImage, TensorCategory
import fastai.callback.fp16 as fastai_fp16
import fastai.callback.channelslast as fastai_cl
from clfast.all import *   # clfast's Learner.to_channelslast; the stock rows use fastai's own callbacks directly
from clfast.gpu_report import counting_compiles

# what each setup does to a fresh Learner (dtype: 'bf16' or 'fp16')
def _stock_amp(learn, dtype, channels_last=False, fastai_callback=False):
    if channels_last and not fastai_callback: learn.model.to(memory_format=torch.channels_last)
    cbs = [fastai_fp16.MixedPrecision(amp_mode=dtype)]
    if fastai_callback: cbs.insert(0, fastai_cl.ChannelsLast())   # exactly what fastai's `to_channelslast()` adds
    learn.add_cbs(cbs)

SETUPS = {   # name: (what it does, its description)
    'contiguous':     (lambda l, d: _stock_amp(l, d), "contiguous, fastai AMP"),
    'stock-cl':       (lambda l, d: _stock_amp(l, d, channels_last=True), "stock channels-last, fastai AMP"),
    'stock-cl-bench': (lambda l, d: _stock_amp(l, d, channels_last=True),
                       "stock channels-last, fastai AMP, cudnn.benchmark=True"),
    'fastai':         (lambda l, d: _stock_amp(l, d, fastai_callback=True), "stock fastai to_channelslast()"),
    'compile-cl':     (lambda l, d: (_stock_amp(l, d, channels_last=True), l.model.compile()), "torch.compile of stock channels-last"),
    'clfast':         (lambda l, d: l.to_channelslast(amp_mode=d), "clfast to_channelslast() (default)"),
    'speed':          (lambda l, d: l.to_channelslast(amp_mode=d, fuse='speed'), "clfast fuse='speed'"),
    'speed-compiled': (lambda l, d: l.to_channelslast(amp_mode=d, fuse='speed'),
                       "clfast fuse='speed', Triton's compiled kernels called directly"),
    'memory':         (lambda l, d: l.to_channelslast(amp_mode=d, fuse='memory'), "clfast fuse='memory'"),
    'graphs':         (lambda l, d: l.to_channelslast(amp_mode=d, graphs=True), "clfast graphs=True"),
    'graphs-if-faster': (lambda l, d: l.to_channelslast(amp_mode=d, graphs='if_faster'), "clfast graphs='if_faster'"),
    'speed+graphs':   (lambda l, d: l.to_channelslast(amp_mode=d, fuse='speed', graphs=True), "clfast fuse='speed', graphs=True"),
    'memory+graphs':  (lambda l, d: l.to_channelslast(amp_mode=d, fuse='memory', graphs=True), "clfast fuse='memory', graphs=True"),
    'speed+compile':  (lambda l, d: l.to_channelslast(amp_mode=d, fuse='speed', compile=True), "clfast fuse='speed', compile=True"),
}
COMPILED = {'compile-cl', 'speed+compile'}   # setups that torch.compile (about a minute each)
LAUNCH = {'speed-compiled': 'compiled'}   # setups whose fits launch Triton's kernels another way than Triton's own
# setups whose fits run with cuDNN's algorithm search (`torch.backends.cudnn.benchmark`) on: PyTorch's default is off
# and fastai leaves it so (unless `setup_cuda()` is called); whether cuDNN's heuristics pick slower channels-last convs
# than its search is a premise to measure before clfast turns it on for anyone
CUDNN_BENCHMARK = {'stock-cl-bench'}
GOALS = ['stock-cl', 'fastai', 'clfast', 'speed+graphs']   # what issue 34's done-when compares: in every group first run
# the other setups, once the goals' rows ran: among them those two GPU runs measured alike (eager 'speed' and its compiled
# launches 0.77-0.86x stock at batch 64, cuDNN's algorithm search 1.00x at 256), moved here so that one call reaches
# the last model's goal rows in fp16 (the H200's, session 48, stopped after 6 of the 8 goal groups)
LATER = ['speed', 'graphs', 'contiguous', 'speed-compiled', 'stock-cl-bench', 'speed+compile']

def plan(models, batch_sizes, dtypes) -> list:
    """Groups (model, batch, dtype, setups) in priority order: first the rows issue 34's done-when compares (a GPU
    session has about one call of 9 minutes): for the first model, clfast's best setup without compile against
    `torch.compile` at the largest batch and against fastai's `to_channelslast()` at the smallest, 'memory', the
    default against fastai's, and at the smallest batch, where the host bounds the step, graphs with stock layers and
    'memory' with graphs; then the other models' against stock; then every other setup"""
    first, big, small = models[0], max(batch_sizes), min(batch_sizes)
    def goals(m, bs, dt):
        if m != first: return list(GOALS)
        # graphs='if_faster' at both batches: a candidate for the default on CUDA, whose measure must keep the graphs
        # where they pay (batch 64) and drop them where they do not
        return GOALS + ['memory', 'graphs-if-faster'] + (['compile-cl'] if bs == big else []) + \
               (['graphs', 'memory+graphs'] if bs == small else [])
    groups = [(m, bs, dt, goals(m, bs, dt)) for m in models for dt in dtypes for bs in batch_sizes]
    # then the rest, each beside stock channels-last (a group's ratios are its own rounds')
    once = {'speed+compile', 'stock-cl-bench'}   # the first model, largest batch, first dtype only
    later = lambda m, bs, dt: [s for s in LATER if s not in goals(m, bs, dt) and (s not in once or (m == first and bs == big and dt == dtypes[0]))]
    groups += [(m, bs, dt, ['stock-cl'] + later(m, bs, dt)) for m in models for dt in dtypes for bs in batch_sizes]
    return groups

def model_source(name:str) -> tuple[str, str]:
    """(library, model): 'tv:' or 'timm:' before the name says which; a bare name is torchvision's where torchvision has
    it (resnet50 and efficientnet_b0 in every GPU run so far), else timm's. The table names the library"""
    lib, _, model = name.rpartition(':')
    if lib:
        if lib not in ('tv', 'timm'): sys.exit(f"bench_gpu_fit: --models {name}: 'tv:' (torchvision) or 'timm:' before a name")
        return lib, model
    import torchvision
    return ('tv' if hasattr(torchvision.models, name) else 'timm'), name

def make_model(name:str) -> nn.Module:
    lib, model = model_source(name)
    if lib == 'tv':
        import torchvision
        return getattr(torchvision.models, model)()
    import timm
    return timm.create_model(model, pretrained=False)

class SameBatch(DataLoader):
    "`n` steps of one batch already on the device: a loader that costs nothing"
    def __init__(self, xb, yb, n:int):
        super().__init__(n=n * len(xb), bs=len(xb), shuffle=False, drop_last=True, device=None)
        self.batch, self.steps = (xb, yb), n
    def create_batches(self, samps):
        for _ in range(self.steps): yield self.batch

class Clock(Callback):
    "Wall time of the training batches after the first `warm` (the GPU synchronized at both ends), and of the first ones"
    order = 100
    def __init__(self, warm:int, sync): self.warm, self.sync, self.t0, self.t1 = warm, sync, None, None
    def before_fit(self): self.sync(); self.start = time.perf_counter()
    def before_batch(self):
        if self.training and self.iter == self.warm: self.sync(); self.t0 = time.perf_counter()
    def after_batch(self):
        if self.training and self.iter == self.n_iter - 1: self.sync(); self.t1 = time.perf_counter()

def _own_bytes(learn) -> int:
    "What a Learner keeps between steps: its model's parameters and buffers, their gradients, the optimizer's state"
    ts = [*learn.model.parameters(), *learn.model.buffers(), *(p.grad for p in learn.model.parameters() if p.grad is not None)]
    if learn.opt is not None:
        ts += [v for st in learn.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts if t.device.type == 'cuda'}
    return sum(storages.values())

class Group:
    "One model, batch size and dtype: each setup's Learner, fitted once per round"
    def __init__(self, model_name, bs, dtype, setups, args, bases):
        self.key, self.setups, self.args = (model_name, bs, dtype), list(setups), args
        self.dev = torch.device(args.device)
        g = torch.Generator().manual_seed(0)
        self.xb = TensorImage(torch.randn(bs, 3, args.px, args.px, generator=g).to(self.dev))   # contiguous, as a loader's batch is
        self.yb = TensorCategory(torch.randint(0, 1000, (bs,), generator=g).to(self.dev))
        if model_name not in bases: bases[model_name] = make_model(model_name)
        self.base, self.learners, self.runs = bases[model_name], {}, {s: {} for s in setups}   # setup -> {round: img/s}
        self.notes, self.errors, self.first_s, self.peak = {}, {}, {}, {}

    def sync(self):
        if self.dev.type == 'cuda': torch.cuda.synchronize()

    def _learner(self, setup):
        n = self.args.warm + self.args.steps
        dls = DataLoaders(SameBatch(self.xb, self.yb, n), SameBatch(self.xb, self.yb, 0), device=self.dev)
        learn = Learner(dls, copy.deepcopy(self.base).to(self.dev), loss_func=CrossEntropyLossFlat(), lr=1e-4)
        SETUPS[setup][0](learn, {'bfloat16': 'bf16', 'float16': 'fp16'}[self.key[2]])
        return learn

    def fit(self, setup, first:bool):
        "One fit of `setup`: its img/s over the timed steps"
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter('always')
            if setup not in self.learners: self.learners[setup] = self._learner(setup)
            learn, clock = self.learners[setup], Clock(self.args.warm, self.sync)
            cuda = self.dev.type == 'cuda'
            if cuda:   # what the fit adds to what is allocated, plus what this Learner already held: its own peak
                self.sync(); before, own = torch.cuda.memory_allocated(), _own_bytes(learn); torch.cuda.reset_peak_memory_stats()
            from clfast.triton_kernels import launching
            from clfast import fused
            known = set(fused._ways)
            benchmark, torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark, setup in CUDNN_BENCHMARK
            try:
                with learn.no_logging(), learn.no_bar(), launching(LAUNCH.get(setup, 'jit')): learn.fit(1, cbs=[clock])
            finally: torch.backends.cudnn.benchmark = benchmark
            # the 'timed' layers this fit chose (shapes an earlier setup chose for are not counted again)
            chose = [('graphed' in k[:2], w) for k, w in fused._ways.items() if k not in known]
            if cuda: self.peak[setup] = (torch.cuda.max_memory_allocated() - before + own) / 2**30
        if first:
            self.first_s[setup] = clock.t0 - clock.start
            self.notes[setup] = sorted({str(w.message).split(';')[0][:120] for w in said
                                        if 'clfast' in type(w.message).__module__ or 'CudaGraphs' in str(w.message)})
        graphs = getattr(learn, 'cuda_graphs', None)
        if graphs is not None and not self.notes[setup]:
            retried = f", captured at a second try (the first: {graphs.retried[0][:100]})" if graphs.retried else ''
            self.notes[setup] = [f"{graphs.captured} shape(s) replayed{retried}"]
        if first and graphs is not None and graphs.measured:   # graphs='if_faster': the first fit's measure
            m = graphs.measured
            eager = 'unmeasured (every eager step skipped by the scaler)' if m['eager_ms'] is None else f"{m['eager_ms']:.1f}"
            self.notes[setup].append(f"measured: replays {m['replay_ms']:.1f} ms a step, eager {eager}: "
                                     f"{'kept' if m['kept'] else 'dropped'}")
        if first and chose:
            for graphed in (False, True):
                ways = [w for g, w in chose if g == graphed]
                if ways: self.notes[setup].append(f"{'graph' if graphed else 'eager'} layers timed {ways.count('fused')} "
                                                  f"fused / {ways.count('stock')} stock")
        return self.args.steps * self.key[1] / (clock.t1 - clock.t0)

    def run(self, log):
        for r in range(self.args.rounds):
            k = r % len(self.setups)
            for setup in self.setups[k:] + self.setups[:k]:
                if setup in self.errors: continue
                t = time.perf_counter()
                try: self.runs[setup][r] = self.fit(setup, first=r == 0)
                except Exception as e:
                    self.errors[setup] = (f"{type(e).__name__}: {str(e).strip().splitlines()[0][:150]}" if str(e).strip()
                                          else type(e).__name__)
                    self.learners.pop(setup, None)
                    _free(self.dev, compiled=False)   # the group's compiled setups keep their code
                got = self.errors.get(setup) or self.runs[setup][r]
                log(f"{' '.join(map(str, self.key))} {setup} round {r}: {got if isinstance(got, str) else f'{got:.0f} img/s'}"
                    f"  ({time.perf_counter() - t:.1f} s)")
        self.learners.clear()
        return _free(self.dev)

    def results(self) -> dict:
        "Per setup: img/s (median over rounds), ratios to 'stock-cl' and 'fastai' (medians of per-round ratios), memory, notes"
        med = lambda xs: statistics.median(xs) if xs else None
        out = {}
        for s in self.setups:
            if s in self.errors: out[s] = dict(error=self.errors[s]); continue
            if not self.runs[s]: continue
            mine = self.runs[s]
            ratio = {b: med([v / self.runs[b][r] for r, v in mine.items() if r in self.runs.get(b, {})])
                     for b in ('stock-cl', 'fastai')}
            out[s] = dict(img_s=med(list(mine.values())), ratio=ratio, rounds=len(mine), first_s=self.first_s[s],
                          peak_gib=self.peak.get(s, float('nan')), note='; '.join(self.notes[s]))
        return out

def _free(dev, compiled:bool=True) -> float:
    "Everything a group left behind freed (a Learner's reference cycles, compiled code's hold on its model); GiB still allocated"
    gc.collect()
    if compiled: torch._dynamo.reset()
    if dev.type != 'cuda': return 0.
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**30

def table(groups, results, rounds:int, skipped=(), stopped:bool=False) -> str:
    """The rows of `groups` (`results` of those that ran); `rounds` asked of each setup (a row that measured fewer says
    so); `skipped`: groups the budget left out; `stopped`: the run was stopped (the rest were never reached)"""
    head = ("| model | batch | dtype | setup | img/s | vs stock channels-last | vs fastai to_channelslast() | peak GiB | "
            "first steps s | note |\n|---|---|---|---|---|---|---|---|---|---|")
    out = [head]
    order = {s: i for i, s in enumerate(SETUPS)}
    for i, (m, bs, dt, setups) in sorted(enumerate(groups), key=lambda ig: (ig[1][0], -ig[1][1], ig[1][2], ig[0])):
        got_group = results.get(i)
        again = any(h[:3] == (m, bs, dt) for h in groups[:i])   # a later group's: its rows beside its own stock rounds
        label = ':'.join(model_source(m))
        for s in sorted(setups, key=order.get):
            got = None if got_group is None else got_group.get(s)
            name = SETUPS[s][1] + (' (again, in a later group)' if again and s == 'stock-cl' else '')
            if got is None:
                why = 'budget' if i in skipped else 'stopped' if stopped else 'no round'
                out.append(f"| {label} | {bs} | {dt} | {name} | not run ({why}) | | | | | |"); continue
            if 'error' in got: out.append(f"| {label} | {bs} | {dt} | {name} | failed | | | | | {got['error']} |"); continue
            ratio = lambda b: '' if got['ratio'][b] is None else f"{got['ratio'][b]:.2f}"
            fewer = f" ({got['rounds']} of {rounds} rounds)" if got['rounds'] < rounds else ''
            out.append(f"| {label} | {bs} | {dt} | {name} | {got['img_s']:.0f}{fewer} | {ratio('stock-cl')} | {ratio('fastai')} | "
                       f"{got['peak_gib']:.2f} | {got['first_s']:.1f} | {got['note']} |")
    return '\n'.join(out)

STOCK = {'contiguous', 'stock-cl', 'stock-cl-bench', 'fastai', 'compile-cl'}
NO_COMPILE = [s for s in SETUPS if s not in STOCK | COMPILED]   # clfast's setups that need no torch.compile

def done_when(groups, results) -> str:
    """Issue 34's done-when, read off the table's rows (each line says what it compared, and whether the goal is met;
    a goal whose rows did not run says so): for the first model, clfast's best setup without compile against
    `torch.compile` at the largest batch and against fastai's `to_channelslast()` at the smallest (1.3x); every other
    model's best setup not below stock channels-last; 'memory' (eager, and with graphs) within 1.2x stock's step at 40%
    less peak memory; clfast's default not below fastai's `to_channelslast()` in any group. Ratios are the table's
    (medians of per-round ratios, each group against its own rounds): the rounds' spread is not judged here"""
    if not groups: return ''
    rows = {}   # (model, batch, dtype) -> {setup: result}, a later group's beside the first's
    for i, (m, bs, dt, _) in enumerate(groups):
        for s, got in (results.get(i) or {}).items():
            if 'error' not in got: rows.setdefault((m, bs, dt), {}).setdefault(s, got)
    models = list(dict.fromkeys(g[0] for g in groups))
    sizes = [g[1] for g in groups]
    big, small = max(sizes), min(sizes)
    out = ["Issue 34's done-when, from this table:"]
    def best(key, base='stock-cl'):
        "(ratio, setup): clfast's setup without compile of the highest ratio to `base` in the groups of `key`"
        got = rows.get(key, {})
        cands = [(got[s]['ratio'][base], s) for s in NO_COMPILE if s in got and got[s]['ratio'][base] is not None]
        return max(cands) if cands else (None, None)
    verdict = lambda ok: 'met' if ok else 'NOT met'
    for m, bs, dt in sorted({g[:3] for g in groups}, key=lambda k: (models.index(k[0]), -k[1], k[2])):
        where, got = f"{':'.join(model_source(m))} batch {bs} {dt}", rows.get((m, bs, dt), {})
        r, s = best((m, bs, dt))
        if m == models[0] and bs == big:
            c = got.get('compile-cl', {}).get('ratio', {}).get('stock-cl')
            out.append(f"- {where}: best without compile ({s}) {r / c:.2f}x torch.compile's: {verdict(r >= c)}" if r and c
                       else f"- {where}: best without compile against torch.compile: not measured")
        if m == models[0] and bs == small < big:
            f, sf = best((m, bs, dt), 'fastai')
            out.append(f"- {where}: best without compile ({sf}) {f:.2f}x fastai's to_channelslast(), goal 1.3x: {verdict(f >= 1.3)}"
                       if f else f"- {where}: best without compile against fastai's to_channelslast(): not measured")
        if m != models[0]:
            out.append(f"- {where}: best ({s}) {r:.2f}x stock channels-last, goal never below: {verdict(r >= 1)}" if r
                       else f"- {where}: best against stock channels-last: not measured")
        stock_peak = got.get('stock-cl', {}).get('peak_gib', float('nan'))
        for mem in ('memory', 'memory+graphs'):
            if mem not in got or got[mem]['ratio']['stock-cl'] is None: continue
            if not (stock_peak > 0 and got[mem]['peak_gib'] >= 0):   # (NaN off CUDA: no peak measured)
                out.append(f"- {where}: peak memory of {SETUPS[mem][1]} against stock's: not measured"); continue
            q, less = got[mem]['ratio']['stock-cl'], 1 - got[mem]['peak_gib'] / stock_peak
            out.append(f"- {where}: {SETUPS[mem][1]} {q:.2f}x stock's speed (a {1 / q:.2f}x step) at {less:.0%} less peak "
                       f"memory, goal within 1.2x at 40% less: {verdict(1 / q <= 1.2 and less >= 0.4)}")
        d = got.get('clfast', {}).get('ratio', {}).get('fastai')
        if d is not None: out.append(f"- {where}: clfast's default {d:.2f}x fastai's to_channelslast(): {verdict(d >= 1)}")
    return '\n'.join(out)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--models', nargs='+', default=['resnet50', 'efficientnet_b0'],
                   help="'tv:' or 'timm:' before a name says the library; a bare name is torchvision's where it has one")
    p.add_argument('--bs', nargs='+', type=int, default=[256, 64])
    p.add_argument('--dtypes', nargs='+', default=['bfloat16', 'float16'], choices=['bfloat16', 'float16'])
    p.add_argument('--setups', nargs='+', choices=list(SETUPS), help="only these setups (default: all, in priority order)")
    p.add_argument('--px', type=int, default=224)
    p.add_argument('--warm', type=int, default=6, help="first steps of each fit, not timed: CUDA graphs capture after 3 (graphs='if_faster': after 5, at the 6th, and decide at the 11th, inside the timed steps)")
    p.add_argument('--steps', type=int, default=12, help="timed steps of each fit")
    p.add_argument('--rounds', type=int, default=3, help="fits of each setup, in an order rotated each round")
    p.add_argument('--budget', type=float, default=420, help="seconds; groups that would start later are not run")
    p.add_argument('--device', default='cuda')
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == 'cuda':
        if not torch.cuda.is_available(): sys.exit("bench_gpu_fit: no CUDA GPU here (use --device cpu for a dry run)")
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}, "
              f"cudnn.benchmark={torch.backends.cudnn.benchmark}")
    groups = [(m, bs, dt, [s for s in setups if not args.setups or s in args.setups])
              for m, bs, dt, setups in plan(args.models, args.bs, args.dtypes)]
    groups = [g for i, g in enumerate(groups)   # none whose setups an earlier group of its model, batch and dtype measures
              if g[3] and not any(h[:3] == g[:3] and set(g[3]) <= set(h[3]) for h in groups[:i])]
    start, results, bases = time.perf_counter(), {}, {}
    def report(*_):
        print(f"\n## fastai Learner.fit, {args.px} px, {args.steps} timed steps after {args.warm}, median of {args.rounds} "
              f"rounds (fewer where a row says so; {time.perf_counter() - start:.0f} s in all)\n")
        print(table(groups, results, args.rounds, skipped, stopped), flush=True)
        print('\n' + done_when(groups, results), flush=True)
        if compiles is not None: print(f"\n{compiles} (this process: clfast's kernels, not inductor's workers)", flush=True)
    def interrupt(*_): raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)   # stopped by `timeout` (SIGINT or SIGTERM): the table of what ran, still
    stopped, skipped = False, set()
    with counting_compiles() as compiles:   # what Triton's compiles cost the fits (in their first steps' time)
        try:
            for i, (m, bs, dt, setups) in enumerate(groups):
                left = args.budget - (time.perf_counter() - start)
                if left < 20 + 60 * len(COMPILED & set(setups)): skipped.add(i); continue   # a compile takes about a minute; a group less
                group = Group(m, bs, dt, setups, args, bases)
                try: left_gib = group.run(lambda line: print(line, flush=True))
                finally: results[i] = group.results()
                print(f"{m} {bs} {dt}: {left_gib:.2f} GiB still allocated after the group", flush=True)
        except KeyboardInterrupt: stopped = True
    report()
    if stopped: sys.exit(124)

if __name__ == '__main__': main()
