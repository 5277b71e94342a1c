"""The Triton kernels' tilings timed on a GPU against the default (`clfast.triton_kernels.Tiles`), one setting changed
at a time, then the best of each setting together: which tiling brings each pass nearest a device copy's bandwidth on
resnet50's activations (issue 34 item 5: every pass at >= 70% of it).

    python benchmarks/sweep_kernel_tiles.py                        # on a GPU: 4 passes, bf16 and fp16, batch 256 and 64
    python benchmarks/sweep_kernel_tiles.py --compile-only 90      # no GPU needed: each tiling's specializations compiled
                                                                   # for sm_90 (registers, spills, blocks and bytes in flight per SM)
    TRITON_INTERPRET=1 python benchmarks/sweep_kernel_tiles.py --device cpu --dry   # the GPU path, tiny, interpreted

The passes are those of a conv-BN-ReLU training step without the conv (`bench_kernels.py`'s): the statistics, the
forward, the backward's sums alone and the whole backward (sums, then dy). A pass is timed under the tilings whose
changed setting it reads (`AFFECTS`), each against the default in the same run, with `triton.testing.do_bench` (L2
flushed before each run, by a memset that also hides the host's issue time up to its own length: the kernels are
launched through Triton's compiled kernels, ~2 us a launch, so that a small shape's issue stays under it); its result
must match the default's (a tiling that computes something else is reported, never chosen). Before timing, every
specialization the sweep launches is compiled in one process per core (Triton's on-disk cache then serves the
launches): serially, Triton's JIT would spend minutes of the lease.
The table: each pass's fraction of the copy's bandwidth under the default, and each tiling's speedup over it; then per
pass the geometric mean over the shapes, and the tiling of the best settings together, timed the same way.
"""
from __future__ import annotations
import argparse, contextlib, math, multiprocessing, os, statistics, sys, time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from clfast import triton_kernels as tk, gpu_report as gr
from clfast.act import ACTS

DEFAULT = tk.Tiles()
# one setting changed a variant: each side of the default where the compile report allows it
VARIANTS = {'default': {}, 'max_block_c=128': dict(max_block_c=128), 'max_block_c=32': dict(max_block_c=32),
            'tile=2048': dict(tile=2048), 'tile=8192': dict(tile=8192),
            'reduce_tile=1024': dict(reduce_tile=1024), 'reduce_tile=4096': dict(reduce_tile=4096),
            'stats_unroll=2': dict(stats_unroll=2), 'stats_unroll=8': dict(stats_unroll=8),
            'bwd_unroll=1': dict(bwd_unroll=1), 'bwd_unroll=4': dict(bwd_unroll=4),
            'stats_programs=512': dict(stats_programs=512), 'stats_programs=2048': dict(stats_programs=2048),
            'bwd_programs=256': dict(bwd_programs=256), 'bwd_programs=1024': dict(bwd_programs=1024),
            'warps_stats=8': dict(warps_stats=8), 'warps_fwd=4': dict(warps_fwd=4), 'warps_bwd=4': dict(warps_bwd=4),
            'warps_dx=8': dict(warps_dx=8)}
PASSES = ('stats', 'fwd', 'bwd_sums', 'bwd')
BYTES = dict(stats=1, fwd=2, bwd_sums=2, bwd=5)   # [M, C] tensors each pass reads or writes
# the passes that read each setting (a pass is timed only under the tilings that change what it runs)
AFFECTS = dict(tile={'fwd', 'bwd'}, reduce_tile={'stats', 'bwd_sums', 'bwd'}, stats_unroll={'stats'},
               bwd_unroll={'bwd_sums', 'bwd'}, max_block_c=set(PASSES), stats_programs={'stats'},
               bwd_programs={'bwd_sums', 'bwd'},
               warps_stats={'stats'}, warps_fwd={'fwd'}, warps_bwd={'bwd_sums', 'bwd'},
               warps_dx={'bwd'})
C_H = [(64, 112), (256, 56), (512, 28), (1024, 14), (2048, 7)]   # resnet50's activations at 224 px
RELU = ACTS['relu'].code

