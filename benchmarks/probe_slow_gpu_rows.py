#!/usr/bin/env python
"""The GPU rows that lose, probed: where clfast's fuse='memory' loses time in fp16 that it does not in bf16 (parts 1
and 2), and where eager fuse='speed' spends the host's time at a small batch (part 3). Plain torch, clfast and
fastai's Adam: no Learner

Part 1, always: one fused layer step (forward + backward) in 'memory' mode under autocast, bf16 vs fp16, at resnet50
layer shapes (default: layer1's conv3 64->256 1x1 + BN + add + ReLU, and its conv2 64->64 3x3 + BN + ReLU, N=256,
56x56), beside the stock layer (conv -> BN [-> + residual] -> ReLU) in the same dtype:
  - GPU time per kernel name per step (torch.profiler), grouped (cuDNN conv forward / dgrad / wgrad, clfast's Triton
    `_stats` `_fwd` `_bwd_sums` `_bwd_dx`, stock BN, elementwise casts/adds, other), with launch counts per step: two
    conv-forward launches per fused step is the recomputation; a different cuDNN kernel name in fp16 than in bf16 is
    cuDNN's heuristics (cudnn.benchmark off, as in the fits) choosing otherwise
  - GPU span per step (CUDA events, steps back to back) and host issue time per step (no sync inside)
  If fp16's fused GPU ms/step and host us/step are within ~5-10% of bf16's, nothing in the fused layer explains a
  35% slower step: the cost is the step around it (GradScaler's sync; part 2).

Part 2, `--step`: a whole torchvision resnet50 step fused in 'memory' mode (b256, 224 px), as fastai's fit runs it:
autocast forward, loss, (scaled) backward, fastai's per-parameter Python Adam, zero_grad, and the loss copied to the host at the end of every step (fastai's
Recorder does `to_detach(loss.mean())`: one sync a step in every dtype). Variants:
  bf16                      no scaler (fastai's bf16)
  bf16+sync                 bf16 with a torch.cuda.synchronize() between backward and the optimizer step (what
                            GradScaler.step's found_inf .item() does in fp16)
  fp16+scaler               torch.amp.GradScaler enabled (fastai's fp16: scale, unscale_, .item() sync, get_scale)
  fp16-noscaler             fp16 kernels, GradScaler(enabled=False): no sync before the optimizer
  Reading: fp16+scaler ~ bf16+sync >> bf16 ~ fp16-noscaler  => the sync before a host-heavy optimizer (the GPU backlog
  of backward no longer overlaps the Python optimizer) is the cost; fp16-noscaler >> bf16 => the fp16 kernels are.
  `--stock` adds the same variants for the unfused model. Cost on a cold Triton cache: ~30 specializations per dtype.

    python benchmarks/probe_slow_gpu_rows.py                       # part 1 on CUDA (~15-30 s incl. Triton compiles)
    python benchmarks/probe_slow_gpu_rows.py --step                # part 1 + part 2
    python benchmarks/probe_slow_gpu_rows.py --step --only-step --stock
    python benchmarks/probe_slow_gpu_rows.py --only-step --eager-speed   # parts 2 and 3 (3: eager 'speed' at batch 64)
    TRITON_INTERPRET=1 python benchmarks/probe_slow_gpu_rows.py --device cpu --dry --step   # CPU dry run of the logic
"""
from __future__ import annotations
import argparse, contextlib, json, os, sys, time
from collections import defaultdict
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # the repository's clfast, run from anywhere (the GPU machine installs none)

if '--device' in sys.argv and sys.argv[sys.argv.index('--device') + 1] == 'cpu':
    os.environ.setdefault('TRITON_INTERPRET', '1')   # the CUDA code path, interpreted (set before triton is imported)

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16}


def sync(dev):
    if dev.type == 'cuda': torch.cuda.synchronize(dev)


