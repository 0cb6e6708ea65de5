"""A reduce's send by the copy engines (``NativeConfig.copy_engine``): the rows go by
``memcpy`` into the peers' regions, then a copy-kernel launch without rows publishes the pull
headers and signals, as the kernel's send would have after its rows."""

from __future__ import annotations

from collections.abc import Callable

from .layout import TaskTable

__all__ = ["CopyEngineSend", "copy_engine_copies"]

# (source byte offset, destination address, bytes)
Copy = tuple[int, int, int]


def copy_engine_copies(table: TaskTable, peers: list[int | None], row_bytes: int) -> list[Copy]:
    """One copy per task and destination of a fused reduce's send ``table`` (rows of
    ``row_bytes`` bytes) to peer ``c``'s area at ``peers[c]`` (its regions). Such a table has no
    sink column (a reduce's own rows are read where they lie: ``layout._send_tasks``)."""
    W = len(peers)
    copies: list[Copy] = []
    src, nrows, dst = table.src_row.tolist(), table.nrows.tolist(), table.dst_row.tolist()
    for s, n, row in zip(src, nrows, dst):
        assert row[W] < 0, "a fused reduce's send task into the sink"
        for c in range(W):
            if row[c] >= 0:
                base = peers[c]
                assert base is not None, f"a send task to peer {c}, which has no region area"
                copies.append((s * row_bytes, base + row[c] * row_bytes, n * row_bytes))
    return copies


class CopyEngineSend:
    """Stands in for a round's send `CopyLaunch`: the ``copies`` by ``memcpy`` (the platform's,
    on the call's stream), then ``launch``, a launch of the same options without rows (it
    publishes and signals). Same call signature and ``publish`` as a send launch; no
    ``progress``."""

    def __init__(self, launch, copies: list[Copy], memcpy: Callable[[int, int, int, object], None]) -> None:
        self.launch = launch
        self.copies = copies
        self.memcpy = memcpy
        self.publish = launch.publish
        self.progress = None

    def __call__(
        self, src: int, sink: int, stream=None, sync: int = 0, words: tuple[int, ...] = (), pub: int = 0
    ):
        for src_off, dst, nbytes in self.copies:
            self.memcpy(dst, src + src_off, nbytes, stream)
        self.launch(src, sink, stream, sync=sync, words=words, pub=pub)