def reads(over:dict, p:str) -> bool:
    "Whether pass `p` is timed under the variant of settings `over`: the default's (no setting changed), or one it reads"
    return not over or any(p in AFFECTS[k] for k in over)

def shapes(batches, dry:bool) -> list[tuple]:
    if dry: return [(2, 64, 6, 6), (2, 128, 3, 3)]
    return [(n, c, h, h) for n in batches for c, h in C_H]

def inputs(shape, dtype, device):
    "The rows of an activation, an output gradient, and the statistics' vectors as a training step has them"
    n, c, h, w = shape
    if device == 'meta': return (torch.empty(n * h * w, c, dtype=dtype, device='meta'),) * 2 + (torch.empty(c, device='meta'),) * 2
    g = torch.Generator(device=device).manual_seed(0)
    x, dout = (torch.randn(n * h * w, c, generator=g, device=device).to(dtype) for _ in range(2))
    return x, dout, torch.rand(c, generator=g, device=device) + .5, torch.randn(c, generator=g, device=device)

def runs(x, dout, wt, b) -> dict:
    "Each pass as a call, and what it returns (the result the variants must agree on)"
    mean, var = tk.stats(x)
    invstd = (var + 1e-5).rsqrt()
    scale, shift = invstd * wt, b - mean * invstd * wt
    return dict(stats=lambda: tk.stats(x), fwd=lambda: tk.fwd(x, scale, shift, None, RELU),
                bwd_sums=lambda: tk.bwd(dout, x, mean, invstd, scale, shift, None, RELU, True, False, want_dy=False)[1:3],
                bwd=lambda: tk.bwd(dout, x, mean, invstd, scale, shift, None, RELU, True, False)[:3])

def launches(variants:dict, batches, dtypes, dry:bool) -> list:
    "Every launch the sweep makes under `variants` (`{name: settings changed}`), dry-run on shape-only tensors"
    out = []
    for dt in dtypes:
        for shape in shapes(batches, dry):
            with gr.recording(run=False) as ls:
                r = runs(*inputs(shape, dt, 'meta'))
                for over in variants.values():
                    with tk.tiling(DEFAULT._replace(**over)):
                        for p in PASSES:
                            if reads(over, p): r[p]()
            out += ls
    return out

def _compile_shard(variants, batches, dtypes, dry, cc, shard, shards) -> list:
    "Compile every `shards`-th specialization from the `shard`-th: `(variant-free description, regs, spills, blocks, bytes in flight)`"
    specs = gr.specializations(launches(variants, batches, dtypes, dry), cc)[shard::shards]
    res = []
    for s in specs:
        try:
            c = gr.compile_spec(s)
            res.append((s.name, s.describe(), c.num_warps, c.regs, c.spills, c.blocks, c.in_flight))
        except Exception as e: res.append((s.name, s.describe(), 0, 0, f"{type(e).__name__}: {e}", 0, 0))
    return res

def compile_all(variants, batches, dtypes, dry, cc, processes) -> list:
    "`_compile_shard` over every specialization, in `processes` processes (fresh interpreters: a fork copies Triton's threads)"
    if processes < 2: return _compile_shard(variants, batches, dtypes, dry, cc, 0, 1)
    ctx = multiprocessing.get_context('spawn')
    with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        futures = [pool.submit(_compile_shard, variants, batches, dtypes, dry, cc, i, processes) for i in range(processes)]
        return [r for f in futures for r in f.result()]

def compile_table(rows) -> str:
    lines = ["| kernel | specialization | warps | registers | spills | blocks/SM | bytes in flight/SM |", "|---|---|---|---|---|---|---|"]
    for k, d, w, regs, sp, bl, inf in sorted(set(rows), key=lambda r: (r[0], r[1], r[2])):
        lines.append(f"| `{k}` | {d} | {w} | {regs} | {sp if isinstance(sp, str) else 'yes' if sp else 0} | {bl} | "
                     f"{inf / 1024:.0f} KB |")
    return '\n'.join(lines)

