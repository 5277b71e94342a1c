"""Training throughput through fastai's own `Learner.fit` on a CUDA GPU: every setup issue 34 names, side by side in
one run, ending with one table (img/s, ratio to stock channels-last and to stock fastai `to_channelslast()`, peak
memory, time of the first steps: compile, capture, clfast's per-layer timing).

    python benchmarks/bench_gpu_fit.py                       # resnet50 + efficientnet_b0, batch 256 and 64, bf16 and fp16
    python benchmarks/bench_gpu_fit.py --budget 300 --models resnet50 --bs 256 --dtypes bfloat16
    python benchmarks/bench_gpu_fit.py --device cpu --models resnet18 --bs 4 --px 64 --steps 2 --warm 5   # a dry run

Batches are synthetic and in memory (one batch of random images on the device, served again each step: the loader
costs nothing, the step is the model's, the optimizer's and fastai's own callbacks'). Each row trains a fresh copy of
the model in one `fit` of `warm + steps` batches; the clock runs over the last `steps` (GPU synchronized at both ends),
after the setup's first steps (which compile, capture its CUDA graph, or time clfast's layers). Rows run in priority
order (the issue's goals first) until `--budget` seconds are spent; rows left over print as not run.
"""
from __future__ import annotations
import argparse, copy, gc, signal, sys, time, warnings
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

# what each setup does to a fresh Learner (dtype: 'bf16' or 'fp16')
def _stock_amp(learn, dtype, channels_last=False, fastai_callback=False):
    if channels_last and not fastai_callback: learn.model.to(memory_format=torch.channels_last)
    cbs = [fastai_fp16.MixedPrecision(amp_mode=dtype)]
    if fastai_callback: cbs.insert(0, fastai_cl.ChannelsLast())   # exactly what fastai's `to_channelslast()` adds
    learn.add_cbs(cbs)

SETUPS = {   # name: (what it does, its description)
    'contiguous':     (lambda l, d: _stock_amp(l, d), "contiguous, fastai AMP"),
    'stock-cl':       (lambda l, d: _stock_amp(l, d, channels_last=True), "stock channels-last, fastai AMP"),
    'fastai':         (lambda l, d: _stock_amp(l, d, fastai_callback=True), "stock fastai to_channelslast()"),
    'compile-cl':     (lambda l, d: (_stock_amp(l, d, channels_last=True), l.model.compile()), "torch.compile of stock channels-last"),
    'clfast':         (lambda l, d: l.to_channelslast(amp_mode=d), "clfast to_channelslast() (default)"),
    'speed':          (lambda l, d: l.to_channelslast(amp_mode=d, fuse='speed'), "clfast fuse='speed'"),
    'memory':         (lambda l, d: l.to_channelslast(amp_mode=d, fuse='memory'), "clfast fuse='memory'"),
    'graphs':         (lambda l, d: l.to_channelslast(amp_mode=d, graphs=True), "clfast graphs=True"),
    'speed+graphs':   (lambda l, d: l.to_channelslast(amp_mode=d, fuse='speed', graphs=True), "clfast fuse='speed', graphs=True"),
    'speed+compile':  (lambda l, d: l.to_channelslast(amp_mode=d, fuse='speed', compile=True), "clfast fuse='speed', compile=True"),
}
CORE = ['stock-cl', 'fastai', 'clfast', 'speed', 'graphs', 'speed+graphs', 'memory']   # every row; the rest where it pays

def plan(models, batch_sizes, dtypes) -> list:
    "Rows in priority order: the issue's goal rows first (resnet50's), compile beside them, then the rest"
    first, last = models[0], models[1:]
    rows = [(first, bs, dt, s) for bs in batch_sizes for dt in dtypes for s in CORE]
    rows += [(first, max(batch_sizes), dt, 'compile-cl') for dt in dtypes]
    rows += [(m, bs, dt, s) for m in last for bs in batch_sizes for dt in dtypes for s in CORE if s != 'memory']
    rows += [(first, max(batch_sizes), dtypes[0], 'speed+compile')]
    rows += [(m, bs, dt, 'contiguous') for m in models for bs in batch_sizes for dt in dtypes]
    rows += [(first, bs, dt, 'compile-cl') for bs in batch_sizes if bs != max(batch_sizes) for dt in dtypes]
    rows += [(m, bs, dt, 'memory') for m in last for bs in batch_sizes for dt in dtypes]
    return list(dict.fromkeys(rows))

def make_model(name:str) -> nn.Module:
    import timm, torchvision
    if hasattr(torchvision.models, name): return getattr(torchvision.models, name)()
    return timm.create_model(name, pretrained=False)

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

