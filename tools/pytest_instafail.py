"""A pytest plugin that prints each failure as it happens (`-p pytest_instafail` with tools/ on PYTHONPATH): on the lent
GPU machine a run cut off by its time limit still says what failed and why."""
def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\nFAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext[-4000:]}\n",
              flush=True)
