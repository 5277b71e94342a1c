"""What a machine's first training step costs: the timed choices clfast makes once per machine (the precision, the
premises, each conv backward's way, each fused layer's way), through fastai's own `Learner.fit`, in fresh processes
with an empty clfast cache each.

    flock /tmp/clfast-cpu.lock python benchmarks/bench_first_step.py                      # resnet50 bf16, default and 'speed'
    flock /tmp/clfast-cpu.lock python benchmarks/bench_first_step.py --models resnet50 densenet121 --fuse none speed
    flock /tmp/clfast-cpu.lock python benchmarks/bench_first_step.py --compare-full-verdict   # against the whole sign test

Each run is one process: a torchvision model, a Learner over one synthetic batch, `to_channelslast()`, then two
`fit(1)`s; the first one's time less the second's is what the choices cost (each is measured once and cached; the
second fit measures nothing). `--compare-full-verdict` alternates each run with one whose choices run the sign test to
its end (`clfast.timing.hopeless` off: the stopping rule before it existed) and prints the pairs' ratios: the same
choices, counted in pairs and seconds.
"""
from __future__ import annotations
import argparse, json, os, statistics, subprocess, sys, tempfile
from pathlib import Path

CHILD = '''
import json, sys, time, torch, torchvision
import clfast.timing as T
arch, dtype, fuse, full = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == '1'
if full: T.hopeless = lambda ratios: False
from fastai.vision.all import DataLoaders, Learner, CrossEntropyLossFlat
from clfast.all import *
torch.manual_seed(0)
x, y = torch.randn(8, 3, 128, 128), torch.randint(0, 10, (8,))
ds = [(x[i], y[i]) for i in range(8)]
learn = Learner(DataLoaders.from_dsets(ds, ds, bs=8, device='cpu'), getattr(torchvision.models, arch)(num_classes=10),
                loss_func=CrossEntropyLossFlat())
kw = {} if fuse == 'none' else {'fuse': fuse}
learn.to_channelslast(use_amp=False, **kw) if dtype == 'fp32' else learn.to_channelslast(amp_mode=dtype, **kw)
fits = []
for _ in range(2):
    t0 = time.perf_counter()
    with learn.no_logging(), learn.no_bar(): learn.fit(1)
    fits.append(time.perf_counter() - t0)
made = [t for t in T.timings().values() if isinstance(t, T.Timing)]
print(json.dumps(dict(first=fits[0], second=fits[1], decisions=len(made), pairs=sum(t.pairs for t in made),
                      chosen=sum(t.chosen for t in made))))
'''

def run(arch:str, dtype:str, fuse:str, full:bool) -> dict:
    "One fresh process with an empty clfast cache: its two fits' times and what the first one decided"
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, 'CLFAST_CACHE_DIR': cache, 'PYTHONWARNINGS': 'ignore',
               'PYTHONPATH': os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get('PYTHONPATH', '')])}
        out = subprocess.run([sys.executable, '-c', CHILD, arch, dtype, fuse, str(int(full))], env=env,
                             capture_output=True, text=True)
    if out.returncode: sys.exit(f"{arch} {dtype} {fuse} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--models', nargs='+', default=['resnet50'], help='torchvision model names')
    p.add_argument('--dtypes', nargs='+', default=['bf16'], help="bf16, fp16 (clfast's CPU fallback applies) or fp32")
    p.add_argument('--fuse', nargs='+', default=['none', 'speed'], help="'none' (the default), 'speed', 'memory'")
    p.add_argument('--runs', type=int, default=2, help='processes per setup (and per rule, compared)')
    p.add_argument('--compare-full-verdict', action='store_true', help='alternate with the whole sign test per choice')
    args = p.parse_args(argv)
    rules = [False, True] if args.compare_full_verdict else [False]
    print("| model | dtype | fuse | rule | first fit's extra s (runs) | decisions | pairs | chosen |\n|---|---|---|---|---|---|---|---|")
    for arch in args.models:
        for dtype in args.dtypes:
            for fuse in args.fuse:
                got = {rule: [] for rule in rules}
                for i in range(args.runs):   # new, old, old, new, ...: a drift hits both rules alike
                    for rule in (rules if i % 2 == 0 else rules[::-1]): got[rule].append(run(arch, dtype, fuse, rule))
                for rule, rs in got.items():
                    extra = [r['first'] - r['second'] for r in rs]
                    print(f"| {arch} | {dtype} | {fuse} | {'whole sign test' if rule else 'hopeless stop'} | "
                          f"{statistics.median(extra):.2f} ({', '.join(f'{e:.2f}' for e in extra)}) | "
                          f"{rs[0]['decisions']} | {'/'.join(str(r['pairs']) for r in rs)} | "
                          f"{'/'.join(str(r['chosen']) for r in rs)} |", flush=True)
                if len(rules) == 2:
                    pairs = [a['pairs'] / b['pairs'] for a, b in zip(got[False], got[True])]
                    secs = [(a['first'] - a['second']) / (b['first'] - b['second']) for a, b in zip(got[False], got[True])]
                    print(f"|  |  |  | hopeless / whole, per pair of runs | {statistics.median(secs):.2f} "
                          f"({', '.join(f'{s:.2f}' for s in secs)}) |  | {statistics.median(pairs):.2f} |  |", flush=True)

if __name__ == '__main__':
    main()