def run_row(model_name, bs, dtype, setup, args, bases) -> dict:
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == 'cuda' else (lambda: None)
    g = torch.Generator().manual_seed(0)
    xb = TensorImage(torch.randn(bs, 3, args.px, args.px, generator=g).to(dev))   # contiguous, as a loader's batch is
    yb = TensorCategory(torch.randint(0, 1000, (bs,), generator=g).to(dev))
    n = args.warm + args.steps
    dls = DataLoaders(SameBatch(xb, yb, n), SameBatch(xb, yb, 0), device=dev)
    if model_name not in bases: bases[model_name] = make_model(model_name)
    gc.collect()
    if dev.type == 'cuda': torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    learn = Learner(dls, copy.deepcopy(bases[model_name]).to(dev), loss_func=CrossEntropyLossFlat(), lr=1e-4)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        SETUPS[setup][0](learn, {'bfloat16': 'bf16', 'float16': 'fp16'}[dtype])
        clock = Clock(args.warm, sync)
        with learn.no_logging(), learn.no_bar(): learn.fit(1, cbs=[clock])
    notes = sorted({str(w.message).split(';')[0][:120] for w in said if 'clfast' in type(w.message).__module__
                    or 'CudaGraphs' in str(w.message)})
    graphs = getattr(learn, 'cuda_graphs', None)
    res = dict(img_s=args.steps * bs / (clock.t1 - clock.t0), first_s=clock.t0 - clock.start,
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if dev.type == 'cuda' else float('nan'),
               note='; '.join(notes))
    if graphs is not None and not notes: res['note'] = f"{graphs.captured} shape(s) replayed"
    del learn, dls, xb, yb
    return res

def table(rows, results, dtypes) -> str:
    head = ("| model | batch | dtype | setup | img/s | vs stock channels-last | vs fastai to_channelslast() | peak GiB | "
            "first steps s | note |\n|---|---|---|---|---|---|---|---|---|---|")
    out = [head]
    order = {s: i for i, s in enumerate(SETUPS)}
    for r in sorted(rows, key=lambda r: (r[0], -r[1], r[2], order[r[3]])):
        m, bs, dt, s = r
        got = results.get(r)
        if got is None: out.append(f"| {m} | {bs} | {dt} | {SETUPS[s][1]} | not run (budget) | | | | | |"); continue
        if 'error' in got: out.append(f"| {m} | {bs} | {dt} | {SETUPS[s][1]} | failed | | | | | {got['error']} |"); continue
        ratio = lambda base: (f"{got['img_s'] / results[(m, bs, dt, base)]['img_s']:.2f}"
                              if 'img_s' in results.get((m, bs, dt, base), {}) else '')
        out.append(f"| {m} | {bs} | {dt} | {SETUPS[s][1]} | {got['img_s']:.0f} | {ratio('stock-cl')} | {ratio('fastai')} | "
                   f"{got['peak_gib']:.2f} | {got['first_s']:.1f} | {got['note']} |")
    return '\n'.join(out)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--models', nargs='+', default=['resnet50', 'efficientnet_b0'])
    p.add_argument('--bs', nargs='+', type=int, default=[256, 64])
    p.add_argument('--dtypes', nargs='+', default=['bfloat16', 'float16'], choices=['bfloat16', 'float16'])
    p.add_argument('--setups', nargs='+', choices=list(SETUPS), help="only these setups (default: all, in priority order)")
    p.add_argument('--px', type=int, default=224)
    p.add_argument('--warm', type=int, default=8, help="first steps, not timed: CUDA graphs capture after 3, replay from the 5th")
    p.add_argument('--steps', type=int, default=20, help="timed steps")
    p.add_argument('--budget', type=float, default=420, help="seconds; rows that would start later are not run")
    p.add_argument('--device', default='cuda')
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == 'cuda':
        if not torch.cuda.is_available(): sys.exit("bench_gpu_fit: no CUDA GPU here (use --device cpu for a dry run)")
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}, "
              f"cudnn.benchmark={torch.backends.cudnn.benchmark}")
    rows = [r for r in plan(args.models, args.bs, args.dtypes) if not args.setups or r[3] in args.setups]
    start, results, bases = time.perf_counter(), {}, {}
    def report(*_):
        print(f"\n## fastai Learner.fit, {args.px} px, {args.steps} timed steps after {args.warm} "
              f"({time.perf_counter() - start:.0f} s in all)\n")
        print(table(rows, results, args.dtypes), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (report(), sys.exit(124)))   # stopped by `timeout`: the table still
    for r in rows:
        left = args.budget - (time.perf_counter() - start)
        if left < (90 if 'compile' in r[3] else 10): continue   # a compile takes about a minute; other rows seconds
        t = time.perf_counter()
        try: results[r] = run_row(*r, args, bases)
        except Exception as e:
            results[r] = dict(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:150]}" if str(e).strip()
                              else type(e).__name__)
        if dev.type == 'cuda': torch.cuda.empty_cache()
        got = results[r]
        print(f"{r[0]} bs {r[1]} {r[2]} {r[3]}: " + (f"{got['img_s']:.0f} img/s, first steps {got['first_s']:.1f} s, "
              f"peak {got['peak_gib']:.2f} GiB {got['note']}" if 'img_s' in got else got['error'])
              + f"  ({time.perf_counter() - t:.0f} s)", flush=True)
    report()

if __name__ == '__main__': main()
