"Run every notebook in nbs/ the way `nbdev_test` does: cells in order, in one shell, skipping `#| eval: false` cells."
import os, pytest
from pathlib import Path
from fastcore.nbio import read_nb
from execnb.shell import CaptureShell

NBS = Path(__file__).parent.parent/'nbs'
SKIP_FLAGS = {'slow', 'cuda'} - set(os.environ.get('CLFAST_NB_FLAGS', '').split())

def _no_eval(cell):
    "True for cells nbdev_test would skip"
    if cell.cell_type != 'code' or 'nbdev_export(' in cell.source: return True
    directives = {l.split(':')[0].strip('#| ').strip(): l.split(':', 1)[1].strip() if ':' in l else ''
                  for l in cell.source.splitlines() if l.startswith('#|')}
    return directives.get('eval', '').lower() == 'false' or bool(SKIP_FLAGS & set(directives))

@pytest.mark.parametrize('nb', sorted(p.name for p in NBS.glob('[!_]*.ipynb')))
def test_notebook_runs(nb, monkeypatch):
    monkeypatch.chdir(NBS)
    shell = CaptureShell()
    shell.run_cell("import matplotlib; matplotlib.use('Agg')")
    shell.run_all(read_nb(NBS/nb), exc_stop=True, preproc=_no_eval)
