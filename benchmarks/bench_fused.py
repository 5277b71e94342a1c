"""End-to-end benchmarks of clfast.fused / clfast.fuse: saved-activation memory, training step time, inference.

Every ratio is measured side by side in one run (variants interleaved round by round, medians compared), because the
machine is noisy. Wrap runs in `flock /tmp/clfast-cpu.lock` so they never overlap other benchmarks:

    flock /tmp/clfast-cpu.lock python benchmarks/bench_fused.py                  # all CPU sections (+ GPU if present)
    flock /tmp/clfast-cpu.lock python benchmarks/bench_fused.py --sections train --models resnet50 efficientnet_b0
    flock /tmp/clfast-cpu.lock python benchmarks/bench_fused.py --sections overhead --profile   # fixed cost per fused layer
    flock /tmp/clfast-cpu.lock python benchmarks/bench_fused.py --sections never_slower --bs 8 --px 128 --rounds 7 --processes 3
    flock /tmp/clfast-cpu.lock python benchmarks/bench_fused.py --sections pointwise   # squeeze-excite 1x1 convs
"""
from __future__ import annotations
import argparse, contextlib, copy, json, os, statistics, subprocess, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch, timm, torchvision
from torch import nn
from clfast.fuse import fuse_conv_bn, fold_conv_bn, fusion_report
from clfast.cpu_kernels import set_gemm_backward, gemm_backward_choices
from clfast.fused import set_layer_way, recomputes
from clfast.recompute import recomputed_outputs
from clfast.machine import STEADY_HEAP   # glibc kept from faulting in fresh pages each step (`--steady-heap`)

MiB = 2**20

def make_model(name:str) -> nn.Module:
    "A timm model (random init), as the fused conv-BN v2 issue measures them: resnet50, efficientnet_b0, ..."
    return timm.create_model(name, pretrained=False)

def cl(m): return m.to(memory_format=torch.channels_last)

def cpu_has_native_bf16() -> bool:
    "oneDNN runs bf16 natively (AVX512-BF16 or AMX); elsewhere bf16 is emulated and not worth timing"
    from clfast.amp import cpu_native_dtypes
    return torch.bfloat16 in cpu_native_dtypes()

def cpu_amps(args) -> list:
    "The CPU autocast dtypes a section times: None (fp32), then bf16 where native (or asked for with --cpu-bf16)"
    return [None] + ([torch.bfloat16] if args.cpu_bf16 or cpu_has_native_bf16() else [])

def saved_bytes(model, x, recipes:bool|None=None):
    "Bytes of the unique storages autograd saves for backward during one forward (parameters counted apart; `recipes` as `train_step_fn`'s)"
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    store = {}
    def pack(t):
        s = t.untyped_storage()
        store[s.data_ptr()] = s.nbytes()
        return t
    if recipes is None: recipes = recomputes(model)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with recomputed_outputs() if recipes else contextlib.nullcontext(): out = model(x)
    del out
    act = sum(n for p, n in store.items() if p not in params)
    return act, sum(store.values()) - act

def interleaved(fns:dict, rounds:int, warmup:int=1) -> dict:
    "Seconds per call of each fn in each round, run round-robin (order reversed every other round) so noise hits all alike"
    times = {k: [] for k in fns}
    for r in range(warmup + rounds):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t = time.perf_counter(); fns[k](); dt = time.perf_counter() - t
            if r >= warmup: times[k].append(dt)
    return times

def medians(times:dict) -> dict: return {k: statistics.median(v) for k, v in times.items()}

def paired_stats(times:dict, base:str, k:str) -> tuple:
    "`(median, lower quartile, upper quartile)` of the per-round ratios base/k (each round's two runs are seconds apart)"
    r = sorted(b / t for b, t in zip(times[base], times[k]))
    q = lambda f: r[min(len(r) - 1, int(f * len(r)))]
    return statistics.median(r), q(0.25), q(0.75)

def paired_ratios(times:dict, base:str, k:str) -> str:
    "`paired_stats` in words"
    m, lo, hi = paired_stats(times, base, k)
    return f"paired {base}/{k}: median {m:.3f} (quartiles {lo:.3f}-{hi:.3f}, n={len(times[k])})"

