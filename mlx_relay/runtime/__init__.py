"""Actor runtime on anyio: typed bounded mailboxes, tell/ask/stream, supervision."""

from mlx_relay.runtime.actor import Actor, ActorCell, ActorRef
from mlx_relay.runtime.errors import ActorCrashed, ActorStopped, AskTimeout, Rejection, RuntimeFault
from mlx_relay.runtime.replies import ReplyFuture, ReplyStream
from mlx_relay.runtime.system import ActorSystem

__all__ = [
    "Actor",
    "ActorCell",
    "ActorCrashed",
    "ActorRef",
    "ActorStopped",
    "ActorSystem",
    "AskTimeout",
    "Rejection",
    "ReplyFuture",
    "ReplyStream",
    "RuntimeFault",
]
