"""The pure-torch reference backend: the CPU backend, the fallback where no kernel serves a
call, and the oracle the kernels are tested against. Same semantics as the kernels
(docs/api.md), float32 math (float64 for float64 inputs), tiled so that memory never grows
with Tq x Tk.

- `forward`: one stage of partial attention merged into accumulators (`reference_forward_stage`).
- `backward`: one stage's contribution to dq, dk, dv (`reference_backward_stage`).
- `masks`: slice geometry as row blocks and column tiles, shared by both.
"""
