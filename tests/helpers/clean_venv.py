"""A virtual environment without some distributions, for tests that must run where they are absent
(the GPU image has no torchx, tritonclient or fbgemm_gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

#: the optional distributions the device image lacks
OPTIONAL = ("torchx", "tritonclient", "fbgemm_gpu")


def venv_without(path: str | os.PathLike, blocked: tuple[str, ...] = OPTIONAL) -> str:
    """Create a venv at ``path`` whose site-packages links every entry of this interpreter's
    site-packages except the packages and ``.dist-info`` of ``blocked`` (and dlrmctl's editable
    install: the tests put the checkout on ``PYTHONPATH``).  Returns its ``python``."""
    path = os.fspath(path)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True, timeout=120)
    py = os.path.join(path, "bin", "python")
    dst = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                         capture_output=True, text=True, timeout=60).stdout.strip()
    src = sysconfig.get_paths()["purelib"]
    keys = tuple(b.lower().replace("-", "_") for b in blocked) + ("dlrmctl", "__editable__.dlrmctl", "_dlrmctl")
    for name in os.listdir(src):
        n = name.lower().replace("-", "_")
        if n.startswith(keys) or os.path.exists(os.path.join(dst, name)):
            continue
        os.symlink(os.path.join(src, name), os.path.join(dst, name))
    return py
