"""A weight version's object-store publish, run after its broadcast instead of before it.

Under ``weight_sync.placement: broadcast`` the rollout worker receives each version from trainer
rank 0 as a collective; the object store's copy of it is for durability (checkpoints and resume,
``deltaloop sync fetch``, a replaced worker, the fallback when the group breaks), not for the
worker's next rollout. So rank 0 keeps the version's bf16 tensors after the train step
(:class:`PublishBehind`), sends them first, and then encodes and uploads them (read from the
sender's buffer once sent: :meth:`infra.weightsync.broadcast.Sender.sent_tensors`) on a thread of
their own while the next rollout batch is generated and scored. Time from "trainer has the new weights" to
"worker serves them" is then the broadcast alone.

Nothing may observe the store without the version once the trainer moves on: every trainer op
that reads or writes the store (the next publish, a republish, a checkpoint, an export, a restore,
shutdown) first :meth:`~PublishBehind.settle`\\ s it. A publish that failed on its thread is tried
once more there, in the op's own thread; if that fails too the op fails with the storage error and
the version stays pending, so the next op tries again: a version is never skipped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class PublishBehind:
    """One version's publish (``publish(tensors)`` returns its record), started after its broadcast."""

    def __init__(self, version: int, tensors: dict[str, "torch.Tensor"],
                 publish: Callable[[dict[str, "torch.Tensor"]], dict[str, Any]]) -> None:
        self.version, self.tensors = version, tensors
        self._publish = publish
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] | None = None
        self._error: BaseException | None = None

    def start(self) -> None:
        """Begin the publish on a thread of its own (no-op once it started or was settled)."""
        if self._thread is None and self._result is None and self._error is None:
            self._thread = threading.Thread(target=self._run, name=f"publish-behind-v{self.version}", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._result, self._error = self._publish(self.tensors), None
        except BaseException as exc:  # kept for settle(), which tries once more or raises it
            self._error = exc

    def settle(self) -> dict[str, Any]:
        """Wait until the version is committed (publishing it here if it has not started); its record.

        A publish that failed is tried once more in this thread; a second failure is raised and
        leaves the publish pending (a later ``settle`` tries again)."""
        if self._thread is not None:
            self._thread.join()
        if self._result is None:  # not started, or it failed
            if self._error is not None:
                log.warning("weight version %d: publish after broadcast failed (%s); publishing it again",
                            self.version, self._error)
            self._run()
        if self._result is None:
            assert self._error is not None
            raise self._error
        return self._result
