import pytest
from hub_fixtures import hub, manager  # noqa: F401 - fixtures of the download and hub-error tests


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keeps each phase's report on the test item (`item.rep_call`), so that a fixture's teardown
    can tell whether its test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