def train_step_fn(model, x, dev='cpu', amp=None, recipes:bool|None=None):
    """One SGD training step of `model` on `x`; `recipes`: its forward inside `recomputed_outputs()`, as fastai's fit runs
    a model with 'memory' layers (None: where it has them; False: their conv recomputed in backward, the old way)"""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if recipes is None: recipes = recomputes(model)
    def f():
        with torch.autocast(dev, dtype=amp, enabled=amp is not None):
            with recomputed_outputs() if recipes else contextlib.nullcontext(): out = model(x)
            loss = out.float().logsumexp(1).mean()
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        if dev == 'cuda': torch.cuda.synchronize()
    return f

def with_setting(step, switch, value):
    "`step` run with `switch` (a setter returning the previous value: `set_layer_way`, `set_gemm_backward`) at `value`; None: as set"
    if value is None: return step
    def f():
        before = switch(value)
        try: step()
        finally: switch(before)
    return f

def section_train(args):
    "fuse='speed' and 'memory' against stock channels-last: step time (fp32, and bf16 autocast where native), saved activations"
    amps = cpu_amps(args)
    for name in args.models:
        print(f"\n## CPU training step: timm {name}, batch {args.bs}, {args.px} px, channels-last, train mode")
        torch.manual_seed(0)
        x = torch.randn(args.bs, 3, args.px, args.px).to(memory_format=torch.channels_last)
        models = {'stock_cl': cl(make_model(name))}
        for mode in ('speed', 'memory'): models[mode] = fuse_conv_bn(copy.deepcopy(models['stock_cl']), mode)
        r = fusion_report(models['speed'])
        bns = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in models['stock_cl'].modules())
        print(f"fusion: {len(r.fused)} fused entries, {len(r.skipped)} skipped, of {bns} BN layers")
        # timed first, saved activations after: a grad-mode forward that keeps every activation alive leaves glibc's
        # heap in a state where later steps page-fault more (measured: 'speed' 1.07-1.09x stock before, 0.94-1.06x after
        # such a forward; the MALLOC_* settings in BENCHMARKS.md make the order irrelevant)
        for amp in amps:
            fns = {k: train_step_fn(m, x, amp=amp) for k, m in models.items()}
            fns['memory_conv'] = train_step_fn(models['memory'], x, amp=amp, recipes=False)   # the old 'memory'
            # 'speed' again with every conv's backward left to ATen: what the GEMM way, where timing chose it, brings
            fns['speed_conv'] = with_setting(fns['speed'], set_gemm_backward, 'conv')
            raw = interleaved(fns, args.rounds, warmup=2)
            times = medians(raw)
            print(f"  {'bf16 autocast' if amp else 'fp32'}:")
            for k, t in times.items():
                print(f"train step {k:>8}: {t*1000:8.1f} ms   speedup vs stock_cl = {times['stock_cl']/t:.3f}")
            for k in ('speed', 'memory', 'speed_conv', 'memory_conv'): print("  " + paired_ratios(raw, 'stock_cl', k))
            print("  " + paired_ratios(raw, 'speed_conv', 'speed'))
            print("  " + paired_ratios(raw, 'memory_conv', 'memory'))
            chosen = gemm_backward_choices()
            for way in ('gemm', 'fp32'):
                won = [f"{x}->{'x'.join(map(str, w))}/{st[0]}" for (x, w, st, *_), v in chosen.items() if v == way]
                print(f"  conv backward shapes timed in this process: {len(chosen)}, the {way} way won {len(won)}: {', '.join(won)}")
        base = None
        for k, (m, recipes) in {**{k: (m, None) for k, m in models.items()}, 'memory_conv': (models['memory'], False)}.items():
            for _ in range(2): act, par = saved_bytes(m, x, recipes)   # the second: a layer whose recipe nothing took keeps no y
            base = base or act
            print(f"saved activations {k:>11}: {act/MiB:8.1f} MiB ({act/base:6.1%} of stock_cl)")

