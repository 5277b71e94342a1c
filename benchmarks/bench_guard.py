"""What the guard against known-bad stock kernels costs, measured side by side in one run (ratios, medians of rounds).

1. An affected stem (3 -> 64, 1x1, stride 2, channels-last, forward + backward): the two workarounds against each
   other, and against the unguarded stock conv, which runs in a child process (it may crash, or give wrong gradients:
   oneDNN issue 6035).
2. timm resnet50 training steps (no conv reaches a known-bad kernel; the 3x3 convs become `GuardedConv2d`s that check
   their input's height per call, and at 224 px never route): timed with and without `guard_model`, alternating.
3. `check_channelslast` on resnet50 at 224 px: first time (fresh cache directory) and cached.
4. The short-input route (`clfast.routes.SHORT_INPUT_WGRAD`): one 3x3 conv on 2x2 inputs per width, stock against
   routed, and a plan-less GuardedConv2d's cost per call; then torchvision resnet18 training steps at 64 px, batch 32
   (layer4's 3x3 convs see 2x2 inputs), Adam: contiguous, channels-last stock, and channels-last after `guard_model`;
   speedups are medians of the per-round paired ratios.
5. Transposed convs (`clfast.routes.GuardedConvTranspose2d`): a 1x1 stride-2 upsampling onto few channels (the class
   whose stock channels-last weight gradient overruns a buffer) as the guarded route against the stock conv on nchw
   tensors (stock channels-last runs in a child process, as in 1); then a DCGAN generator's training step (fastai's
   `basic_generator`, 64 px, batch 32, channels-last, after `guard_model`) with its transposed convs guarded against
   stock, paired per round.

    python benchmarks/bench_guard.py [--rounds 7] [--bs 16] [--size 224] [--sections stem resnet50 check short transposed]
"""
import argparse, os, statistics, subprocess, sys, tempfile, textwrap, time
import torch, torch.nn.functional as F
from torch import nn

def stem_step(how, x0, w):
    "One forward + backward of the affected stem, guarded with `how` ('subsample', 'contiguous') or stock (None)"
    from clfast.bad_kernels import GuardPlan, route
    x = x0.detach().requires_grad_()
    r = route(None if how is None else GuardPlan(how, True, 'bench'), x, w, (2, 2))
    y = r.restore(F.conv2d(r.x, r.weight, None, r.stride))
    y.backward(torch.ones_like(y))
    w.grad = None

def interleaved_times(fns:dict, rounds:int, warmup:int=2) -> dict:
    "Seconds of each function per round, run in alternating order every round"
    for f in fns.values():
        for _ in range(warmup): f()
    times = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t = time.perf_counter(); fns[k](); times[k].append(time.perf_counter() - t)
    return times

def interleaved(fns:dict, rounds:int, warmup:int=2) -> dict:
    "Median seconds of each function, run in alternating order every round"
    return {k: statistics.median(v) for k, v in interleaved_times(fns, rounds, warmup).items()}

STOCK_CHILD = '''
import sys, time, statistics, torch, torch.nn.functional as F
bs, size, rounds = map(int, sys.argv[1:4])
torch.manual_seed(0)
x0 = torch.randn(bs, 3, size, size).to(memory_format=torch.channels_last)
w = torch.randn(64, 3, 1, 1).to(memory_format=torch.channels_last).requires_grad_()
ts = []
for i in range(rounds + 2):
    x = x0.detach().requires_grad_()
    t = time.perf_counter(); y = F.conv2d(x, w, None, 2); y.backward(torch.ones_like(y)); w.grad = None
    print('STEP', time.perf_counter() - t, flush=True)   # each step as it ends: the kernel may crash the process
'''

