"""How far a cache moves its sinks' keys (and recalled copies) along RoPE positions.

Owns one session's re-rotation settings (``rope_rerotate``: off, ``window`` or ``reach``;
the :class:`~kvfs.torch.rope.RopeShift` of its model, the quantum, the reach) and the shift
of the step being run. The rule is a function of the window alone (:meth:`SinkRotation.
shift_for`), so a resumed or forked session rotates exactly as one that never stopped.
The rotation itself is :mod:`kvfs.torch.rope`'s.

Long sessions: positions keep counting (the query of token ``t`` is at position ``t``),
so without re-rotation the sinks sit ``t`` positions away from it; once ``t`` passes the
model's ``max_position_embeddings`` that is a distance the model was never trained on.
``rope_rerotate=True`` (RoPE models, :mod:`kvfs.torch.rope`) rotates the stored sinks'
keys so they sit just before the window (at ``window_start - S``, rounded down to a
multiple of ``rope_quantum`` tokens) and recalled rounds just before the sinks: every
distance a step attends stays within the window, as with transformers' former
``SinkCache``. Only the device copies are rotated; the tiers below hold the model's own
keys. The cache logs one ``logging.warning`` (logger ``kvfs.torch.cache``) when a session
without re-rotation crosses ``max_position_embeddings``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvfs.torch.rope import RopeShift

log = logging.getLogger("kvfs.torch.cache")  # the crossing of max_position_embeddings is the cache's


def rotation_mode(rope_rerotate: bool | str | None) -> str | None:
    """``rope_rerotate`` as a mode: None (off), ``window`` or ``reach``; ValueError else."""
    mode = {False: None, "off": None, True: "window", None: None}.get(rope_rerotate, rope_rerotate)
    if mode not in (None, "window", "reach"):
        raise ValueError(f"rope_rerotate must be off, window or reach, got {rope_rerotate!r}")
    return mode if isinstance(mode, str) else None


class SinkRotation:
    """One session's re-rotation of its sinks and recalled copies (module docstring)."""

    def __init__(self, model_or_config: Any, rope_rerotate: bool | str, max_kv_len: int | None,
                 quantum: int, max_positions: int | None, rope_reach: int | None) -> None:
        if rope_reach is not None and rope_reach < 1:
            raise ValueError(f"rope_reach must be >= 1 or None, got {rope_reach}")
        mode = rotation_mode(rope_rerotate)
        # no window: every position is attended anyway
        self.mode: str | None = mode if max_kv_len is not None else None
        self.rope: RopeShift | None = RopeShift.of(model_or_config) if self.mode else None
        self.window = max_kv_len
        self.quantum = quantum
        # reach: the farthest the sinks may be from a query (within what the model was
        # trained on, a quantum of margin)
        reach = [r for r in (rope_reach, max_positions and max_positions - 1 - quantum) if r]
        self.reach: int | None = min(reach) if reach and self.mode == "reach" else None
        self.max_positions = max_positions
        self.step_shift = 0  # the sinks' shift for the step being run
        self._warned = False  # the crossing of max_position_embeddings was logged

    def begin_step(self, window_start: int, pinned: int, seen: int, sid: str) -> None:
        """Fix the shift of the step about to run (one for every layer: the same window),
        which ends at ``seen`` tokens; log once when it crosses ``max_position_embeddings``."""
        if self.rope is not None:
            self.step_shift = self.shift_for(window_start, pinned) if pinned else 0
        mp = self.max_positions
        if mp and not self._warned and seen > mp:
            self._warned = True
            if self.rope is None:
                log.warning("session %r passes the model's max_position_embeddings (%d) at token "
                            "%d: the sinks are now farther from the query than the model was "
                            "trained on (rope_rerotate keeps them next to the window)", sid, mp, seen)
            else:
                log.info("session %r passes max_position_embeddings (%d) at token %d; its sinks "
                         "are re-rotated next to the window", sid, mp, seen)

    def adopt(self, src: SinkRotation) -> None:
        """Rotate like ``src`` (a fork continues its source's rotation)."""
        self.mode, self.rope, self.reach = src.mode, src.rope, src.reach

    def shift_for(self, window_start: int, sinks: int) -> int:
        """Positions the sinks' keys move for a step whose window starts at ``window_start``.

        ``window``: just before the window, ``window_start - sinks`` rounded down to a
        multiple of ``quantum``. ``reach``: not at all while the sinks are within ``reach``
        positions of the query, then only as far as keeps them there (rounded up), never
        past the window."""
        qn, room = self.quantum, window_start - sinks
        if self.mode == "window" or self.reach is None:
            return room // qn * qn
        need = window_start + (self.window or 0) - self.reach
        return 0 if need <= 0 else min(-(-need // qn) * qn, room // qn * qn)

    def span_shifts(self, spans: list[tuple[int, int]], window_start: int, sinks: int) -> list[int]:
        """Per recalled span, the positions its keys move (0 without re-rotation)."""
        if self.rope is None:
            return [0] * len(spans)
        if self.mode == "window" or self.reach is None:  # end where the sinks begin
            at, out = window_start - sinks - sum(b - a for a, b in spans), []
            for a, b in spans:
                out.append(at - a)
                at += b - a
            return out
        t = self.shift_for(window_start, sinks)  # with the sinks, never past the window
        return [max(0, min(t, window_start - b)) for a, b in spans]

    def rotate_spans(self, k: torch.Tensor, spans: list[tuple[int, int]],
                     shifts: list[int]) -> torch.Tensor:
        """``k`` (the spans' keys, concatenated) with each span moved by its shift."""
        if self.rope is None or not any(shifts):
            return k
        parts, off = [], 0
        for (a, b), shift in zip(spans, shifts, strict=True):
            part = k[..., off:off + b - a, :]
            parts.append(self.rope.rotate(part, shift) if shift else part)
            off += b - a
        return torch.cat(parts, dim=-2)
