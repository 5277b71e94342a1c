"Run every notebook in nbs/ the way `nbdev_test` does: each in its own process, cells in order, skipping `#| eval: false`."
import os, subprocess, sys, pytest
from pathlib import Path

NBS = Path(__file__).parent.parent/'nbs'
SKIP_FLAGS = {'slow', 'cuda'} - set(os.environ.get('CLFAST_NB_FLAGS', '').split())

def _no_eval(cell):
    "True for cells nbdev_test would skip"
    if cell.cell_type != 'code' or 'nbdev_export(' in cell.source: return True
    directives = {l.split(':')[0].strip('#| ').strip(): l.split(':', 1)[1].strip() if ':' in l else ''
                  for l in cell.source.splitlines() if l.startswith('#|')}
    return directives.get('eval', '').lower() == 'false' or bool(SKIP_FLAGS & set(directives))

def run_notebook(path:Path):
    "Execute the notebook at `path` in this process, stopping at the first failing cell"
    from fastcore.nbio import read_nb
    from execnb.shell import CaptureShell
    path = path.resolve()
    os.chdir(path.parent)
    shell = CaptureShell()
    shell.run_cell("import matplotlib; matplotlib.use('Agg')")
    shell.run_all(read_nb(path), exc_stop=True, preproc=_no_eval)

@pytest.mark.parametrize('nb', sorted(p.name for p in NBS.glob('[!_]*.ipynb')))
def test_notebook_runs(nb):
    # a process per notebook, as nbdev_test: notebooks register torch.library ops and import triton in their own ways
    root = str(NBS.parent)
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([root, os.environ.get('PYTHONPATH', '')])}
    r = subprocess.run([sys.executable, __file__, str(NBS/nb)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, f"{nb} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"

if __name__ == '__main__': run_notebook(Path(sys.argv[1]))
