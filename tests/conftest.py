import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def ckpt_dir(tmp_path):
    """A fresh directory under which tests create checkpoints."""
    return tmp_path


from s3server import s3_bucket_url, s3_server, s3_url  # noqa: E402, F401
