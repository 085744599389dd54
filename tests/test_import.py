"""``import pbs`` stays light: no torch._dynamo (about a second) and no Triton until they are used."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import pbs


def _import_in_fresh_process(statement: str) -> dict:
    """What ``statement`` adds to ``sys.modules`` after ``import torch``, in a new interpreter."""
    code = (
        "import json, sys\n"
        "import torch\n"
        "before = set(sys.modules)\n"
        f"{statement}\n"
        "print(json.dumps({'torch_loads_dynamo': 'torch._dynamo' in before,\n"
        "                  'added': sorted(set(sys.modules) - before)}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a plain user's process
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_pbs_loads_neither_dynamo_nor_triton():
    result = _import_in_fresh_process("import pbs")
    assert not result["torch_loads_dynamo"], "this torch imports torch._dynamo itself; the check below means nothing"
    added = result["added"]
    assert "torch._dynamo" not in added, "import pbs pulled in torch._dynamo (e.g. a torch.compiler decorator)"
    assert not [m for m in added if m == "triton" or m.startswith("triton.")], "import pbs imported Triton"


def test_config_json_carries_dynamos_constant_mark():
    """pbs.api marks `_config_json` by hand with what `torch.compiler.assume_constant_result` sets
    (the decorator would import torch._dynamo); this pins that the decorator sets only that."""

    def probe(config):
        return config

    assert torch.compiler.assume_constant_result(probe) is probe
    assert vars(probe) == {"_dynamo_marked_constant": True}
    assert vars(pbs.api._config_json) == vars(probe)
