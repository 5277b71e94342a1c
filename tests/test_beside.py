"""What the test command (tools/test.sh) runs beside the suite, at the lowest priority, on the cores the suite leaves
idle: the smoke run at the lowest admitted torch (tools/smoke_torch.sh) and the numerics tests at each instruction-set
level below this CPU's (tools/isa_matrix.py). Each test waits for its run to end and passes or fails with it; they
are ordered last (tests/conftest.py), and their output is shown with pytest's summary. Outside the test command
(no CLFAST_TEST_BESIDE) they are skipped: run those tools directly"""
import os, time, pytest
from pathlib import Path

pytestmark = pytest.mark.isa_neutral   # (what they wait for sets its own levels)

# How long a test waits for its run beyond the suite's end: on a Zen 3 (the slowest kind yet) the smoke run's
# install and run took 415 s and the ISA matrix 182 s before the suite, at full priority
WAIT_S = 40 * 60

def beside_dir() -> Path|None:
    "Where the test command's runs beside the suite write `NAME.log` and `NAME.rc`: None outside the test command"
    d = os.environ.get('CLFAST_TEST_BESIDE')
    return Path(d) if d else None

def outcome(name:str, wait_s:float=WAIT_S, poll_s:float=1.) -> tuple[int, str]:
    "`(exit status, output)` of the run `name` beside the suite, once it has ended; skips where the test command did not start it"
    d = beside_dir()
    if d is None: pytest.skip("run by the test command (tools/test.sh) beside the suite")
    log, rc = d/f'{name}.log', d/f'{name}.rc'
    if not log.exists() and not rc.exists(): pytest.skip(f"the test command did not start {name} (its switch is 0)")
    t0 = time.monotonic()
    while not rc.exists():
        if time.monotonic() - t0 > wait_s:
            pytest.fail(f"{name} beside the suite had not ended {wait_s:.0f} s after the suite; its output so far:\n"
                        f"{log.read_text()[-5000:]}")
        time.sleep(poll_s)
    return int(rc.read_text()), log.read_text()

@pytest.mark.parametrize('name', ['isa_matrix', 'smoke'])
def test_beside_the_suite(name):
    "The ISA matrix (every level below this CPU's) and the smoke run at the lowest admitted torch ended with exit 0"
    code, out = outcome(name)
    assert code == 0, f"{name} beside the suite exited {code}:\n{out[-20000:]}"

def test_outcome_waits_for_the_exit_status(tmp_path, monkeypatch):
    "A run's outcome is read once its exit status is there, never from the output of a run still going"
    monkeypatch.setenv('CLFAST_TEST_BESIDE', str(tmp_path))
    (tmp_path/'job.log').write_text('running\n')
    with pytest.raises(pytest.fail.Exception, match='had not ended'): outcome('job', wait_s=0.2, poll_s=0.05)
    (tmp_path/'job.log').write_text('running\ndone\n')
    (tmp_path/'job.rc').write_text('3\n')
    assert outcome('job') == (3, 'running\ndone\n')
    with pytest.raises(pytest.skip.Exception, match='did not start other'): outcome('other')
