"""`python -m titan_moe.<tool> --help` through the modules as a user runs them (their
`__main__`), each listing its own flags."""

from __future__ import annotations

import json
import subprocess
import sys

from tiny import REPO

FLAGS = {
    "titan_moe.plan": ["--gpus", "--gpu-mem-gib", "--ac", "--seq-len", "--hsdp", "--top"],
    "titan_moe.generate": ["--checkpoint", "--prompt", "--max_new_tokens", "--temperature", "--top_k"],
    "titan_moe.export": ["--out", "--checkpoint", "--what", "--capacity", "--device"],
    "titan_moe.report": ["run_dir", "--out"],
    "titan_moe.hf": ["import-k3"],
}

# One interpreter for all (torch imports once): each module runs as `python -m` would run it.
_SCRIPT = """
import contextlib, io, json, runpy, sys
out = {}
for module in json.loads(sys.argv[1]):
    buf = io.StringIO()
    sys.argv = [module, "--help"]
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = None
        except SystemExit as e:
            code = e.code
    out[module] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def test_help_of_each_tool_lists_its_flags():
    proc = subprocess.run([sys.executable, "-W", "ignore::RuntimeWarning", "-c", _SCRIPT, json.dumps(sorted(FLAGS))], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for module, flags in FLAGS.items():
        code, text = results[module]
        assert code in (0, None), (module, text)
        assert f"usage: python -m {module}" in text, (module, text[:300])
        for flag in flags:
            assert flag in text, (module, flag)