def section_infer(args):
    "fold_conv_bn + channels-last (oneDNN) against stock and torch.compile (inductor), fp32 and bf16 autocast"
    amps = cpu_amps(args)
    if not args.warm_compile:  # time a cold compile, as a first run sees it, not one served from inductor's cache
        import torch._inductor.config as icfg
        icfg.force_disable_caches = True
    for name in args.models:
        torch.manual_seed(0)
        stock = make_model(name).eval()
        x = torch.randn(args.bs, 3, args.px, args.px)
        xcl = x.to(memory_format=torch.channels_last)
        t = time.perf_counter(); folded = cl(fold_conv_bn(stock)); t_fold = time.perf_counter() - t
        stock_cl = cl(copy.deepcopy(stock))
        for amp in amps:
            print(f"\n## CPU inference: timm {name}, batch {args.bs}, {args.px} px, eval, no_grad, "
                  f"{'bf16 autocast' if amp else 'fp32'}")
            variants = {'stock_contiguous': (stock, x), 'stock_cl': (stock_cl, xcl), 'fold_cl': (folded, xcl)}
            def run(m, inp):
                def f():
                    with torch.no_grad(), torch.autocast('cpu', dtype=amp or torch.bfloat16, enabled=amp is not None): m(inp)
                return f
            if not args.no_compile:
                torch._dynamo.reset()
                compiled = torch.compile(copy.deepcopy(stock_cl))
                t = time.perf_counter(); run(compiled, xcl)(); t_compile = time.perf_counter() - t
                variants['compile_cl'] = (compiled, xcl)
                print(f"torch.compile first call (compile) time: {t_compile:.1f} s;  fold_conv_bn time: {t_fold:.2f} s")
            with torch.no_grad(), torch.autocast('cpu', dtype=amp or torch.bfloat16, enabled=amp is not None):
                ref = stock(x).float()
                for k, (m, inp) in variants.items():
                    print(f"  {k:>16} max |diff| vs stock: {(m(inp).float() - ref).abs().max().item():.2e}")
            raw = interleaved({k: run(*v) for k, v in variants.items()}, args.rounds * 2, warmup=2)
            times = medians(raw)
            for k, t in times.items():
                print(f"inference {k:>16}: {t*1000:8.1f} ms   speedup vs stock_cl = {times['stock_cl']/t:.3f}"
                      + (f"   vs compile_cl = {times['compile_cl']/t:.3f}" if 'compile_cl' in times else ''))
            print("  " + paired_ratios(raw, 'stock_cl', 'fold_cl'))
            if 'compile_cl' in times: print("  " + paired_ratios(raw, 'compile_cl', 'fold_cl'))

def section_gpu(args):
    if not torch.cuda.is_available():
        print("\n## GPU: no CUDA device here: GPU section UNVERIFIED (not run)"); return
    bs, px = args.gpu_bs, 224
    print(f"\n## GPU: torchvision resnet50 AMP ({args.gpu_dtype}) training, batch {bs}, {px} px, synthetic, {torch.cuda.get_device_name()}")
    dt = getattr(torch, args.gpu_dtype)
    torch.manual_seed(0)
    x = torch.randn(bs, 3, px, px, device='cuda')
    base = torchvision.models.resnet50().cuda()
    xcl = x.to(memory_format=torch.channels_last)
    fused = lambda mode: lambda: fuse_conv_bn(cl(copy.deepcopy(base)), mode)
    # (model maker, input, fused layers' way): 'fused' always runs clfast's op, 'timed' (the default) the faster per layer
    variants = {'contiguous_amp': (lambda: copy.deepcopy(base), x, None), 'cl_amp': (lambda: cl(copy.deepcopy(base)), xcl, None),
                'fused_speed': (fused('speed'), xcl, 'fused'), 'fused_timed': (fused('speed'), xcl, 'timed'),
                'fused_memory': (fused('memory'), xcl, 'fused')}
    if not args.no_compile:
        variants['compile_cl_amp'] = (lambda: torch.compile(cl(copy.deepcopy(base))), xcl, None)
    res = {}
    for k, (make, inp, way) in variants.items():  # one model at a time so that peak memory is per mode
        m = make(); torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
        f = with_setting(train_step_fn(m, inp, 'cuda', dt), set_layer_way, way)
        t0 = time.perf_counter(); f(); f(); warm = time.perf_counter() - t0
        ts = []
        for _ in range(args.rounds * 4):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        res[k] = (statistics.median(ts), torch.cuda.max_memory_allocated() / 2**30, warm)
        del m, f
    for k, (t, mem, warm) in res.items():
        print(f"{k:>15}: {bs/t:8.0f} img/s  speedup vs contiguous_amp = {res['contiguous_amp'][0]/t:.3f}  "
              f"peak {mem:.2f} GiB  (first 2 steps {warm:.1f} s)")