def _agree(a, b) -> bool:
    "A variant's result against the default's: equal where nothing is summed, within the sums' rounding where something is"
    a, b = (a if isinstance(a, (tuple, list)) else (a,)), (b if isinstance(b, (tuple, list)) else (b,))
    for u, v in zip(a, b):
        scale = max(v.abs().max().item(), 1e-30) if v.numel() else 1.
        if not torch.allclose(u.float(), v.float(), rtol=1e-2, atol=1e-2 * scale): return False
    return True

def timer(device:str, reps:int):
    "Milliseconds of a call: on a GPU `bench_kernels.cuda_time`'s (do_bench, L2 flushed), the one way the kernels are timed"
    if device == 'cuda':
        from benchmarks.bench_kernels import cuda_time
        return lambda f: cuda_time(f, reps)
    def cpu(f):   # the dry run's: the interpreter's time, which says nothing of a GPU
        ts = []
        for _ in range(2):
            t = time.perf_counter(); f(); ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    return cpu

def sweep(variants:dict, batches, dtypes, dry, device, reps, deadline, res:dict) -> dict:
    """`res` filled as `{(shape, dtype): {'copy': ms, pass: {variant: ms, or 'wrong'}}}` until `deadline`
    (time.monotonic), and returned: an interrupt keeps what was measured. Triton's kernels are launched through their
    compiled kernels (`launching('compiled')`, ~2 us a launch against the JIT's ~12): `do_bench`'s L2 flush hides the
    host's issue time only up to its own ~60 us on an H200, and a small shape's backward issues several launches"""
    t_of = timer(device, reps)
    for shape in shapes(batches, dry):   # (the largest batch first: a budget cut leaves out the smaller)
        for dt in dtypes:
            if time.monotonic() > deadline: return res
            x, dout, wt, b = inputs(shape, dt, device)
            row = res[(shape, str(dt)[6:])] = {'copy': t_of(x.clone)}
            r = runs(x, dout, wt, b)
            for p in PASSES:
                want, row[p] = r[p](), {}   # (each pass in full before its row shows: `table` reads rows as they are)
                for name, over in variants.items():
                    if not reads(over, p): continue
                    with tk.tiling(DEFAULT._replace(**over)):
                        if name != 'default' and not _agree(r[p](), want): row[p][name] = 'wrong'; continue
                        row[p][name] = t_of(r[p])
    return res

def table(res) -> tuple[str, dict]:
    "The sweep's table and, per pass, each variant's geometric-mean speedup over the default"
    lines, gains, wrong = [], {p: {} for p in PASSES}, set()
    for p in PASSES:
        names = list(dict.fromkeys(n for row in res.values() for n in row.get(p, {}) if n != 'default'))
        lines += ['', f"**{p}** (fraction of the copy's bandwidth under the default; then each tiling's speedup over it)", '',
                  '| shape | dtype | default | ' + ' | '.join(names) + ' |', '|---|---|---|' + '---|' * len(names)]
        for (shape, dt), row in res.items():
            if p not in row or 'default' not in row[p]: continue
            d = row[p]['default']
            frac = BYTES[p] * row['copy'] / 2 / d   # a copy moves 2 tensors in row['copy'] ms
            cells = []
            for n in names:
                v = row[p].get(n)
                cells.append('-' if v is None else v if isinstance(v, str) else f"{d / v:.2f}")
                if isinstance(v, float): gains[p].setdefault(n, []).append(d / v)
                elif v == 'wrong': wrong.add(n)
            lines.append(f"| {list(shape)} | {dt} | {frac:.2f} | " + ' | '.join(cells) + ' |')
    # a tiling whose results differed from the default's anywhere is never a candidate
    means = {p: {n: math.exp(statistics.fmean(map(math.log, v))) for n, v in g.items() if n not in wrong}
             for p, g in gains.items()}
    if not any(len(row) > 1 for row in res.values()): return "(nothing measured: the budget ran out first)", means
    if wrong: lines += ['', f"Results differing from the default's (never chosen): {', '.join(sorted(wrong))}"]
    lines += ['', '| pass | best tiling (geometric mean over the shapes) | speedup |', '|---|---|---|']
    for p, m in means.items():
        if m:
            n = max(m, key=m.get)
            lines.append(f"| {p} | {n} | {m[n]:.2f} |")
    return '\n'.join(lines), means

