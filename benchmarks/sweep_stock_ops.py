"""A numerical sweep of stock PyTorch CPU ops besides Conv2d (conv_transpose2d, pools, adaptive pools, interpolate,
pixel shuffle, pad, cat, group/instance/batch norm, grid_sample, pointwise activations), channels-last and contiguous,
against fp64 of the same rounded inputs, a poisoned freed buffer before each call (session 47; findings in
BENCHMARKS.md, Session 47; repros of each wrong class in benchmarks/stock_repros/). No clfast code runs. The convT1x1
family (session 67) draws the 1x1 transposed convs with padding and groups that convT's draws never reach.

    OMP_NUM_THREADS=2 python benchmarks/sweep_stock_ops.py FAMILY START COUNT [dtypes]   # JSON lines on stdout

A crash (heap corruption: some families have such classes) ends the process: restart after the last BEGIN on stderr.
"""
import os, sys, json, math, random, time
import torch
import torch.nn.functional as F

CL = torch.channels_last
DTS = {'bf16': torch.bfloat16, 'f32': torch.float32, 'f16': torch.float16}
EPS = {'bf16': 2.0 ** -8, 'f16': 2.0 ** -11, 'f32': 2.0 ** -24}
FAMS = ['convT', 'maxpool', 'avgpool', 'adaptive', 'interp', 'misc', 'norm', 'grid', 'pointwise', 'convT1x1']


def poison():
    p = torch.full((1 << 16,), 1e30); q = torch.full((1 << 10,), 1e30)
    del p, q


# ---------------------------------------------------------------- geometry helpers
def chans(r):
    return r.choice([1, 3, 8, 16, 32, 37, r.randint(1, 37), r.randint(1, 8), 2, 4])


def hw(r, big=0.12):
    u = r.random()
    if u < big:
        return r.randint(13, 40)
    if u < big + 0.25:
        return r.choice([1, 2])
    return r.randint(1, 12)


def batch(r, H, W):
    return r.randint(1, 2) if H * W > 300 else r.randint(1, 4)


def inp(shape, grad=True, cl=True, distinct=False, pdt=None, scale=1.0, lo=None, hi=None, positive=False):
    return dict(shape=tuple(shape), grad=grad, cl=cl, distinct=distinct, pdt=pdt, scale=scale, lo=lo, hi=hi,
                positive=positive)


_POOLS = {}


def pool(dtn):
    if dtn not in _POOLS:
        mb = 7 if dtn == 'bf16' else 10
        vals = [s * 2.0 ** e * (1 + m / 2 ** mb) for s in (1, -1) for e in range(-4, 4) for m in range(2 ** mb)]
        _POOLS[dtn] = torch.tensor(vals, dtype=torch.float64)
    return _POOLS[dtn]


def draw(spec, g, dtn):
    sh = spec['shape']
    if spec['distinct']:
        pl = pool(dtn)
        n = sh[0] * sh[1]; hwn = sh[2] * sh[3]
        rows = [pl[torch.randperm(len(pl), generator=g)[:hwn]] for _ in range(n)]
        return torch.stack(rows).reshape(sh)
    if spec['lo'] is not None:
        return spec['lo'] + (spec['hi'] - spec['lo']) * torch.rand(sh, generator=g, dtype=torch.float64)
    t = torch.randn(sh, generator=g, dtype=torch.float64) * spec['scale']
    if spec['positive']:
        t = t.abs() + 0.1
    return t


# ---------------------------------------------------------------- case generators
def _conv_groups(r):
    "(Cin, groups, Cout): one group, two, or depthwise (a multiplier of 1 or 2)"
    gk = r.choice(['g1', 'g1', 'g2', 'dw'])
    Cin = chans(r)
    if gk == 'g1':
        G = 1; Cout = chans(r)
    elif gk == 'g2':
        Cin = max(2, Cin + (Cin % 2)); G = 2; Cout = 2 * r.randint(1, 18)
    else:
        G = Cin; Cout = Cin * r.choice([1, 1, 2])
    return Cin, G, Cout