def section_overhead(args):
    """The fixed cost of one fused layer per training step, on a layer too small for the kernels to matter (batch 2,
    8 channels, 4x4): stock conv -> BN -> ReLU against the fused layer run fused (the op, its C++ autograd node and the
    kernel ops). Median microseconds of forward + backward, rounds interleaved; `--profile`: op by op"""
    print("\n## Fixed cost per layer and training step (batch 2, 8 channels, 4x4, channels-last, 1 thread)")
    threads = torch.get_num_threads(); torch.set_num_threads(1)
    stock = cl(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU()))
    fused = fuse_conv_bn(copy.deepcopy(stock), 'speed')
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last).requires_grad_()
    def steps(m, n=50):
        def f():
            for _ in range(n): m(x).sum().backward()
        return f
    way = set_layer_way('fused')   # the fused op's cost, not what 'timed' would pick for so small a layer
    raw = interleaved({'stock': steps(stock), 'fused': steps(fused)}, args.rounds * 6, warmup=2)
    for k, t in medians(raw).items(): print(f"{k:>24}: {t / 50 * 1e6:7.0f} us per layer-step")
    print("  " + paired_ratios(raw, 'fused', 'stock'))
    if args.profile:   # where a fused layer's forward spends its fixed cost, op by op
        from torch.profiler import profile
        with profile() as prof, torch.no_grad():
            for _ in range(500): fused(x)
        print(prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=12))
    set_layer_way(way); torch.set_num_threads(threads)

NEVER_SLOWER_MODELS = ('resnet50', 'efficientnet_b0', 'mobilenetv3_large_100', 'regnety_016', 'tv:densenet121')


RATIOS = {'speed': ('to_channelslast', 'speed'), 'speed_vs_plain': ('channels_last', 'speed'),
          'route': ('channels_last', 'to_channelslast')}

def never_slower_rows(args) -> list:
    "One process's rows of issue 23's table: per model and precision, `paired_stats` of each of `RATIOS`"
    from clfast.guard import guard_model
    names = args.models if args.models_given else NEVER_SLOWER_MODELS
    rows = []
    for name in names:
        torch.manual_seed(0)
        base = getattr(torchvision.models, name[3:])() if name.startswith('tv:') else make_model(name)
        x = torch.randn(args.bs, 3, args.px, args.px).to(memory_format=torch.channels_last)
        models = {'channels_last': cl(copy.deepcopy(base)), 'to_channelslast': cl(copy.deepcopy(base)),
                  'speed': fuse_conv_bn(cl(copy.deepcopy(base)), 'speed')}
        for k in ('to_channelslast', 'speed'): guard_model(models[k])
        for amp in cpu_amps(args):
            t0 = time.perf_counter()
            fns = {k: train_step_fn(m, x, amp=amp) for k, m in models.items()}
            for f in fns.values(): f()     # the first step: per-shape timing (the GEMM way, the layer choice) happens here
            first = time.perf_counter() - t0
            raw = interleaved(fns, args.rounds, warmup=1)
            t = medians(raw)
            row = dict(name=name, dt='bf16' if amp else 'fp32', ms={k: v * 1e3 for k, v in t.items()}, first_s=first,
                       **{r: paired_stats(raw, *pair) for r, pair in RATIOS.items()})
            rows.append(row)
            print_row(row, f"; {t['channels_last']*1e3:.0f} / {t['to_channelslast']*1e3:.0f} / {t['speed']*1e3:.0f} ms; "
                           f"first steps {first:.1f} s")
    return rows

def print_row(row:dict, tail:str=''):
    "One row of issue 23's table: each of `RATIOS` as median (and range)"
    q = lambda r: f"{r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f})"
    print(f"{row['name']:>22} {row['dt']}: to_channelslast / speed {q(row['speed'])}; channels_last / speed "
          f"{q(row['speed_vs_plain'])}; channels_last / to_channelslast {q(row['route'])}{tail}", flush=True)

