import ast
import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# the direct-I/O measurement of each file system is remembered here, not in the user's cache
os.environ.setdefault(
    "SHARDSAFE_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"shardsafe-tests-{os.getuid()}")
)

from distributed import preload_forkserver
from s3server import s3_bucket_url, s3_server, s3_url  # noqa: F401

# Every rank the tests start is forked from one server that imported torch once.
preload_forkserver()

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def ckpt_dir(tmp_path):
    """A fresh directory under which tests create checkpoints."""
    return tmp_path


# --------------------------------------------------------------------------- nothing runs silently
# A test file whose tests are never collected passes unnoticed: a module that yields no test
# (its tests renamed, or hidden behind a condition), a file of tests whose name pytest does not
# match, or a run that selects nothing at all. Each fails the run instead.


def _defines_tests(path: Path) -> bool:
    """Whether ``path`` defines a module-level ``test_*`` function or a ``Test*`` class."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return False
    return any(
        (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test"))
        or (isinstance(n, ast.ClassDef) and n.name.startswith("Test"))
        for n in tree.body
    )


class _NothingSilent:
    """Collects the modules that imported fine and held no test; fails the run over them."""

    def __init__(self) -> None:
        self.empty: list[str] = []

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        # A module skipped as a whole reports "skipped" (and says why), one that fails to
        # import reports "failed": only one that imported and holds no test is silent.
        if report.nodeid.endswith(".py") and report.outcome == "passed" and not report.result:
            self.empty.append(report.nodeid)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        problems = [f"{nodeid}: no test collected from it" for nodeid in self.empty]
        for arg in session.config.args:
            root = Path(arg.split("::")[0]).resolve()
            if root.is_dir() and (root == TESTS or TESTS in root.parents):
                problems += [
                    f"{path.relative_to(TESTS.parent)} defines tests that pytest never "
                    "collects: name it test_*.py"
                    for path in sorted(root.rglob("*.py"))
                    if not path.name.startswith("test_") and _defines_tests(path)
                ]
        if not session.items and not session.testsfailed:  # collection errors say more
            problems.append(f"no test selected from {' '.join(session.config.args)}")
        if problems:
            raise pytest.UsageError("\n".join(problems))


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_NothingSilent(), "nothing-silent")
