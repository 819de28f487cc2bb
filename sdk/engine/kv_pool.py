"""Physical KV memory behind the scheduler's logical blocks.

Device pool bytes: [ state slots: num_slots x state_slot_bytes ][ one scratch state slot ]
[ `checkpoints` state slots ][ pages: num_pages x page_bytes ][ one scratch page ] (no state slot
at all for a model without a State group). The checkpoint slots hold a speculative verify step's
state after each of its tokens (StateMeta.checkpoints), no request's. The scratch page and slot
lie past every block and slot the scheduler hands out: the padding rows of a captured decode
step write their keys there (`scratch_slot`) and read and write their recurrent states there
(`scratch_state_slot`); a group's view ends in the scratch page, so its last row is a scratch
slot too (`PagedMeta.scratch`).
Block b of paged group g is rows [b * block_size, (b + 1) * block_size) of that group's view
[num_pages * blocks_per_page[g] * block_size, padded_row_bytes[g]], seen in the cache dtype.
Host pool: num_host_pages x page_bytes (pinned on CUDA, not zeroed), for retraction and demoted
prefixes.
"""

from __future__ import annotations

import numpy as np
import torch

ROW_ALIGN = 256  # bytes; keeps every group's padded row a whole number of elements


class KvPool:
    def __init__(
        self, layout: dict, block_size: int, dtype: torch.dtype, device: torch.device, checkpoints: int = 0
    ) -> None:
        self.layout, self.block_size, self.dtype, self.device = layout, block_size, dtype, device
        slot_bytes = layout["state_slot_bytes"]
        self.checkpoints = checkpoints if slot_bytes else 0
        # + the scratch slot and the checkpoint slots
        self.state_bytes = (layout["num_slots"] + 1 + self.checkpoints) * slot_bytes if slot_bytes else 0
        self.page_bytes = layout["page_bytes"]
        pages_held = layout["num_pages"] + 1  # + the scratch page
        total = self.state_bytes + pages_held * self.page_bytes
        self.pool = torch.zeros(total, dtype=torch.uint8, device=device)
        pin = device.type == "cuda"
        # not zeroed: a host page is only read back where a retraction or demotion wrote it first
        self.host = torch.empty(layout["num_host_pages"] * self.page_bytes, dtype=torch.uint8, pin_memory=pin)
        pages = self.pool[self.state_bytes :]
        # indexed by scheduler group; None for State groups (their memory is the slot region)
        self.block_bytes: list[torch.Tensor | None] = []  # [num_blocks, block_size * padded_row_bytes]
        self.views: list[torch.Tensor | None] = []  # [num_slots, padded row] in dtype
        for bpp, padded in zip(layout["blocks_per_page"], layout["padded_row_bytes"], strict=True):
            if bpp == 0:
                self.block_bytes.append(None)
                self.views.append(None)
                continue
            blocks = pages.view(pages_held * bpp, block_size * padded)
            self.block_bytes.append(blocks)
            self.views.append(blocks.view(-1, padded).view(dtype))
        self.host_pages = self.host.view(-1, self.page_bytes) if self.page_bytes else self.host
        self.slots = self.pool[: self.state_bytes].view(-1, layout["state_slot_bytes"] or 1)

    def scratch_slot(self, group: int) -> int:
        """A cache slot of `group` that no request owns (in the scratch page)."""
        return self.layout["num_pages"] * self.layout["blocks_per_page"][group] * self.block_size

    def scratch_state_slot(self) -> int:
        """A state slot that no request owns (past the scheduler's)."""
        return self.layout["num_slots"]

    def checkpoint_slot(self, i: int) -> int:
        """Checkpoint i's state slot (0 <= i < checkpoints)."""
        return self.layout["num_slots"] + 1 + i

    def apply(self, c) -> None:
        """The plan's copies that run before the forward pass (offload, reload, state restore)."""
        for g, src, dst in zip(c.to_host_group, c.to_host_src, c.to_host_dst, strict=True):
            blk = self.block_bytes[g][src]
            self.host_pages[dst, : blk.numel()].copy_(blk, non_blocking=True)
        for g, src, dst in zip(c.to_device_group, c.to_device_src, c.to_device_dst, strict=True):
            blk = self.block_bytes[g][dst]
            blk.copy_(self.host_pages[src, : blk.numel()], non_blocking=True)
        self._state_copies(c.state_to_host_slot, c.state_to_host_pages, to_host=True)
        self._state_copies(c.state_to_device_slot, c.state_to_device_pages, to_host=False)
        for src, dst in zip(c.restore_src, c.restore_dst, strict=True):
            self.slots[dst].copy_(self.slots[src])

    def apply_after(self, c) -> None:
        """Copies that run after the forward pass: state snapshots at chunk ends."""
        for src, dst in zip(c.snapshot_src, c.snapshot_dst, strict=True):
            self.slots[dst].copy_(self.slots[src])

    def _state_copies(self, slots: np.ndarray, pages: np.ndarray, to_host: bool) -> None:
        """A request's state (one slot) spans pages_per_state host pages."""
        per, n = self.layout["pages_per_state"], self.layout["state_slot_bytes"]
        for i, slot in enumerate(slots.tolist()):
            idx = torch.from_numpy(np.asarray(pages[i * per : (i + 1) * per], dtype=np.int64))
            if to_host:
                buf = torch.zeros(per * self.page_bytes, dtype=torch.uint8)
                buf[:n] = self.slots[slot].cpu()
                self.host_pages[idx] = buf.view(per, self.page_bytes)
            else:
                self.slots[slot].copy_(self.host_pages[idx].reshape(-1)[:n])