def bench_stem(bs, size, rounds):
    torch.manual_seed(0)
    x0 = torch.randn(bs, 3, size, size).to(memory_format=torch.channels_last)
    w = torch.randn(64, 3, 1, 1).to(memory_format=torch.channels_last).requires_grad_()
    med = interleaved({how: (lambda how=how: stem_step(how, x0, w)) for how in ('subsample', 'contiguous')}, rounds)
    print(f"affected stem 3->64 1x1 s2, {bs}x3x{size}x{size} channels-last, fwd+bwd, {torch.get_num_threads()} threads:")
    for k, v in med.items(): print(f"  guarded, {k:<10} {v*1e3:8.1f} ms")
    print(f"  contiguous / subsample: {med['contiguous'] / med['subsample']:.2f}x")
    try:
        r = subprocess.run([sys.executable, '-c', STOCK_CHILD, str(bs), str(size), str(rounds)], capture_output=True,
                           text=True, timeout=300)
        done = [float(l.split()[1]) for l in r.stdout.splitlines() if l.startswith('STEP')]
        steps = done[2:] or done[1:] or done   # after warm-up steps, when it lived that long
        fate = 'ran all steps' if r.returncode == 0 else f"died with exit {r.returncode} after {len(done)} completed steps"
        if steps:
            stock = statistics.median(steps)
            print(f"  unguarded stock (child process, wrong weight gradients; {fate}): {stock*1e3:8.1f} ms; "
                  f"stock / subsample: {stock / med['subsample']:.2f}x")
        else: print(f"  unguarded stock (child process): {fate}, no timed step")
    except subprocess.TimeoutExpired: print("  unguarded stock (child process): hung for 300 s")

def bench_resnet50(bs, size, rounds):
    import timm, copy
    from clfast.guard import guard_model
    torch.manual_seed(0)
    model = timm.create_model('resnet50').to(memory_format=torch.channels_last)
    guarded = copy.deepcopy(model)
    print(f"\ntimm resnet50 training step, {bs}x3x{size}x{size} channels-last fp32: guard_model guarded {guard_model(guarded)}")
    x = torch.randn(bs, 3, size, size).to(memory_format=torch.channels_last)
    opt = {id(m): torch.optim.SGD(m.parameters(), 1e-3) for m in (model, guarded)}
    def step(m):
        opt[id(m)].zero_grad(); m(x).float().sum().backward(); opt[id(m)].step()
    med = interleaved({'stock': lambda: step(model), 'guarded': lambda: step(guarded)}, rounds, warmup=1)
    print(f"  stock {med['stock']*1e3:.0f} ms, after guard_model {med['guarded']*1e3:.0f} ms: ratio {med['guarded'] / med['stock']:.3f}")

def bench_check(size):
    code = textwrap.dedent(f'''
        import time, torch, timm
        from clfast.check import check_channelslast
        m = timm.create_model('resnet50'); x = torch.randn(2, 3, {size}, {size})
        for what in ('first', 'cached'):
            t = time.perf_counter(); table = check_channelslast(m, x); dt = time.perf_counter() - t
            print(f"  check_channelslast, {{what}}: {{dt:.3f}} s ({{len(table)}} geometries, {{(table.status != 'ok').sum()}} failing)")
    ''')
    print(f"\ncheck_channelslast on timm resnet50 at {size} px, {torch.get_num_threads()} threads:")
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env={**os.environ, 'CLFAST_CACHE_DIR': d})
    print(r.stdout.rstrip() or r.stderr[-2000:])

def bench_short_convs(rounds):
    "One 3x3 conv on a 32x2x2 channels-last input, forward + backward: stock against routed, per width (the figures "
    "behind SHORT_INPUT_MIN_WEIGHT); then what a GuardedConv2d without a plan adds to a call on a tall input"
    import copy
    from clfast.guard import guard_model
    from clfast.routes import short_input_plan
    cl = torch.channels_last
    print(f"\nshort-input route per conv: 3x3, 32xCx2x2 channels-last input, forward + backward, {rounds} rounds")
    for c in (256, 384, 512):
        stock = nn.Conv2d(c, c, 3, padding=1, bias=False).to(memory_format=cl)
        routed = copy.deepcopy(stock); guard_model(routed)
        x = torch.randn(32, c, 2, 2).to(memory_format=cl).requires_grad_(); g = torch.randn(32, c, 2, 2).to(memory_format=cl)
        def step(m):
            m.weight.grad = None; x.grad = None; m(x).backward(g)
        t = interleaved_times({'stock': lambda: step(stock), 'routed': lambda: step(routed)}, rounds)
        r = sorted(a / b for a, b in zip(t['stock'], t['routed']))
        print(f"  {c} channels ({c*c*9/1e6:.2f}M weights, routed: {short_input_plan(routed, x, routed.weight) is not None}): "
              f"stock {statistics.median(t['stock'])*1e3:.1f} ms, routed {statistics.median(t['routed'])*1e3:.1f} ms, "
              f"stock / routed {statistics.median(r):.3f}")
    stock = nn.Conv2d(8, 8, 3, padding=1).to(memory_format=cl)
    guarded = copy.deepcopy(stock); guard_model(guarded)
    x = torch.randn(1, 8, 8, 8).to(memory_format=cl)
    def calls(m, n=5000):
        t = time.perf_counter()
        for _ in range(n): m(x)
        return (time.perf_counter() - t) / n
    t = interleaved_times({'stock': lambda: calls(stock), 'guarded': lambda: calls(guarded)}, 7)
    print(f"  a GuardedConv2d without a plan, tall input (1x8x8x8, 3x3, forward with grad): "
          f"+{(statistics.median(t['guarded']) - statistics.median(t['stock'])) / 5000 * 1e6:.1f} us per call over stock")

