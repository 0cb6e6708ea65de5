"""The handle returned by group_cast / group_reduce."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

import torch

__all__ = ["GroupCollectiveWork"]


class GroupCollectiveWork:
    """A pending group collective: transport work(s) plus the post-processing that follows.

    ``wait()`` waits for the transport (the torch.distributed works), then runs the
    post-processing exactly once (the range-scatter into ``output``, or the reduction) and
    returns ``output``. A call made with ``async_op=False`` returns an already finished work,
    whose ``wait()`` only returns ``output``.

    The handle keeps the temporary send/receive buffers alive until ``wait()``; drop it only
    after waiting. On CUDA, ``wait()`` orders the current stream after the transport, as
    ``torch.distributed.Work.wait`` does, and enqueues the post-processing on that stream.
    """

    __slots__ = ("_done", "_keepalive", "_post", "_result", "_what", "_works")

    def __init__(
        self,
        result: torch.Tensor,
        works: Sequence = (),
        post_process: Callable[[], None] | None = None,
        keepalive: tuple = (),
        what: str = "",
    ) -> None:
        self._result = result
        # names the call in the note added to a transport error (``wait``)
        self._what = what
        # Send/receive buffers must outlive the transport; released once wait() has finished.
        self._keepalive = keepalive
        self._works = [w for w in works if w is not None]
        self._post = post_process
        self._done = False

    @classmethod
    def finished(cls, result: torch.Tensor) -> GroupCollectiveWork:
        work = cls(result)
        work._done = True
        return work

    def wait(self, timeout: datetime.timedelta | None = None) -> torch.Tensor:
        """Finish the collective; returns ``output``.

        ``timeout`` is passed to ``torch.distributed.Work.wait`` (the process group's own
        timeout applies when it is None).

        A transport error (a peer raised or exited, or did not reach this call within the
        timeout) is raised as the transport raised it, with a note naming this call (the
        backend's ``what``); the group cannot be used afterwards.
        """
        if not self._done:
            try:
                for w in self._works:
                    if timeout is None:
                        w.wait()
                    else:
                        w.wait(timeout)
            except Exception as e:
                if self._what:
                    e.add_note(
                        f"{self._what}: the transport failed: a peer raised, exited or did not "
                        "reach this call within the process group's timeout "
                        "(init_process_group(timeout=...)); this group cannot be used any more"
                    )
                raise
            self._works = []
            if self._post is not None:
                with torch.no_grad():
                    self._post()
                # Release the send/receive buffers held by the closure.
                self._post = None
            self._keepalive = ()
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        """True once ``wait()`` has run (or the call was synchronous)."""
        return self._done

    @property
    def output(self) -> torch.Tensor:
        """The output tensor (only valid after ``wait()``)."""
        return self._result

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"GroupCollectiveWork({state}, output={tuple(self._result.shape)})"
