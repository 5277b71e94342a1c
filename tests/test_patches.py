"clfast.patches lists every change clfast makes to fastai, PyTorch and timm, and each is where the list says"
import ast, subprocess, sys, textwrap
from pathlib import Path
from clfast.patches import PATCHES

ROOT = Path(__file__).parent.parent

def _run(code:str) -> str:
    p = subprocess.run([sys.executable, '-c', textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    return p.stdout.strip()

def test_every_patch_in_the_source_is_listed():
    "Each @patch in clfast's sources, each kernel registered on aten, each attribute set on another library is listed"
    listed = {(p.by, p.target.split(':')[1].split('.')[-1]) for p in PATCHES}
    found = set()
    for f in (ROOT/'clfast').rglob('*.py'):
        mod = '.'.join(f.relative_to(ROOT).with_suffix('').parts)
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(getattr(d, 'id', None) == 'patch' for d in node.decorator_list):
                found.add((mod, node.name))
            if isinstance(node, ast.Call) and getattr(node.func, 'id', None) == '_take_fastai_name':   # a name in fastai's `all` modules
                found.add((mod, node.args[0].attr))
            if isinstance(node, ast.Call) and getattr(node.func, 'attr', None) == 'impl' and ast.unparse(node).startswith('_lstm_lib'):
                found.add((mod, 'input'))
            if isinstance(node, ast.Call) and str(getattr(node.func, 'id', '')).startswith('register_module_'):
                found.add((mod, node.func.id))   # torch's global hooks on every nn.Module
            if isinstance(node, ast.Assign):
                for t in node.targets:   # nn.SyncBatchNorm.x = ..., sys.modules[name].x = ... (another library's attribute)
                    if isinstance(t, ast.Attribute) and ast.unparse(t).startswith(('nn.', 'sys.modules[', 'torch.')) \
                       and not t.attr.startswith('_clfast'):
                        found.add((mod, t.attr))
    assert found - listed == set(), f"patches missing from clfast.patches.PATCHES: {found - listed}"
    assert listed - found == set(), f"listed patches not found in the source: {listed - found}"

def test_patches_are_in_effect_where_and_when_listed():
    "Importing one module patches nothing else; clfast.all installs what is made at import; fusing, the converters"
    out = _run("""
        import clfast.fuse, clfast.fused, clfast.ops
        from clfast.patches import installed
        print(sorted(k for k, v in installed().items() if v))
        import timm.layers, torch.nn as nn
        from clfast.all import *
        from clfast.patches import PATCHES
        done = installed()
        print(sorted(p.target for p in PATCHES if done[p.target] != (p.when == 'import')))
        fuse_conv_bn(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
        print(sorted(k for k, v in installed().items() if not v))""")
    assert out.splitlines() == ['[]', '[]', "['torch:ops.aten.lstm.input']"], out

def test_each_patch_says_why():
    assert all(p.why and p.kind in ('adds', 'replaces', 'wraps', 'registers', 'hooks') and p.by.startswith('clfast.') for p in PATCHES)
    assert len({p.target for p in PATCHES}) == len(PATCHES)

def test_clfast_callbacks_in_either_import_order():
    "`from clfast.all import *` first, fastai's `all` modules after: `ChannelsLast()`/`MixedPrecision()` are still clfast's"
    out = _run("""
        from clfast.all import *
        from fastai.vision.all import *
        print(ChannelsLast.__module__, MixedPrecision.__module__)
        from fastai.tabular.all import *   # an `all` module first imported after clfast
        print(ChannelsLast.__module__, MixedPrecision.__module__)
        import fastai.callback.channelslast as fc, fastai.callback.fp16 as ff   # fastai's own, which exports pickle
        print(fc.ChannelsLast.__module__, ff.MixedPrecision.__module__)""")
    assert out.splitlines() == ['clfast.callback clfast.amp'] * 2 + ['fastai.callback.channelslast fastai.callback.fp16'], out
    out = _run("""
        from fastai.vision.all import *
        from clfast.all import *
        print(ChannelsLast.__module__, MixedPrecision.__module__)""")
    assert out == 'clfast.callback clfast.amp', out

RELOADED = r'''
import importlib, sys, torch, warnings
warnings.simplefilter('ignore')
from fastai.vision.all import *
from clfast.all import *
import clfast.amp, clfast.callback
from clfast.demo import digits_dls, simple_cnn
def learner(): return Learner(digits_dls(bs=8, size=16, device='cpu', n_items=48), simple_cnn(widths=(8, 8)))
before = learner().to_channelslast(amp_mode='bf16')   # callbacks of the classes before the reload
importlib.reload(clfast.amp); importlib.reload(clfast.callback)   # as %autoreload does after an edit
import fastai.callback.all as fa
assert fa.MixedPrecision is clfast.amp.MixedPrecision and fa.ChannelsLast is clfast.callback.ChannelsLast
for learn in (before, learner().to_channelslast(amp_mode='bf16')):
    with learn.no_bar(), learn.no_logging(): learn.fit(1)
    learn.export(sys.argv[1])
    learn.to_fp16()
    assert [type(c).__name__ for c in learn.cbs].count('MixedPrecision') == 1, learn.cbs
    learn.to_contiguous()
    assert not any(type(c).__name__ == 'ChannelsLast' for c in learn.cbs), learn.cbs
print('RELOADED OK')
'''

def test_modules_reloaded_keep_working(tmp_path):
    """`importlib.reload` of clfast's modules (`%autoreload` after an edit): fit and export ran fastai's method through
    clfast's wrapper wrapping itself (RecursionError), and callbacks made before the reload went unrecognised
    (`to_fp16` left two MixedPrecision, `to_contiguous` kept ChannelsLast)"""
    import subprocess, sys
    r = subprocess.run([sys.executable, '-c', RELOADED, str(tmp_path/'export.pkl')], capture_output=True, text=True, timeout=300)
    assert 'RELOADED OK' in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