def bench_short(rounds, bs=32, size=64):
    import copy, torchvision
    from clfast.guard import guard_model
    torch.manual_seed(0)
    cl = torch.channels_last
    base = torchvision.models.resnet18(num_classes=10)
    models = {'contiguous': base, 'channels-last stock': copy.deepcopy(base).to(memory_format=cl)}
    models['channels-last guarded'] = copy.deepcopy(models['channels-last stock']); guard_model(models['channels-last guarded'])
    x = torch.randn(bs, 3, size, size); y = torch.randint(0, 10, (bs,))
    xs = {k: x if k == 'contiguous' else x.to(memory_format=cl) for k in models}
    opts = {k: torch.optim.Adam(m.parameters(), 1e-3) for k, m in models.items()}
    def step(k):
        opts[k].zero_grad(); F.cross_entropy(models[k](xs[k]), y).backward(); opts[k].step()
    times = interleaved_times({k: (lambda k=k: step(k)) for k in models}, rounds, warmup=2)
    print(f"\nshort-input route: torchvision resnet18 training step, {bs}x3x{size}x{size} fp32, Adam, "
          f"{torch.get_num_threads()} threads, {rounds} rounds")
    for k, v in times.items(): print(f"  {k:<22} {statistics.median(v)*1e3:7.1f} ms")
    def paired(a, b):
        r = sorted(x / y for x, y in zip(times[a], times[b]))
        return f"{statistics.median(r):.3f} [{r[len(r)//4]:.3f}-{r[(3*len(r))//4]:.3f}]"
    print(f"  speedup over contiguous: stock channels-last {paired('contiguous', 'channels-last stock')}, "
          f"guarded {paired('contiguous', 'channels-last guarded')}")
    print(f"  guarded over stock channels-last: {paired('channels-last stock', 'channels-last guarded')}")

TRANSPOSED_CHILD = '''
import sys, time, torch, torch.nn.functional as F
n, cin, cout, size, rounds = map(int, sys.argv[1:6])
torch.manual_seed(0)
x0 = torch.randn(n, cin, size, size).to(memory_format=torch.channels_last)
w = (torch.randn(cin, cout, 1, 1) / cin ** .5).to(memory_format=torch.channels_last).requires_grad_()
for i in range(rounds + 2):
    x = x0.detach().requires_grad_()
    t = time.perf_counter(); y = F.conv_transpose2d(x, w, None, 2, 0, 1); y.backward(torch.ones_like(y)); w.grad = None
    print('STEP', time.perf_counter() - t, flush=True)   # each step as it ends: the kernel may crash the process
'''

