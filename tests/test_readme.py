"""The README's examples run as written: its multi-process script, started with the README's `torchrun` command."""
import os, re, subprocess, sys
from pathlib import Path
import pytest

README = Path(__file__).resolve().parents[1]/'README.md'

def _block_after(marker:str, lang:str) -> str:
    "The first ```lang code block of the README after the line containing `marker`"
    text = README.read_text()
    return re.search(rf"```{lang}\n(.*?)```", text[text.index(marker):], re.S).group(1)

def test_torchrun_example_trains_to_the_demos_accuracy(tmp_path):
    "`train.py` as the README gives it, under `torchrun --nproc_per_node 2` (gloo on the CPU): both processes >= 90%"
    script = _block_after("Save this as `train.py`", 'python')
    assert 'learn.distrib_ctx()' in script and "fuse='speed'" in script   # sync_bn=True: synchronized fused layers
    (tmp_path/'train.py').write_text(script)
    cmd = _block_after("and start one process per GPU", 'bash').splitlines()[0].split('#')[0].split()
    assert cmd == ['torchrun', '--nproc_per_node', '2', 'train.py']
    torchrun = Path(sys.executable).parent/'torchrun'   # this environment's, as an activated venv would find it
    # TMPDIR: torchrun's log folder (torchelastic_*), which it leaves behind, goes with the test's own folder
    env = {**os.environ, 'PYTHONPATH': str(README.parent), 'TMPDIR': str(tmp_path)}
    p = subprocess.run([str(torchrun), *cmd[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    acc = dict(re.findall(r"process (\d) of 2: accuracy ([\d.]+)", p.stdout))
    assert sorted(acc) == ['0', '1'], p.stdout[-3000:]
    assert all(float(a) >= 0.9 for a in acc.values()), acc