def section_never_slower(args):
    """Issue 23's table: a training step of fuse='speed' against what `to_channelslast()` runs without fusing (stock
    channels-last, precise BatchNorm where stock measured imprecise, the guard), both prepared as `to_channelslast`
    prepares them (`guard_model`), and against PyTorch's channels-last alone (`channels_last`: no clfast); fp32 and bf16
    autocast where native. Paired rounds, order alternating. A name `tv:<arch>` is torchvision's model; `--models`
    default: the issue's five.

    `--processes N` runs the table in N fresh processes one after another and reports per row the median of their
    paired medians: here a variant's step moves 10-30% from one process to the next and one process's paired ratio by
    up to 0.3, so one process is one sample, not the answer (BENCHMARKS.md, session 16). `--steady-heap` runs them with
    glibc's mmap and trim thresholds fixed high (`STEADY_HEAP`): no fresh zero-filled pages per step, which users'
    processes do meet (here it moved whole steps by -8% to +19% per model and precision, not the ratios' spread)"""
    if args.rows_out or (args.processes <= 1 and not args.steady_heap):
        rows = never_slower_rows(args)
        if args.rows_out: Path(args.rows_out).write_text(json.dumps(rows))
    else:
        runs, n = [], max(1, args.processes)
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(n):
                print(f"\n# process {i + 1} of {n}{' (steady heap)' if args.steady_heap else ''}", flush=True)
                out = Path(tmp) / f'rows{i}.json'
                child = ['--sections', 'never_slower', '--bs', args.bs, '--px', args.px, '--rounds', args.rounds,
                         '--rows-out', out, *(['--models', *args.models] if args.models_given else []),
                         *(['--cpu-bf16'] if args.cpu_bf16 else [])]
                env = {**os.environ, **(STEADY_HEAP if args.steady_heap else {})}
                subprocess.run([sys.executable, __file__, *map(str, child)], check=True, env=env)
                runs.append(json.loads(out.read_text()))
        print(f"\n## median over {n} processes of each process's paired median (the processes' range)")
        rows = []
        for row_runs in zip(*runs):
            row = dict(name=row_runs[0]['name'], dt=row_runs[0]['dt'])
            for r in RATIOS:
                per = sorted(run[r][0] for run in row_runs)
                row[r] = (statistics.median(per), per[0], per[-1])
            rows.append(row)
            print_row(row)
    for dt in ('fp32', 'bf16'):
        rs = [r for r in rows if r['dt'] == dt]
        if not rs: continue
        g = lambda k: f"geomean {statistics.geometric_mean([r[k][0] for r in rs]):.3f}, worst {min(r[k][0] for r in rs):.3f}"
        print(f"{dt}: to_channelslast / speed {g('speed')};  channels_last / speed {g('speed_vs_plain')};  "
              f"channels_last / to_channelslast {g('route')}")

