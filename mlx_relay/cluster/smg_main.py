"""`python -m mlx_relay.cluster.smg_main launch ...`: SMG's own `smg` command (`smg.cli.main`), run
so that it ends with the supervisor that started it (`cluster/router.py` runs the router so).

The supervisor holds the write end of this process's stdin and never writes to it; when the
supervisor exits, however it died (SIGKILL included), the kernel closes that end and stdin reads
end-of-file. SMG's own code is not ours to extend and blocks the main thread in its (Rust) server,
so a daemon thread waits for that end-of-file in a blocking read (no polling) and then sends this
process SIGTERM: SMG's graceful stop, as when the supervisor stops it. Works on Linux and macOS.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _terminate_on_stdin_eof(fd: int) -> None:
    while os.read(fd, 65536):  # what is written is dropped; b"" is the end
        pass
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> None:
    from smg.cli import main as smg_main  # the `cluster` extra; router.py checked it is installed

    threading.Thread(target=_terminate_on_stdin_eof, args=(sys.stdin.fileno(),), name="stdin-eof",
                     daemon=True).start()
    smg_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
