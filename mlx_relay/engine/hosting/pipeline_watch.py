"""Each pipeline rank's liveness, outside MLX's collectives (plain TCP, threads of their own, no MLX).

    rank 0: LocalEngine._boot -> pipeline_boot.lead_group -> FollowerWatch (a reader thread per follower)
    rank r: run_follower -> pipeline_boot.follow_group -> LeaderWatch (a reader thread)

MLX's ring backend does not end a collective whose peer died: it logs "Too many send/recv errors"
and the evaluation waiting on it never returns. So every follower also holds one TCP connection to
rank 0, opened at boot (rank 0 listens on a port of its own choosing and tells the followers where
in the first frame it shares, `WatchLeader`, with a token that a stranger's connection lacks).
Nothing is ever sent on it after the hello: each side's reader thread blocks in `recv` until the
other process is gone (the kernel closes its sockets however it ends, SIGKILL included).

- rank 0 (`FollowerWatch`): a follower's EOF before rank 0 told the followers to stop (`stopping`)
  means that rank died: `on_lost` (the LocalEngine fails its engine; the server exits non-zero).
- a follower (`LeaderWatch`): rank 0's EOF means rank 0 is gone; if the follower's own loop has not
  ended within `LEADER_GRACE_S` (a clean stop's last frame arrives before rank 0's exit closes the
  socket), `on_lost` (the follower exits non-zero instead of waiting in a collective forever).
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable

import msgspec

from mlx_relay.errors import PipelineSetupError

log = logging.getLogger(__name__)

TOKEN_BYTES = 16
CONNECT_TIMEOUT_S = 60.0  # a follower that got the address connects at once; this bounds a dead one
LEADER_GRACE_S = 5.0  # after rank 0's EOF: time for a clean stop's last frame to end the follower's loop


class WatchLeader(msgspec.Struct, frozen=True, tag=True):
    """Rank 0's first frame: where its watch listens, and the token a follower's hello carries."""

    host: str
    port: int
    token: bytes


def _read_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _until_closed(conn: socket.socket) -> None:
    """Block until the peer's side closes (nothing is sent after the hello)."""
    try:
        while conn.recv(4096):
            pass
    except OSError:  # reset by the peer: gone all the same
        pass
    finally:
        conn.close()


class FollowerWatch:
    """Rank 0's view of every follower: one connection each, one reader thread each."""

    def __init__(self, host: str | None, size: int, on_lost: Callable[[str], None]) -> None:
        self._server = socket.create_server((host or "", 0))
        self.address = WatchLeader(host or socket.gethostname(), self._server.getsockname()[1],
                                   secrets.token_bytes(TOKEN_BYTES))
        self._size = size
        self._on_lost = on_lost
        self._stopping = threading.Event()

    def accept(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Wait for every follower's hello (blocking, bounded), then watch each on a thread."""
        pending = set(range(1, self._size))
        deadline = time.monotonic() + timeout_s
        try:
            while pending:
                self._server.settimeout(max(0.0, deadline - time.monotonic()))
                try:
                    conn, _ = self._server.accept()
                    conn.settimeout(max(0.0, deadline - time.monotonic()))
                    hello = _read_exact(conn, TOKEN_BYTES + 4)
                except TimeoutError:
                    raise PipelineSetupError(f"pipeline ranks {sorted(pending)} did not connect to rank 0's watch "
                                             f"within {timeout_s:g}s") from None
                rank = int.from_bytes(hello[TOKEN_BYTES:], "little")
                if hello[:TOKEN_BYTES] != self.address.token or rank not in pending:
                    conn.close()  # not one of ours
                    continue
                conn.settimeout(None)
                pending.discard(rank)
                threading.Thread(target=self._watch, args=(rank, conn), name=f"pipeline-watch-{rank}",
                                 daemon=True).start()
        finally:
            self._server.close()

    def _watch(self, rank: int, conn: socket.socket) -> None:
        _until_closed(conn)
        if not self._stopping.is_set():
            self._on_lost(f"pipeline rank {rank} is gone (its connection to rank 0 closed)")

    def stopping(self) -> None:
        """Rank 0 tells the followers to stop: their exits from now on are expected."""
        self._stopping.set()


class LeaderWatch:
    """A follower's view of rank 0: one connection, one reader thread."""

    def __init__(self, address: WatchLeader, rank: int, on_lost: Callable[[str], None]) -> None:
        try:
            conn = socket.create_connection((address.host, address.port), timeout=CONNECT_TIMEOUT_S)
            conn.sendall(address.token + rank.to_bytes(4, "little"))
        except OSError as exc:
            raise PipelineSetupError(f"cannot reach rank 0's watch at {address.host}:{address.port}: {exc}") from exc
        conn.settimeout(None)
        self._done = threading.Event()
        self._on_lost = on_lost
        threading.Thread(target=self._watch, args=(conn,), name="pipeline-watch-0", daemon=True).start()

    def _watch(self, conn: socket.socket) -> None:
        _until_closed(conn)
        if not self._done.wait(LEADER_GRACE_S):
            self._on_lost("pipeline rank 0 is gone (its connection closed)")

    def done(self) -> None:
        """The follower's loop ended (rank 0 told it to stop)."""
        self._done.set()