# ---------------------------------------------------------------- kernel attribution
def kernel_group(name: str) -> str:
    n = name.lower()
    if name.startswith('_stats'): return 'triton _stats'
    if name.startswith('_fwd'): return 'triton _fwd'
    if name.startswith('_bwd_sums'): return 'triton _bwd_sums'
    if name.startswith('_bwd_dx'): return 'triton _bwd_dx'
    if name.startswith('_params') or name.startswith('_running'): return 'triton other'
    if 'batch_norm' in n or 'bn_fw' in n or 'bn_bw' in n or n.startswith('bn_'): return 'stock BN'
    if 'dgrad' in n: return 'conv dgrad'
    if 'wgrad' in n: return 'conv wgrad'
    if any(k in n for k in ('fprop', 'xmma', 'cutlass', 'implicit', 'conv', 'sm90_', 'sm80_', 'cudnn', 'gemm')): return 'conv fwd/other cudnn'
    if 'nhwc' in n or 'nchw' in n or 'transpose' in n: return 'layout copy'
    if 'elementwise' in n or 'copy' in n or 'fill' in n: return 'elementwise'
    if 'reduce' in n: return 'reduce'
    if 'memcpy' in n or 'memset' in n: return 'memcpy/memset'
    return 'other'


def device_events(prof, cuda: bool):
    "(name, microseconds) of each GPU kernel the profiler saw (on a CPU dry run: each aten op, self time)"
    out = []
    from torch.autograd import DeviceType
    for e in prof.events():
        if cuda:
            if getattr(e, 'device_type', None) != DeviceType.CUDA: continue
            dur = e.time_range.elapsed_us() if getattr(e, 'time_range', None) is not None else getattr(e, 'device_time', 0.)
            out.append((e.name, float(dur)))
        else:
            if e.name.startswith('aten::') or e.name.startswith('_'):
                out.append((e.name, float(getattr(e, 'self_cpu_time_total', 0.))))
    return out


def profile_steps(step, steps: int, dev) -> dict:
    from torch.profiler import profile, ProfilerActivity
    cuda = dev.type == 'cuda'
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(dev)
    with profile(activities=acts) as prof:
        for _ in range(steps): step()
        sync(dev)
    by_name = defaultdict(lambda: [0., 0])
    for name, us in device_events(prof, cuda):
        by_name[name][0] += us / steps
        by_name[name][1] += 1
    return {k: (v[0], v[1] / steps) for k, v in by_name.items()}


def time_steps(step, steps: int, dev) -> tuple[float, float]:
    "(GPU span ms per step from CUDA events, steps back to back; host issue us per step, no sync inside)"
    sync(dev)
    if dev.type == 'cuda':
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
    t0 = time.perf_counter()
    for _ in range(steps): step()
    host = (time.perf_counter() - t0) / steps * 1e6
    if dev.type == 'cuda':
        e1.record(); e1.synchronize()
        gpu = e0.elapsed_time(e1) / steps
    else:
        sync(dev); gpu = (time.perf_counter() - t0) / steps * 1e3
    return gpu, host


# ---------------------------------------------------------------- part 1: one layer
def parse_layer(spec: str) -> dict:
    cin, cout, k, stride, res = spec.split(',')
    return dict(cin=int(cin), cout=int(cout), k=int(k), stride=int(stride), res=res == 'res', spec=spec)


