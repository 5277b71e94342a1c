"""Run every notebook in nbs/ the way `nbdev_test` does: each in its own process, cells in order, skipping `#| eval: false`.
The processes are forked from one that imported what every notebook imports (`PRELOAD`): 5-10 s of imports once, not
in each of some 40 processes"""
import gc, importlib, os, subprocess, sys, traceback, pytest
import preloaded
from pathlib import Path

NBS = Path(__file__).parent.parent/'nbs'
SKIP_FLAGS = {'slow', 'cuda'} - set(os.environ.get('CLFAST_NB_FLAGS', '').split())
# not clfast, whose notebooks set its environment (CLFAST_CACHE_DIR, TRITON_INTERPRET for its kernels) before they import it
PRELOAD = (*preloaded.PRELOAD, 'execnb.shell')

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

def serve():
    """Import `PRELOAD`, then for each line `notebook<TAB>log` read from stdin run the notebook in a child forked from
    this process, its output to the log, and answer the child's exit status on a line"""
    for m in PRELOAD: importlib.import_module(m)
    # what the children inherit, out of their garbage collector's sight: its full collections and the interpreter's
    # teardown at a child's exit walked (and so copied, page by page) all of it, 2-4 s a notebook (10 of them: 64 -> 27 s)
    gc.freeze()
    for line in sys.stdin:
        path, log = line.rstrip('\n').split('\t')
        pid = os.fork()
        if pid == 0:   # the child: the notebook's own process
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC); os.dup2(fd, 1); os.dup2(fd, 2); os.close(fd)
            try: run_notebook(Path(path)); code = 0
            except Exception: traceback.print_exc(); code = 1
            sys.exit(code)   # as a process that ran the notebook and ended: its atexit handlers run, sys.stdout is flushed
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)

@pytest.fixture(scope='module')
def notebook_process():
    "Run a notebook in its own process, forked from a server that imported `PRELOAD`: (exit status, its output)"
    root = str(NBS.parent)
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([root, os.environ.get('PYTHONPATH', '')])}
    server = subprocess.Popen([sys.executable, __file__, '--serve'], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    def run(nb:Path, log:Path) -> tuple[int|None, str]:
        server.stdin.write(f"{nb}\t{log}\n"); server.stdin.flush()
        status = server.stdout.readline().strip()   # '' where the server itself died
        return (int(status) if status else None), (log.read_text() if log.exists() else '')
    yield run
    server.stdin.close(); server.wait(timeout=60)

@pytest.mark.parametrize('nb', sorted(p.name for p in NBS.glob('[!_]*.ipynb')))
def test_notebook_runs(nb, notebook_process, tmp_path):
    # a process per notebook, as nbdev_test: notebooks register torch.library ops and import triton in their own ways
    status, out = notebook_process(NBS/nb, tmp_path/'out.log')
    assert status == 0, f"{nb} failed (exit status {status}):\n{out[-8000:]}"

if __name__ == '__main__':
    if sys.argv[1:] == ['--serve']: serve()
    else: run_notebook(Path(sys.argv[1]))