def _convT_case(r, N, Cin, Cout, H, W, G, k, s, p, op, d):
    "A conv_transpose2d case of this geometry, with a bias half the time; None where its output would be empty"
    out = tuple((i - 1) * s_ - 2 * p_ + d_ * (k_ - 1) + o_ + 1 for i, k_, s_, p_, o_, d_ in zip((H, W), k, s, p, op, d))
    if min(out) < 1:
        return None
    bias = r.random() < 0.5
    geom = dict(N=N, Cin=Cin, Cout=Cout, H=H, W=W, G=G, k=k, s=s, p=p, op=op, d=d, bias=bias, out=out)
    ins = dict(x=inp((N, Cin, H, W)), w=inp((Cin, Cout // G, *k), scale=1 / math.sqrt(Cin / G * k[0] * k[1])))
    if bias:
        ins['b'] = inp((Cout,))

    def fn(x, w, b=None, _a=s, _p=p, _o=op, _g=G, _d=d):
        return F.conv_transpose2d(x, w, b, _a, _p, _o, _g, _d)
    return geom, ins, fn, [0]


def gen_convT(r):
    while True:
        H, W = hw(r), hw(r)
        N = batch(r, H, W)
        Cin, G, Cout = _conv_groups(r)
        kh = r.randint(1, 4); kw = kh if r.random() < 0.7 else r.randint(1, 4)
        sh_ = r.randint(1, 3); sw = sh_ if r.random() < 0.7 else r.randint(1, 3)
        dh = r.choice([1, 1, 2]); dw_ = dh if r.random() < 0.8 else r.choice([1, 2])
        ph = r.randint(0, kh - 1); pw = r.randint(0, kw - 1)
        oph = r.randint(0, sh_ - 1); opw = r.randint(0, sw - 1)
        case = _convT_case(r, N, Cin, Cout, H, W, G, (kh, kw), (sh_, sw), (ph, pw), (oph, opw), (dh, dw_))
        if case:
            return case


def gen_convT1x1(r):
    "1x1 transposed convs with the padding gen_convT never draws for them (its padding stays below the kernel size)"
    while True:
        H, W = hw(r), hw(r)
        N = batch(r, H, W)
        Cin, G, Cout = _conv_groups(r)
        sh_ = r.randint(1, 3); sw = sh_ if r.random() < 0.7 else r.randint(1, 3)
        ph = r.randint(0, 2); pw = ph if r.random() < 0.7 else r.randint(0, 2)
        oph = r.randint(0, sh_ - 1); opw = r.randint(0, sw - 1)
        case = _convT_case(r, N, Cin, Cout, H, W, G, (1, 1), (sh_, sw), (ph, pw), (oph, opw), (1, 1))
        if case:
            return case


def gen_maxpool(r):
    while True:
        H, W = hw(r), hw(r); N = batch(r, H, W); C = chans(r)
        k = r.randint(1, 3); kw = k if r.random() < 0.8 else r.randint(1, 3)
        s = r.randint(1, 3); sw = s if r.random() < 0.8 else r.randint(1, 3)
        p = r.randint(0, k // 2); pw = r.randint(0, kw // 2)
        d = r.choice([1, 1, 2]); ceil = r.random() < 0.3; ri = r.random() < 0.3
        if H + 2 * p - d * (k - 1) - 1 < 0 or W + 2 * pw - d * (kw - 1) - 1 < 0:
            continue
        geom = dict(N=N, C=C, H=H, W=W, k=(k, kw), s=(s, sw), p=(p, pw), d=d, ceil=ceil, ret_idx=ri)
        ins = dict(x=inp((N, C, H, W), distinct=True))

        def fn(x, _k=(k, kw), _s=(s, sw), _p=(p, pw), _d=d, _c=ceil, _ri=ri):
            return F.max_pool2d(x, _k, _s, _p, _d, ceil_mode=_c, return_indices=_ri)
        return geom, ins, fn, [0]


def gen_avgpool(r):
    while True:
        H, W = hw(r), hw(r); N = batch(r, H, W); C = chans(r)
        k = r.randint(1, 4); kw = k if r.random() < 0.8 else r.randint(1, 4)
        s = r.randint(1, 3); sw = s if r.random() < 0.8 else r.randint(1, 3)
        p = r.randint(0, k // 2); pw = r.randint(0, kw // 2)
        ceil = r.random() < 0.3; cip = r.random() < 0.5
        div = r.choice([None, None, None, r.randint(1, 9)])
        if H + 2 * p - k < 0 or W + 2 * pw - kw < 0:
            continue
        geom = dict(N=N, C=C, H=H, W=W, k=(k, kw), s=(s, sw), p=(p, pw), ceil=ceil, cip=cip, div=div)
        ins = dict(x=inp((N, C, H, W)))

        def fn(x, _k=(k, kw), _s=(s, sw), _p=(p, pw), _c=ceil, _cip=cip, _div=div):
            return F.avg_pool2d(x, _k, _s, _p, ceil_mode=_c, count_include_pad=_cip, divisor_override=_div)
        return geom, ins, fn, [0]


def gen_adaptive(r):
    H, W = hw(r), hw(r); N = batch(r, H, W); C = chans(r)
    kind = r.choice(['avg', 'max'])
    o = r.choice([1, 2, 3, 7, (2, 3), (5, 7), (r.randint(1, 12), r.randint(1, 12)), (1, 7)])
    ri = kind == 'max' and r.random() < 0.3
    geom = dict(N=N, C=C, H=H, W=W, kind=kind, out=o, ret_idx=ri)
    ins = dict(x=inp((N, C, H, W), distinct=(kind == 'max')))
    if kind == 'avg':
        def fn(x, _o=o):
            return F.adaptive_avg_pool2d(x, _o)
    else:
        def fn(x, _o=o, _ri=ri):
            return F.adaptive_max_pool2d(x, _o, return_indices=_ri)
    return geom, ins, fn, [0]


def gen_interp(r):
    while True:
        H, W = hw(r), hw(r); N = batch(r, H, W); C = chans(r)
        mode, ac = r.choice([('nearest', None), ('nearest-exact', None), ('bilinear', False), ('bilinear', True),
                             ('bicubic', False), ('bicubic', True)])
        u = r.random()
        if u < 0.6:
            sf = r.choice([2.0, 0.5, 1.5, (2.0, 0.5), (1.5, 2.0)]); size = None
        else:
            sf = None; size = (r.randint(1, 24), r.randint(1, 24))
        if sf is not None:
            sfs = sf if isinstance(sf, tuple) else (sf, sf)
            if math.floor(H * sfs[0]) < 1 or math.floor(W * sfs[1]) < 1:
                continue
        geom = dict(N=N, C=C, H=H, W=W, mode=mode, ac=ac, sf=sf, size=size)
        ins = dict(x=inp((N, C, H, W)))

        def fn(x, _m=mode, _ac=ac, _sf=sf, _sz=size):
            return F.interpolate(x, size=_sz, scale_factor=_sf, mode=_m, align_corners=_ac)
        return geom, ins, fn, [0]


def gen_misc(r):
    while True:
        kind = r.choice(['pixel_shuffle', 'pixel_unshuffle', 'reflect', 'replicate', 'constant', 'cat'])
        H, W = hw(r), hw(r); N = batch(r, H, W); C = chans(r)
        geom = dict(kind=kind, N=N)
        if kind == 'pixel_shuffle':
            rr = r.choice([2, 2, 3]); C = rr * rr * r.randint(1, 8)
            geom.update(C=C, H=H, W=W, r=rr); ins = dict(x=inp((N, C, H, W)))

            def fn(x, _r=rr):
                return F.pixel_shuffle(x, _r)
        elif kind == 'pixel_unshuffle':
            rr = r.choice([2, 2, 3]); H = rr * max(1, H // rr); W = rr * max(1, W // rr)
            geom.update(C=C, H=H, W=W, r=rr); ins = dict(x=inp((N, C, H, W)))

            def fn(x, _r=rr):
                return F.pixel_unshuffle(x, _r)
        elif kind in ('reflect', 'replicate', 'constant'):
            pd = tuple(r.randint(0, 3) for _ in range(4))
            if kind == 'reflect' and (max(pd[0], pd[1]) >= W or max(pd[2], pd[3]) >= H):
                continue
            val = round(r.uniform(-2, 2), 2) if kind == 'constant' else None
            geom.update(C=C, H=H, W=W, pad=pd, value=val); ins = dict(x=inp((N, C, H, W)))

            def fn(x, _pd=pd, _k=kind, _v=val):
                if _k == 'constant':
                    return F.pad(x, _pd, mode='constant', value=_v)
                return F.pad(x, _pd, mode=_k)
        else:
            C2 = chans(r)
            geom.update(C=C, C2=C2, H=H, W=W)
            ins = dict(x=inp((N, C, H, W)), y=inp((N, C2, H, W)))

            def fn(x, y):
                return torch.cat([x, y], 1)
        return geom, ins, fn, [0]


def gen_norm(r):
    while True:
        kind = r.choice(['gn', 'gn', 'in', 'bn_eval', 'bn_train', 'bn_train'])
        H, W = hw(r), hw(r); N = batch(r, H, W); C = chans(r)
        mixed = r.random() < 0.3   # fp32 params with low-precision input
        eps = r.choice([1e-5, 1e-3])
        shift = r.choice([0.0, 0.0, 3.0])   # non-zero mean inputs
        geom = dict(kind=kind, N=N, C=C, H=H, W=W, mixed=mixed, eps=eps, shift=shift)
        pd = 'f32' if mixed else None
        ins = dict(x=inp((N, C, H, W)))
        if kind == 'gn':
            G = r.choice([1, 2, C]) if C % 2 == 0 else r.choice([1, C])
            affine = r.random() < 0.8
            geom.update(G=G, affine=affine)
            if affine:
                ins['w'] = inp((C,), pdt=pd); ins['b'] = inp((C,), pdt=pd)

            def fn(x, w=None, b=None, _G=G, _e=eps, _s=shift):
                return F.group_norm(x + _s, _G, w, b, _e)
        elif kind == 'in':
            if H * W < 2:
                continue
            affine = r.random() < 0.5
            geom.update(affine=affine)
            if affine:
                ins['w'] = inp((C,), pdt=pd); ins['b'] = inp((C,), pdt=pd)

            def fn(x, w=None, b=None, _e=eps, _s=shift):
                return F.instance_norm(x + _s, weight=w, bias=b, eps=_e)
        else:
            train = kind == 'bn_train'
            if train and N * H * W < 2:
                continue
            mom = 0.1
            ins['w'] = inp((C,), pdt=pd); ins['b'] = inp((C,), pdt=pd)
            ins['rm'] = inp((C,), grad=False, pdt=pd); ins['rv'] = inp((C,), grad=False, pdt=pd, positive=True)

            def fn(x, w, b, rm, rv, _t=train, _e=eps, _s=shift):
                y = F.batch_norm(x + _s, rm, rv, w, b, training=_t, momentum=0.1, eps=_e)
                return (y, rm, rv) if _t else y
        return geom, ins, fn, [0]


def gen_grid(r):
    H, W = hw(r), hw(r); N = batch(r, H, W); C = chans(r)
    Ho, Wo = hw(r, 0.05), hw(r, 0.05)
    mode = r.choice(['bilinear', 'bilinear', 'nearest', 'nearest', 'bicubic'])
    pm = r.choice(['zeros', 'border', 'zeros', 'border', 'reflection'])
    ac = r.random() < 0.5
    geom = dict(N=N, C=C, H=H, W=W, Ho=Ho, Wo=Wo, mode=mode, pad=pm, ac=ac)
    ins = dict(x=inp((N, C, H, W)), grid=inp((N, Ho, Wo, 2), cl=False, lo=-1.2, hi=1.2))

    def fn(x, grid, _m=mode, _p=pm, _a=ac):
        return F.grid_sample(x, grid, mode=_m, padding_mode=_p, align_corners=_a)
    return geom, ins, fn, [0]


ACTS = {
    'hardswish': F.hardswish, 'hardsigmoid': F.hardsigmoid, 'silu': F.silu,
    'gelu': lambda x: F.gelu(x), 'gelu_tanh': lambda x: F.gelu(x, approximate='tanh'), 'mish': F.mish,
    'leaky_relu': lambda x: F.leaky_relu(x, 0.1), 'elu': F.elu, 'relu': F.relu,
}


def gen_pointwise(r):
    H, W = hw(r), hw(r); N = batch(r, H, W); C = chans(r)
    kind = r.choice(list(ACTS) + ['add_relu', 'add_relu_'])
    sc = r.choice([1.0, 3.0])
    geom = dict(kind=kind, N=N, C=C, H=H, W=W, scale=sc)
    ins = dict(x=inp((N, C, H, W), scale=sc))
    if kind.startswith('add_relu'):
        ins['y'] = inp((N, C, H, W), scale=sc)

        def fn(x, y, _k=kind):
            z = x + y
            return F.relu(z, inplace=(_k == 'add_relu_'))
    else:
        def fn(x, _f=ACTS[kind]):
            return _f(x)
    return geom, ins, fn, [0]


GENS = dict(convT=gen_convT, maxpool=gen_maxpool, avgpool=gen_avgpool, adaptive=gen_adaptive, interp=gen_interp,
            misc=gen_misc, norm=gen_norm, grid=gen_grid, pointwise=gen_pointwise, convT1x1=gen_convT1x1)


# ---------------------------------------------------------------- runner
def fmt(t):
    if t.dim() != 4:
        return None
    a = t.is_contiguous(); b = t.is_contiguous(memory_format=CL)
    return 'both' if a and b else 'cl' if b else 'contig' if a else 'other'


def run_once(fn, tens_spec, dys, layout, diff_outs):
    tens = {}
    for name, (t, spec) in tens_spec.items():
        t = t.clone()
        if layout == 'cl' and t.dim() == 4 and spec['cl']:
            t = t.contiguous(memory_format=CL)
        if spec['grad']:
            t.requires_grad_(True)
        tens[name] = t
    poison()
    outs = fn(**tens)
    if not isinstance(outs, tuple):
        outs = (outs,)
    res = {}
    if dys is not None:
        ds = []
        for i in diff_outs:
            d = dys[i].to(outs[i].dtype)
            if layout == 'cl' and d.dim() == 4:
                d = d.contiguous(memory_format=CL)
            ds.append(d)
        poison()
        torch.autograd.backward([outs[i] for i in diff_outs], ds)
    for i, o in enumerate(outs):
        res['out%d' % i] = o.detach()
    for name, t in tens.items():
        if spec_grad(tens_spec[name][1]) and t.grad is not None:
            res['g_' + name] = t.grad
    return res


def spec_grad(s):
    return s['grad']


def err(got, ref):
    if got.dtype in (torch.int64, torch.int32):
        return float((got != ref).double().mean()) if got.numel() else 0.0
    g = got.double()
    if g.shape != ref.shape:
        return float('inf')
    if not torch.isfinite(g).all():
        return float('inf')
    if ref.numel() == 0:
        return 0.0
    m = ref.abs().max().item()
    d = (g - ref).abs().max().item()
    return d / m if m > 0 else d


def run_case(fam, seed, dtn, reps=3):
    r = random.Random(seed * 7919 + FAMS.index(fam))
    geom, ins, fn, diff_outs = GENS[fam](r)
    dt = DTS[dtn]
    g = torch.Generator().manual_seed(seed)
    base = {}
    for name, spec in ins.items():
        t = draw(spec, g, dtn)
        pdt = DTS[spec['pdt']] if spec['pdt'] else dt
        base[name] = (t.to(pdt).double(), spec, pdt)
    # reference
    ref_spec = {n: (t, s) for n, (t, s, _) in base.items()}
    rec = dict(fam=fam, seed=seed, dt=dtn, geom=geom)
    try:
        with torch.no_grad():
            o = fn(**{n: t.clone() for n, (t, s) in ref_spec.items()})
        o = o if isinstance(o, tuple) else (o,)
        dys = {i: torch.randn(o[i].shape, generator=g, dtype=torch.float64).to(dt).double() for i in diff_outs}
        ref = run_once(fn, ref_spec, dys, 'contig', diff_outs)
    except Exception as e:
        rec['ref_error'] = str(e)[:200]
        return rec
    for layout in ('contig', 'cl'):
        spec_l = {n: (t.to(pdt), s) for n, (t, s, pdt) in base.items()}
        errs = {}; fmts = {}; repdiff = 0.0; first = None
        try:
            for rep in range(reps):
                got = run_once(fn, spec_l, dys, layout, diff_outs)
                for k, v in got.items():
                    e = err(v, ref[k])
                    errs[k] = max(errs.get(k, 0.0), e) if not math.isnan(e) else float('inf')
                    if rep == 0 and fmt(v) is not None:
                        fmts[k] = fmt(v)
                if first is None:
                    first = got
                else:
                    for k, v in got.items():
                        if v.shape == first[k].shape:
                            dd = (v.double() - first[k].double()).abs()
                            dd = dd.max().item() if dd.numel() else 0.0
                            repdiff = max(repdiff, dd if dd == dd else float('inf'))
        except Exception as e:
            rec[layout] = dict(error=str(e)[:200])
            continue
        rec[layout] = dict(err=errs, fmt=fmts, repdiff=repdiff)
    return rec


def jdump(o):
    return json.dumps(o, default=str).replace('Infinity', '"inf"').replace('NaN', '"nan"')


if __name__ == '__main__':
    fam = sys.argv[1]; start = int(sys.argv[2]); count = int(sys.argv[3])
    dts = sys.argv[4].split(',') if len(sys.argv) > 4 else ['bf16', 'f32', 'f16']
    f16every = 3
    t0 = time.time()
    for seed in range(start, start + count):
        for dtn in dts:
            if dtn == 'f16' and seed % f16every:
                continue
            print('BEGIN', fam, seed, dtn, file=sys.stderr, flush=True)
            rec = run_case(fam, seed, dtn)
            rec['omp'] = torch.get_num_threads()
            print(jdump(rec), flush=True)
    print(jdump(dict(done=fam, secs=time.time() - t0)), flush=True)