def layer_steps(L: dict, n: int, hw: int, dtype, dev, conv_bn_act):
    "The fused ('memory') and stock step closures of layer `L` in autocast `dtype`"
    g = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(L['cin'], L['cout'], L['k'], L['stride'], L['k'] // 2, bias=False).to(dev).to(memory_format=torch.channels_last)
    bn = nn.BatchNorm2d(L['cout']).to(dev)
    cl = lambda t: t.to(dev).contiguous(memory_format=torch.channels_last)
    x = cl(torch.randn(n, L['cin'], hw, hw, generator=g).to(dtype)).requires_grad_()
    ho = (hw + 2 * (L['k'] // 2) - L['k']) // L['stride'] + 1
    res = cl(torch.randn(n, L['cout'], ho, ho, generator=g).to(dtype)).requires_grad_() if L['res'] else None
    gout = cl(torch.randn(n, L['cout'], ho, ho, generator=g).to(dtype))
    leaves = [t for t in (x, res, conv.weight, bn.weight, bn.bias) if t is not None]

    def clear():
        for t in leaves: t.grad = None

    def fused():
        clear()
        with torch.autocast(dev.type, dtype=dtype):
            out = conv_bn_act(x, conv, bn, res, 'relu', 0., mode='memory')
        out.backward(gout)

    def stock():
        clear()
        with torch.autocast(dev.type, dtype=dtype):
            z = bn(conv(x))
            if res is not None: z = z + res
            out = F.relu(z)
        out.backward(gout)
    return fused, stock


def part1(args, dev, conv_bn_act) -> dict:
    results = {}
    for spec in args.layer:
        L = parse_layer(spec)
        print(f"\n## layer {spec} (cin,cout,k,stride,res) N={args.n} {args.hw}x{args.hw}, cudnn.benchmark="
              f"{torch.backends.cudnn.benchmark}", flush=True)
        for dname in args.dtypes:
            dt = DTYPES[dname]
            fused, stock = layer_steps(L, args.n, args.hw, dt, dev, conv_bn_act)
            for way, step in (('memory', fused), ('stock', stock)):
                key = f"{spec} {dname} {way}"
                try:
                    t = time.perf_counter()
                    for _ in range(args.warm): step()
                    sync(dev)
                    warm_s = time.perf_counter() - t
                    prof = profile_steps(step, args.prof_steps, dev)
                    gpu_ms, host_us = time_steps(step, args.time_steps, dev)
                except Exception as e:   # one failing variant must not cost the others
                    print(f"{key}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                    results[key] = dict(error=f"{type(e).__name__}: {e}")
                    continue
                if dev.type == 'cuda' and not prof: print(f"{key}: the profiler saw no GPU kernel (CUPTI?): only the CUDA-event times below")
                groups = defaultdict(float)
                for name, (us, cnt) in prof.items(): groups[kernel_group(name)] += us
                total = sum(us for us, _ in prof.values())
                results[key] = dict(gpu_ms=gpu_ms, host_us=host_us, kernel_us=total, warm_s=warm_s,
                                    groups=dict(groups), kernels={k: v for k, v in prof.items()})
                print(f"{key}: GPU span {gpu_ms:.3f} ms/step, host issue {host_us:.0f} us/step, kernels {total/1e3:.3f} ms/step "
                      f"(warm {warm_s:.1f} s)", flush=True)
                for grp, us in sorted(groups.items(), key=lambda kv: -kv[1]):
                    print(f"    {grp:<22} {us:9.1f} us", flush=True)
                for name, (us, cnt) in sorted(prof.items(), key=lambda kv: -kv[1][0])[:args.top]:
                    print(f"      {us:9.1f} us  x{cnt:<4g} {name[:110]}", flush=True)
            del fused, stock
            if dev.type == 'cuda': torch.cuda.empty_cache()
        # the side-by-side the question needs
        print(f"\n   {spec}: fp16 / bf16 per group (memory mode)")
        a, b = results.get(f"{spec} bf16 memory", {}), results.get(f"{spec} fp16 memory", {})
        if 'groups' in a and 'groups' in b:
            for grp in sorted(set(a['groups']) | set(b['groups'])):
                x, y = a['groups'].get(grp, 0.), b['groups'].get(grp, 0.)
                print(f"    {grp:<22} bf16 {x:9.1f} us  fp16 {y:9.1f} us  ratio {y / x if x else float('nan'):.2f}")
            print(f"    {'GPU span ms':<22} bf16 {a['gpu_ms']:9.3f}     fp16 {b['gpu_ms']:9.3f}     ratio {b['gpu_ms'] / a['gpu_ms']:.2f}")
            print(f"    {'host issue us':<22} bf16 {a['host_us']:9.0f}     fp16 {b['host_us']:9.0f}     ratio {b['host_us'] / a['host_us']:.2f}")
    return results


# ---------------------------------------------------------------- part 2: a whole step
def adam(model):
    "fastai's Adam, as `Learner` makes it (a per-parameter Python loop: the host pattern the fits run)"
    from fastai.optimizer import Adam
    return Adam(list(model.parameters()), lr=1e-4)


def part2(args, dev) -> dict:
    import copy, torchvision
    from clfast.fuse import fuse_conv_bn
    from clfast.recompute import recomputed_outputs
    base = getattr(torchvision.models, args.model)().to(dev).to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(0)
    xb = torch.randn(args.bs, 3, args.px, args.px, generator=g).to(dev).contiguous(memory_format=torch.channels_last)
    yb = torch.randint(0, 1000, (args.bs,), generator=g).to(dev)
    ways = ['memory'] + (['stock'] if args.stock else [])
    variants = [('bf16', False, False), ('bf16+sync', False, True), ('fp16+scaler', True, False), ('fp16-noscaler', False, False)]
    out = {}
    print(f"\n## whole step: {args.model} bs {args.bs} {args.px} px, {args.step_warm} warm + {args.step_steps} timed steps, "
          f"cudnn.benchmark={torch.backends.cudnn.benchmark}", flush=True)
    for way in ways:
        for name, scaler_on, extra_sync in variants:
            key = f"{way} {name}"
            dt = DTYPES[name[:4]]
            try:
                model = copy.deepcopy(base)
                if way == 'memory': fuse_conv_bn(model, 'memory')
                model.to(memory_format=torch.channels_last).train()
                opt = adam(model)
                scaler = torch.amp.GradScaler(dev.type, init_scale=args.init_scale, enabled=scaler_on)
                phases = defaultdict(float)

                def step(record=False):
                    t0 = time.perf_counter()
                    # 'memory' layers' outputs saved as recipes, as fastai's fit does (`ChannelsLast`)
                    with torch.autocast(dev.type, dtype=dt), (recomputed_outputs() if way == 'memory' else contextlib.nullcontext()):
                        pred = model(xb)
                    loss = F.cross_entropy(pred.float(), yb)
                    scaler.scale(loss).backward()
                    t1 = time.perf_counter()
                    if extra_sync: sync(dev)
                    if scaler_on:
                        scaler.step(opt)       # unscale_ + found_inf.item() (a sync) + opt.step
                        before = scaler.get_scale()   # fastai's MixedPrecision appends it each step (.item())
                        scaler.update()
                        if record and scaler.get_scale() < before: phases['skipped steps (overflow)'] += 1
                    else: opt.step()
                    t2 = time.perf_counter()
                    opt.zero_grad()
                    loss.detach().cpu()        # fastai's Recorder (AvgSmoothLoss): a sync every step, every dtype
                    t3 = time.perf_counter()
                    if record:
                        phases['fwd+bwd issue'] += t1 - t0; phases['sync+opt step'] += t2 - t1; phases['zero_grad+loss sync'] += t3 - t2

                for _ in range(args.step_warm): step()
                sync(dev)
                t = time.perf_counter()
                for _ in range(args.step_steps): step(record=True)
                sync(dev)
                ms = (time.perf_counter() - t) / args.step_steps * 1e3
                ph = {k: v if k.startswith('skipped') else v / args.step_steps * 1e3 for k, v in phases.items()}
                out[key] = dict(ms=ms, img_s=args.bs / ms * 1e3, phases=ph,
                                peak_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == 'cuda' else None)
                print(f"{key:<24} {ms:8.1f} ms/step  {args.bs / ms * 1e3:7.0f} img/s   host phases: " +
                      ", ".join(f"{k} {v:.1f}" + ('' if k.startswith('skipped') else ' ms') for k, v in ph.items()), flush=True)
                del model, opt, scaler
                if dev.type == 'cuda': torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(dev)
            except Exception as e:
                print(f"{key}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                out[key] = dict(error=f"{type(e).__name__}: {e}")
    for way in ways:
        b = out.get(f"{way} bf16", {}).get('ms')
        if b: print(f"   {way}: " + ", ".join(f"{n} {out[f'{way} {n}']['ms'] / b:.2f}x" for n, *_ in variants
                                            if 'ms' in out.get(f'{way} {n}', {})) + " of bf16's step time")
    return out


# ---------------------------------------------------------------- part 3: eager 'speed' at a small batch
def part3(args, dev) -> dict:
    """Eager `fuse='speed'` at batch 64 ran 0.80x stock on the H200 with 'timed' running 21 of its 24 layer kinds the
    stock way: where the host's time goes in a whole step, the fused model against the stock one, bf16. Per way: ms a
    step, the layers' ways, the Python functions' own time (cProfile over a few steps: it slows both alike) and the
    ATen ops' self CPU time (torch.profiler), each per step"""
    import copy, cProfile, pstats, torchvision
    from torch.profiler import profile, ProfilerActivity
    from clfast.fuse import fuse_conv_bn
    from clfast import fused as fused_mod
    base = getattr(torchvision.models, args.model)().to(dev).to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(0)
    xb = torch.randn(args.small_bs, 3, args.px, args.px, generator=g).to(dev).contiguous(memory_format=torch.channels_last)
    yb = torch.randint(0, 1000, (args.small_bs,), generator=g).to(dev)
    print(f"\n## eager 'speed' against stock: {args.model} bs {args.small_bs} {args.px} px bf16, {args.step_steps} timed steps",
          flush=True)
    out = {}
    for way in ('stock', 'speed'):
        try:
            model = copy.deepcopy(base)
            if way == 'speed': fuse_conv_bn(model, 'speed')
            model.to(memory_format=torch.channels_last).train()
            opt = adam(model)
            def step():
                with torch.autocast(dev.type, dtype=torch.bfloat16): pred = model(xb)
                F.cross_entropy(pred.float(), yb).backward()
                opt.step(); opt.zero_grad()
                pred.detach()[0, 0].item()   # fastai's Recorder: one sync a step
            for _ in range(args.step_warm): step()   # 'timed' chooses each layer's way in the first steps
            sync(dev)
            t = time.perf_counter()
            for _ in range(args.step_steps): step()
            sync(dev)
            ms = (time.perf_counter() - t) / args.step_steps * 1e3
            n = 3
            pr = cProfile.Profile(); pr.enable()
            for _ in range(n): step()
            sync(dev); pr.disable()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(n): step()
                sync(dev)
            # this process's eager choices (the machine's cache holds other processes' too: the fit's, the tests')
            ways = [w for k, w in fused_mod._ways.items() if 'graphed' not in k[:2]]
            kinds = f"; layer kinds: {ways.count('fused')} fused / {ways.count('stock')} stock" if way == 'speed' else ''
            print(f"{way}: {ms:.1f} ms/step, {args.small_bs / ms * 1e3:.0f} img/s{kinds}", flush=True)
            st = pstats.Stats(pr)
            rows = sorted(((v[2] / n * 1e3, v[1] / n, f"{k[0].split('/')[-1]}:{k[1]}({k[2]})") for k, v in st.stats.items()), reverse=True)
            print(f"  Python's own time a step (cProfile), top {args.top * 2}:")
            for own, calls, name in rows[:args.top * 2]: print(f"    {own:8.2f} ms  x{calls:<6g} {name[:100]}")
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top * 2]
            print(f"  ATen ops' self CPU time a step (torch.profiler), top {args.top * 2}:")
            for e in ops: print(f"    {e.self_cpu_time_total / n / 1e3:8.2f} ms  x{e.count / n:<6g} {e.key[:100]}")
            out[way] = dict(ms=ms, python=rows[:args.top * 2], ops=[(e.key, e.self_cpu_time_total / n, e.count / n) for e in ops])
            del model, opt
            if dev.type == 'cuda': torch.cuda.empty_cache()
        except Exception as e:
            print(f"{way}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            out[way] = dict(error=f"{type(e).__name__}: {e}")
    if 'ms' in out.get('stock', {}) and 'ms' in out.get('speed', {}):
        print(f"   speed / stock step time: {out['speed']['ms'] / out['stock']['ms']:.2f}x")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--device', default='cuda')
    p.add_argument('--dry', action='store_true', help="tiny shapes (a CPU check of the logic)")
    p.add_argument('--n', type=int, default=256); p.add_argument('--hw', type=int, default=56)
    p.add_argument('--layer', action='append', help="cin,cout,k,stride,res|none (repeatable); default: 64,256,1,1,res and 64,64,3,1,none")
    p.add_argument('--dtypes', nargs='+', default=['bf16', 'fp16'], choices=list(DTYPES))
    p.add_argument('--warm', type=int, default=3); p.add_argument('--prof-steps', type=int, default=5)
    p.add_argument('--time-steps', type=int, default=20); p.add_argument('--top', type=int, default=8)
    p.add_argument('--cudnn-benchmark', action='store_true', help="cuDNN's algorithm search on (the fits ran without)")
    p.add_argument('--step', action='store_true', help="part 2: a whole resnet50 step, bf16 / bf16+sync / fp16+scaler / fp16-noscaler")
    p.add_argument('--only-step', action='store_true'); p.add_argument('--stock', action='store_true')
    p.add_argument('--eager-speed', action='store_true', help="part 3: where eager fuse='speed' spends the host's time at --small-bs")
    p.add_argument('--small-bs', type=int, default=64)
    p.add_argument('--model', default='resnet50'); p.add_argument('--bs', type=int, default=256); p.add_argument('--px', type=int, default=224)
    p.add_argument('--step-warm', type=int, default=5); p.add_argument('--step-steps', type=int, default=6)
    p.add_argument('--init-scale', type=float, default=2.**16, help="GradScaler's (fastai's default 65536)")
    p.add_argument('--json', help="write the results here")
    args = p.parse_args(argv)
    if args.dry:
        args.n, args.hw, args.warm, args.prof_steps, args.time_steps = 2, 6, 1, 1, 2
        args.layer = args.layer or ['8,16,1,1,res', '8,8,3,1,none']
        args.model, args.bs, args.small_bs, args.px, args.step_warm, args.step_steps = 'resnet18', 2, 2, 32, 1, 1
    args.layer = args.layer or ['64,256,1,1,res', '64,64,3,1,none']
    dev = torch.device(args.device)
    if dev.type == 'cuda':
        if not torch.cuda.is_available(): sys.exit("no CUDA device (use --device cpu --dry for a CPU check)")
        print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}")
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    from clfast import ops
    from clfast.fused import conv_bn_act
    # a CPU dry run: the Triton kernels serve the CPU, interpreted (the CUDA code path); on CUDA they serve it anyway
    serving = ops.kernels_from('triton', 'CPU') if dev.type == 'cpu' else contextlib.nullcontext()
    t0 = time.perf_counter()
    res = {}
    with serving:
        if not args.only_step: res['layer'] = part1(args, dev, conv_bn_act)
        if args.step or args.only_step: res['step'] = part2(args, dev)
        if args.eager_speed: res['eager_speed'] = part3(args, dev)
    print(f"\n# {time.perf_counter() - t0:.1f} s in all")
    if args.json:
        with open(args.json, 'w') as f: json.dump(res, f, indent=1, default=str)


if __name__ == '__main__': main()
