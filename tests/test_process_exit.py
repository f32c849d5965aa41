"""Leaving a gloo process without interpreter teardown keeps the exit code and loses no output."""

from __future__ import annotations

import subprocess
import textwrap

from tests.conftest import PYTHON, ROOT, free_port, subprocess_env

SCRIPT = textwrap.dedent("""
    import logging, logging.handlers, sys
    import torch, torch.distributed as dist
    from pipeline.runtime.process_exit import exit_now, leave_process_group

    # Buffered until logging.shutdown(): lost if exit_now skipped it.
    target = logging.FileHandler(sys.argv[2])
    logging.getLogger().addHandler(logging.handlers.MemoryHandler(capacity=1000, target=target))
    logging.getLogger().setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    gathered = [torch.empty(2)]
    dist.all_gather(gathered, torch.ones(2))
    leave_process_group()
    logging.info("logged=%s initialized=%s", gathered[0].tolist(), dist.is_initialized())
    print("printed before exit", end="")  # stdout is a pipe: block-buffered until flushed
    exit_now(3)
""")


def test_exit_now_keeps_the_code_and_flushes_stdout_and_logs(tmp_path):
    log = tmp_path / "run.log"
    proc = subprocess.run([PYTHON, "-c", SCRIPT, str(free_port()), str(log)], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stdout == "printed before exit"
    assert log.read_text().strip() == "logged=[1.0, 1.0] initialized=False"