def bench_transposed(rounds):
    import copy
    from fastai.vision.gan import basic_generator
    from clfast.guard import guard_model
    from clfast.routes import GuardedConvTranspose2d
    cl = torch.channels_last
    print(f"\ntransposed convs, fp32, {torch.get_num_threads()} threads, {rounds} rounds:")
    for n, cin, cout, size in ((16, 64, 3, 32), (16, 64, 8, 32), (8, 256, 12, 14)):
        torch.manual_seed(0)
        conv = nn.ConvTranspose2d(cin, cout, 1, stride=2, output_padding=1)
        nets = {'stock nchw': nn.Sequential(conv), 'guarded channels-last': copy.deepcopy(nn.Sequential(conv)).to(memory_format=cl)}
        guard_model(nets['guarded channels-last'])
        assert type(nets['guarded channels-last'][0]) is GuardedConvTranspose2d
        x = torch.randn(n, cin, size, size)
        xs = {'stock nchw': x, 'guarded channels-last': x.to(memory_format=cl)}
        def step(k):
            y = nets[k](xs[k].detach().requires_grad_()); y.backward(torch.ones_like(y)); nets[k].zero_grad()
        t = interleaved_times({k: (lambda k=k: step(k)) for k in nets}, max(rounds, 15))
        med = {k: statistics.median(v) for k, v in t.items()}
        line = f"  1x1 stride 2, {n}x{cin}x{size}x{size} -> {cout} channels, fwd+bwd: " + ", ".join(f"{k} {v*1e3:.2f} ms" for k, v in med.items())
        r = subprocess.run([sys.executable, '-c', TRANSPOSED_CHILD, *map(str, (n, cin, cout, size, max(rounds, 15)))],
                           capture_output=True, text=True, timeout=300)
        done = [float(l.split()[1]) for l in r.stdout.splitlines() if l.startswith('STEP')][2:]
        fate = 'ran all steps' if r.returncode == 0 else f"died with exit {r.returncode} after {len(done) + 2} steps"
        stock_cl = f"{statistics.median(done)*1e3:.2f} ms ({fate})" if done else fate
        print(f"{line}; stock channels-last (child process) {stock_cl}; stock nchw / guarded: {med['stock nchw'] / med['guarded channels-last']:.2f}x")
    from clfast.stock import replace_modules
    torch.manual_seed(0)
    guarded = basic_generator(64, 3, n_extra_layers=1).to(memory_format=cl)
    guard_model(guarded)   # (its BNs too, where this machine's measured imprecise: the same in both models)
    gen = copy.deepcopy(guarded)   # the transposed convs alone stock
    replace_modules(gen, {m: m._stock_module() for m in gen.modules() if type(m) is GuardedConvTranspose2d})
    kinds = sorted({type(m).__name__ for m in guarded.modules() if isinstance(m, nn.ConvTranspose2d)})
    z = torch.randn(32, 100)
    opts = {id(m): torch.optim.Adam(m.parameters(), 1e-4) for m in (gen, guarded)}
    def gstep(m):
        opts[id(m)].zero_grad(); m(z).float().square().mean().backward(); opts[id(m)].step()
    t = interleaved_times({'stock': lambda: gstep(gen), 'guarded': lambda: gstep(guarded)}, max(rounds, 10))
    ratios = sorted(g / s for g, s in zip(t['guarded'], t['stock']))
    print(f"  DCGAN generator (basic_generator 64 px, batch 32, {kinds}) training step: transposed convs stock "
          f"{statistics.median(t['stock'])*1e3:.1f} ms, guarded {statistics.median(t['guarded'])*1e3:.1f} ms; "
          f"guarded / stock {ratios[len(ratios)//2]:.3f} [{ratios[len(ratios)//4]:.3f}-{ratios[(3*len(ratios))//4]:.3f}]")

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--rounds', type=int, default=7); p.add_argument('--bs', type=int, default=16)
    p.add_argument('--size', type=int, default=224); p.add_argument('--skip-resnet', action='store_true')
    p.add_argument('--sections', nargs='+', default=['stem', 'resnet50', 'check', 'short', 'transposed'],
                   choices=['stem', 'resnet50', 'check', 'short', 'transposed'])
    a = p.parse_args()
    sections = [s for s in a.sections if not (a.skip_resnet and s in ('resnet50', 'check'))]
    from clfast.machine import onednn_isa
    from clfast.machine import machine_key
    print(f"{machine_key()} | oneDNN ISA {onednn_isa()}\n")
    if 'stem' in sections: bench_stem(a.bs, a.size, a.rounds)
    if 'resnet50' in sections: bench_resnet50(8, a.size, max(3, a.rounds // 2))
    if 'check' in sections: bench_check(a.size)
    if 'short' in sections: bench_short_convs(max(a.rounds, 20)); bench_short(max(a.rounds, 10))
    if 'transposed' in sections: bench_transposed(a.rounds)