def best_together(means:dict, gain:float=1.03) -> dict:
    """The settings whose variant sped up every pass that reads it by `gain` or more (geometric mean), the best of each
    setting: the overrides of one tiling to time against the default"""
    best = {}
    for name, over in VARIANTS.items():
        if not over: continue
        (k, v), = over.items()
        ps = [p for p in AFFECTS[k] if name in means.get(p, {})]
        if not ps: continue
        g = math.exp(statistics.fmean(math.log(means[p][name]) for p in ps))
        if g >= gain and g > best.get(k, (None, 0))[1]: best[k] = (v, g)
    return {k: v for k, (v, _) in best.items()}

def main(argv=None):
    a = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    a.add_argument('--device', default='cuda')
    a.add_argument('--dry', action='store_true', help="tiny shapes (with TRITON_INTERPRET=1 on the CPU): the script's own test")
    a.add_argument('--compile-only', type=int, metavar='CC', help="compile for this compute capability (90: sm_90) and print the resources; no GPU")
    a.add_argument('--variants', nargs='+', choices=list(VARIANTS), default=list(VARIANTS))
    a.add_argument('--dtypes', nargs='+', default=['bfloat16', 'float16'], choices=['bfloat16', 'float16', 'float32'])
    a.add_argument('--batches', nargs='+', type=int, default=[256, 64])
    a.add_argument('--reps', type=int, default=5, help="do_bench's warm-up and timing, in milliseconds: max(5, this) and max(20, 5 x this)")
    a.add_argument('--budget', type=float, default=240, help="seconds: no new shape starts after them")
    a.add_argument('--processes', type=int, default=os.cpu_count())
    args = a.parse_args(argv)
    variants = {n: VARIANTS[n] for n in ['default'] + [n for n in args.variants if n != 'default']}
    dtypes = [getattr(torch, d) for d in args.dtypes]
    t0 = time.monotonic()
    if args.compile_only:
        rows = compile_all(variants, args.batches, dtypes, args.dry, args.compile_only, args.processes)
        print(f"{len(rows)} specializations compiled for sm_{args.compile_only} in {time.monotonic() - t0:.0f} s\n")
        print(compile_table(rows))
        return rows
    if args.device == 'cuda':
        if not torch.cuda.is_available(): sys.exit("no CUDA GPU here: --compile-only CC runs without one")
        cc = int('%d%d' % torch.cuda.get_device_capability())
        n = len(compile_all(variants, args.batches, dtypes, args.dry, cc, args.processes))
        print(f"{torch.cuda.get_device_name()}: {n} specializations compiled in {time.monotonic() - t0:.0f} s", flush=True)
    res = {}
    launch = (lambda: tk.launching('compiled')) if args.device == 'cuda' else contextlib.nullcontext   # one per block
    try:   # (Ctrl-C, or the GPU script's SIGINT at its step's limit: the table of what was measured)
        # one setting at a time until 3/4 of the budget, then the best of each together against the default
        with launch(): sweep(variants, args.batches, dtypes, args.dry, args.device, args.reps, t0 + .75 * args.budget, res)
        text, means = table(res)
        print(text, flush=True)
        together = best_together(means)
        if not res: pass
        elif not together: print("\nNo setting sped up the passes that read it by 3% or more: the default stays")
        else:
            print(f"\nThe best settings together: {together}", flush=True)
            combo = {'default': {}, 'together': together}
            if args.device == 'cuda': compile_all(combo, args.batches, dtypes, args.dry, cc, args.processes)
            res = {}
            with launch(): sweep(combo, args.batches, dtypes, args.dry, args.device, args.reps, t0 + args.budget, res)
            print(table(res)[0])
    except KeyboardInterrupt:
        print("\n(interrupted: what was measured)\n" + table(res)[0])
    return res

if __name__ == '__main__': main()
