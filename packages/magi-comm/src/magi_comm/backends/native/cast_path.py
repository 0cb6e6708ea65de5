"""group_cast on the native backend: through the receive regions, or straight into a symmetric output.

``packages/magi-comm/docs/native.md`` ("Send", "Direct mode").
"""

from __future__ import annotations

import torch

from .group_state import GroupState
from .layout import SINK_SCATTER, row_bytes
from .outputs import recent
from .transport import Field, Transport

__all__ = ["CastPath"]


class CastPath:
    """The body of one backend's group_cast (enqueued on the group stream).

    Args:
        state: the group's shared state (symmetric outputs, map width, map tokens).
        transport: the backend's transport.
    """

    def __init__(self, state: GroupState, transport: Transport) -> None:
        self.state = state
        self.transport = transport

    def run(self, input: torch.Tensor, output: torch.Tensor, plan) -> tuple:
        """Cast ``input`` rows into ``output`` (a contiguous copy where either is not); returns
        what must stay alive until the call is done (the map table until the puts read it)."""
        src = input.contiguous()
        sink = (
            output
            if output.is_contiguous()
            else torch.empty_like(output, memory_format=torch.contiguous_format)
        )
        rb = row_bytes(src)
        direct = self.direct_maps(plan, sink, rb)
        maps = direct[1] if direct else None
        self.transport.move(plan, SINK_SCATTER, [Field(src, sink, rb)], maps=maps)
        if sink is not output:
            output.copy_(sink)
        return (src, sink, direct)

    def direct_maps(self, plan, sink: torch.Tensor, rb: int):
        """Direct mode of a group_cast into ``sink`` (rows of ``rb`` bytes): ``(table, maps)``
        where ``maps`` gives per source the ``(address, nbytes, token)`` of this rank's map for
        it inside the device ``table`` (the token names the map's content, so an unchanged map
        is not put again); None when ``sink`` is not in a symmetric output, not 16-byte
        aligned, or a source sends more than ``map_entries`` splits.

        Cached on the plan for the last few sinks. The key names the allocation by slot and
        generation (a freed slot's next allocation may contain the same address at another
        offset) and the sink's address and row size."""
        outputs = self.state.outputs
        a = outputs.index(sink)
        if a is None or rb == 0 or sink.data_ptr() % 16:
            return None
        key = (a, outputs.generation[a], sink.data_ptr(), rb)
        offset = sink.data_ptr() - outputs.spans[a][0]
        maps = recent(plan, "native-maps", key, lambda: self._build_maps(plan, a, offset, rb))
        return maps or None

    def _build_maps(self, plan, a: int, offset: int, rb: int):
        """The maps of :meth:`direct_maps` for a sink ``offset`` bytes into output ``a``, or
        False when a source sends more splits than a map row holds."""
        st = self.state
        sources = [s for s in range(st.world) if s != st.rank and plan.recv_counts[s] > 0]
        if any(len(plan.recv_split_ids[s]) >= st.map_width for s in sources):
            return False
        starts = [0]
        for n in plan.output_split_sizes:
            starts.append(starts[-1] + n * rb)
        rows = [[1 + a] + [offset + starts[j] for j in plan.recv_split_ids[s]] for s in sources]
        with st.on_stream():  # ahead of the puts reading it
            table = st.to_device(torch.tensor([x for row in rows for x in row], dtype=torch.int64))
        maps, pos = {}, table.data_ptr()
        for s, row in zip(sources, rows):
            st.counts.map_tokens += 1
            maps[s] = (pos, 8 * len(row), st.counts.map_tokens)
            pos += 8 * len(row)
        return table, maps
