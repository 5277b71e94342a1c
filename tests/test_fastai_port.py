"""fastai's own notebook checks (18_callback.fp16, 18a_callback.training, 18c_callback.channelslast, 13a_learner's
save/load/export), ported in `fastai_port_cases.py`, run once on stock fastai and once with `from clfast.all import *`:
clfast passes every check stock fastai passes, and the checks where clfast deliberately differs pass on their side."""
import json, os, subprocess, sys
from pathlib import Path
import pytest

CASES = Path(__file__).with_name('fastai_port_cases.py')
# a CPU-only run today: stock passes 41 (35 checks both run + 6 stock-only), clfast 42 (35 + 7 clfast-only);
# far fewer means the harness broke, not the libraries
MIN_STOCK_PASSES, MIN_SHARED = 38, 33

@pytest.fixture(scope='module')
def results(tmp_path_factory):
    "`{mode: {case: result}}`, the stock and the clfast run side by side (separate processes: clfast's patches are global)"
    tmp = tmp_path_factory.mktemp('fastai_port')
    # CLFAST_KERNELS=ref: the fused conv-BN case runs clfast's pure-PyTorch path, so this file never waits for the
    # one-time C++ kernel build (test_ops/test_fused check the kernels against that path)
    env = {**os.environ, 'CLFAST_KERNELS': 'ref', 'OMP_NUM_THREADS': '1'}
    procs = {mode: subprocess.Popen([sys.executable, str(CASES), mode, str(tmp/f'{mode}.json')], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for mode in ('stock', 'clfast')}
    res = {}
    for mode, p in procs.items():
        try: out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs.values(): q.kill()
            pytest.fail(f"the {mode} run of the ported fastai checks took over 240 s")
        assert p.returncode == 0, f"the {mode} run crashed:\n{err[-4000:]}"
        res[mode] = json.loads((tmp/f'{mode}.json').read_text())['results']
    assert res['stock'].keys() == res['clfast'].keys()
    return res

def _with(results, mode, prefix): return {k: v for k, v in results[mode].items() if v.startswith(prefix)}

def test_stock_fastai_passes_the_ported_checks(results):
    "Guards the comparison below: a harness that passes nothing on stock fastai would compare nothing"
    passed, failed = _with(results, 'stock', 'pass'), _with(results, 'stock', 'fail')
    assert len(passed) >= MIN_STOCK_PASSES, f"stock fastai passed only {len(passed)}; failures: {json.dumps(failed, indent=1)}"

def test_clfast_passes_every_check_stock_fastai_passes(results):
    stock, clf = results['stock'], results['clfast']
    shared = [k for k in stock if stock[k] == 'pass' and not clf[k].startswith('skip')]
    assert len(shared) >= MIN_SHARED, f"only {len(shared)} checks ran and passed on stock fastai and ran with clfast"
    broken = {k: clf[k] for k in shared if clf[k] != 'pass'}
    assert not broken, "passes on stock fastai, fails with clfast:\n" + json.dumps(broken, indent=1)

def test_clfast_deliberate_differences_hold(results):
    "The clfast-only checks: one MixedPrecision at a time, real CPU autocast, batches converted, contiguous export"
    ours = {k: v for k, v in results['clfast'].items() if results['stock'][k] == 'skip: clfast only'}
    assert len(ours) >= 7, sorted(ours)
    assert all(v == 'pass' for v in ours.values()), json.dumps(ours, indent=1)

def test_stock_behaviour_clfast_differs_from_still_holds(results):
    "The stock-only counterparts: what fastai does where clfast differs (so the README's list stays true)"
    theirs = {k: v for k, v in results['stock'].items() if results['clfast'][k] == 'skip: stock only'}
    assert len(theirs) >= 6, sorted(theirs)
    assert all(v == 'pass' for v in theirs.values()), json.dumps(theirs, indent=1)
