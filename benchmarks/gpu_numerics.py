"""Which part of the CUDA layer loses precision in fp16/bf16: each piece against fp64 on the same rounded inputs.

    python benchmarks/gpu_numerics.py

Prints, per dtype/activation/residual, the max error relative to the fp64 value's scale of: the conv alone (cuDNN,
forward and both backward results, given an exact `dy` rounded to the dtype); the Triton kernel set with no conv
(BN(+add)+act: `weight=None`); the Triton kernel set with the conv; and the stock composition in the dtype."""
import torch, torch.nn.functional as F
from clfast import triton_kernels as tk
from clfast.reference import ref_layer_fwd, ref_layer_bwd, ConvGeometry
from clfast.act import ACTS

def err(got, exp):
    if got is None or exp is None or got.numel() == 0 or exp.numel() == 0: return float('nan')
    return ((got.double().cpu() - exp.double().cpu()).abs().max() / exp.double().abs().max().clamp_min(1e-12)).item()

def main():
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for act, res in [('relu', True), ('hardswish', True), ('relu', False)]:
            n, cin, h, cout = 4, 16, 9, 70
            rnd = lambda t: t.to(dt).double()
            x, w, b, r, dout = rnd(mk(n, cin, h, h)), rnd(mk(cout, cin, 3, 3) * 0.3), rnd(mk(cout)), rnd(mk(n, cout, h, h)), rnd(mk(n, cout, h, h))
            bw, bb = mk(cout).abs() + 0.5, mk(cout)
            geom, a = ConvGeometry(padding=(1, 1)), ACTS[act].code
            cl = lambda t: t.to('cuda', dt).contiguous(memory_format=torch.channels_last)
            line = [f"{str(dt)[6:]:>8} {act:>9} res={res!s:5}"]
            # conv alone (cuDNN) vs fp64: forward, dx, dw given dy rounded to dt
            y64 = F.conv2d(x, w, b, 1, 1)
            yc = F.conv2d(cl(x), cl(w), b.to('cuda', dt), 1, 1)
            dy = rnd(mk(*y64.shape))
            dx64, dw64, _ = torch.ops.aten.convolution_backward(dy, x, w, [cout], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
            dxc, dwc, _ = torch.ops.aten.convolution_backward(cl(dy), cl(x), cl(w), [cout], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
            line.append(f"conv y {err(yc, y64):.1e} dx {err(dxc, dx64):.1e} dw {err(dwc, dw64):.1e}")
            # kernel sets: with no conv (BN on y rounded to dt) and with the conv
            for label, (xin, win, bin_) in [('bn', (rnd(y64), None, None)), ('layer', (x, w, b))]:
                rr = r if res else None
                o64, y_64, p64 = ref_layer_fwd(xin, win, bin_, bw, bb, rr, None, None, geom, 1e-5, a, 0., True)
                gr = lambda t: None if t is None else cl(t)
                oc, yc2, pc = tk.layer_fwd(gr(xin), gr(win), None if bin_ is None else bin_.to('cuda', dt), bw.float().cuda(), bb.float().cuda(),
                                           gr(rr), None, None, geom, 1e-5, a, 0., True)
                # the fp64 backward from the layer's own y (rounded), so that only the kernels' arithmetic differs
                needs = [True, win is not None, bin_ is not None, True, True, res]
                yd = yc2.double().cpu() if win is not None else y_64
                _, _, p64b = ref_layer_fwd(xin, win, bin_, bw, bb, rr, None, None, geom, 1e-5, a, 0., True, y=yd)
                o64b = ref_layer_fwd(xin, win, bin_, bw, bb, rr, None, None, geom, 1e-5, a, 0., True, y=yd)[0]
                g64 = ref_layer_bwd(dout, xin, win, bin_, yd, p64b, rr, None, geom, True, a, 0., needs)
                gc = tk.layer_bwd(cl(dout), gr(xin), gr(win), None if bin_ is None else bin_.to('cuda', dt), yc2, pc, gr(rr), None,
                                  geom, True, a, 0., needs)
                names = ['dx', 'dw', 'db', 'dg', 'dbeta', 'dres']
                line.append(f"{label}: out {err(oc, o64b):.1e} mean {err(pc[0], p64b[0]):.1e} " +
                            " ".join(f"{nm} {err(gg, ee):.1e}" for nm, gg, ee in zip(names, gc, g64) if gg.numel()))
            print(" | ".join(line), flush=True)

if __name__ == '__main__': main()