def section_pointwise(args):
    """A squeeze-excite 1x1 conv on 1x1 maps: the stock conv against clfast's PointwiseConv2d (a matrix product), per
    batch size; then whole models' `to_channelslast()` training steps with the guard's product route off and on"""
    from clfast.fuse.pointwise import to_pointwise
    print("\n## squeeze-excite 1x1 convs on 1x1 maps: stock conv / PointwiseConv2d (above 1 = the matrix product faster)")
    for dt in [amp or torch.float32 for amp in cpu_amps(args)]:
        for cin, cout in ((144, 6), (672, 28), (1152, 48), (48, 1152), (888, 222)):
            for bs in (1, 8, 64, 256):
                stock = nn.Conv2d(cin, cout, 1).to(dt)
                point = copy.deepcopy(stock); to_pointwise(nn.Sequential(point))
                x = torch.randn(bs, cin, 1, 1, dtype=dt).contiguous(memory_format=torch.channels_last).requires_grad_()
                dy = torch.randn(bs, cout, 1, 1, dtype=dt)
                def fwd(m):
                    def f():
                        with torch.no_grad(): m(x)
                    return f
                fwd_bwd = lambda m: lambda: m(x).backward(dy)
                raw = interleaved({'conv': fwd(stock), 'matmul': fwd(point), 'conv_train': fwd_bwd(stock),
                                   'matmul_train': fwd_bwd(point)}, args.rounds * 20, warmup=5)
                t = medians(raw)
                print(f"  {str(dt)[6:]:>8} {cin:>4}->{cout:<4} batch {bs:>3}: forward {t['conv']*1e6:6.1f} / {t['matmul']*1e6:6.1f} us, "
                      f"{paired_ratios(raw, 'conv', 'matmul')};  forward+backward {t['conv_train']*1e6:6.1f} / "
                      f"{t['matmul_train']*1e6:6.1f} us, {paired_ratios(raw, 'conv_train', 'matmul_train')}", flush=True)
    # whole models as `to_channelslast()` prepares them (`guard_model`), the guard's product route on and off
    from clfast import guard
    from clfast.guard import guard_model
    from clfast.routes import SLOW_POINTWISE_MAPS
    print(f"\n## to_channelslast training step (batch {args.bs}, {args.px} px), squeeze-excite convs as the conv / as "
          f"products (premise {SLOW_POINTWISE_MAPS.name} {'held' if SLOW_POINTWISE_MAPS.present() else 'did not hold'} here)")
    def set_route(on:bool) -> bool:   # a `with_setting` switch: the premise as read per call, forced
        from clfast import timing
        key = f'premise:{SLOW_POINTWISE_MAPS.name}'
        before, timing._here[key] = timing._here[key], on   # this process's answer (a bool as a numerics premise's)
        return before
    amps = cpu_amps(args)
    for name in (args.models if args.models_given else ('efficientnet_b0', 'mobilenetv3_large_100', 'regnety_016')):
        torch.manual_seed(0)
        model = cl(make_model(name))
        with_setting(lambda: guard_model(model), set_route, True)()   # guarded as where the premise holds, to compare
        x = torch.randn(args.bs, 3, args.px, args.px).to(memory_format=torch.channels_last)
        for amp in amps:
            step = train_step_fn(model, x, amp=amp)
            fns = {'conv': with_setting(step, set_route, False), 'product': with_setting(step, set_route, True)}
            raw = interleaved(fns, args.rounds * 2, warmup=1)
            t = medians(raw)
            print(f"  {name:>22} {'bf16' if amp else 'fp32'}: {t['conv']*1e3:6.1f} / {t['product']*1e3:6.1f} ms, "
                  f"{paired_ratios(raw, 'conv', 'product')}", flush=True)

SECTIONS = {'pointwise': section_pointwise, 'train': section_train, 'never_slower': section_never_slower, 'infer': section_infer, 'gpu': section_gpu, 'overhead': section_overhead}

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--sections', nargs='+', default=list(SECTIONS), choices=list(SECTIONS))
    p.add_argument('--models', nargs='+', default=None, help='timm model names (never_slower: also tv:<torchvision arch>)')
    p.add_argument('--bs', type=int, default=16); p.add_argument('--px', type=int, default=160)
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--profile', action='store_true', help="overhead: also print torch.profiler's table of 500 fused forwards")
    p.add_argument('--no-compile', action='store_true', help='skip the torch.compile variants')
    p.add_argument('--cpu-bf16', action='store_true', help='also time bf16 autocast where the CPU has no native bf16')
    p.add_argument('--warm-compile', action='store_true', help="let torch.compile use inductor's on-disk cache")
    p.add_argument('--processes', type=int, default=1, help='never_slower: run the table in this many fresh processes, '
                   'one after another, and report the median of their paired medians')
    p.add_argument('--steady-heap', action='store_true', help="never_slower: run the processes with glibc's mmap and "
                   "trim thresholds fixed high (no fresh pages per step)")
    p.add_argument('--rows-out', default=None, help=argparse.SUPPRESS)   # never_slower's child processes: rows as JSON
    p.add_argument('--gpu-bs', type=int, default=256); p.add_argument('--gpu-dtype', default='float16')
    args = p.parse_args(argv)
    args.models_given = args.models is not None
    if args.models is None: args.models = ['resnet50', 'efficientnet_b0']
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, cuda={torch.cuda.is_available()}")
    for s in args.sections: SECTIONS[s](args)

if __name__ == '__main__': main()
