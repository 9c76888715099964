"""A command run in a real pseudo-terminal of a chosen size, its screen read as a person sees it (pyte)."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def in_a_terminal(cmd: list[str], cols: int, rows: int, timeout: float = 300) -> tuple[bytes, list[str]]:
    """(every byte the command wrote, the non-blank lines of the final screen); the command must exit 0."""
    import fcntl
    import struct
    import termios

    import pyte

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                            env={**os.environ, "TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": str(rows)})
    os.close(slave)
    out, deadline = bytearray(), time.time() + timeout
    while time.time() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: every writer has gone
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=30) == 0, out.decode(errors="replace")[-3000:]
    screen = pyte.Screen(cols, rows)
    pyte.ByteStream(screen).feed(bytes(out))
    return bytes(out), [line.rstrip() for line in screen.display if line.strip()]
