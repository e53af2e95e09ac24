import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test item (`item.rep_call`), so that a fixture's teardown
    can tell whether its test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
